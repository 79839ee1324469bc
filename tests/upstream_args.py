"""The EPP container `args:` of the upstream manifests and charts, read from the files under
tests/fixtures/upstream (never copied by hand): GIE's conformance base manifest (v1.6.0),
GIE v0.5.0's manifest and chart (Go flag syntax, camelCase), and the llm-d router's chart
(v0.10.0). The charts are rendered with tools/helm_render (tests/deploy/conftest.py).

The llm-d router's chart (`llm-d-router-gateway`) takes its templates from a library
subchart (`routerlib`, alias `router`), and helm_render renders no subcharts. `llm_d_chart`
lays out in a scratch directory what Helm would: the parent's templates plus the library's
(under templates/router/), and the library's values.yaml under the alias key as the
defaults, which the parent's values.yaml then overrides (given as the first `-f`).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import yaml

UPSTREAM = Path(__file__).resolve().parent / "fixtures" / "upstream"
CONFORMANCE = UPSTREAM / "gie-v1.6.0" / "conformance" / "base.yaml"
GIE_V05_MANIFEST = UPSTREAM / "gie-v0.5.0" / "manifests" / "inferencepool-resources.yaml"
GIE_V05_CHART = UPSTREAM / "gie-v0.5.0" / "charts" / "inferencepool"
LLM_D_CHARTS = UPSTREAM / "llm-d-router-v0.10.0" / "charts"
LLM_D_VALUES = LLM_D_CHARTS / "llm-d-router-gateway" / "values.yaml"


def documents(text: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def epp_containers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every Deployment's container named `epp` (the name all these files give it)."""
    return [
        container
        for obj in objects
        if obj.get("kind") == "Deployment"
        for container in obj["spec"]["template"]["spec"]["containers"]
        if container["name"] == "epp"
    ]


def plugins_files(objects: list[dict[str, Any]]) -> dict[str, str]:
    """The ConfigMaps' files (e.g. `default-plugins.yaml`): what `--config-file` points at."""
    return {
        name: text
        for obj in objects
        if obj.get("kind") == "ConfigMap"
        for name, text in (obj.get("data") or {}).items()
    }


def conformance_objects() -> list[dict[str, Any]]:
    return documents(CONFORMANCE.read_text())


def gie_v05_manifest_objects() -> list[dict[str, Any]]:
    return documents(GIE_V05_MANIFEST.read_text())


def llm_d_chart(scratch: Path) -> Path:
    """The llm-d router's chart with its library subchart laid out for helm_render."""
    chart = scratch / "llm-d-router-gateway"
    if chart.exists():
        shutil.rmtree(chart)
    (chart / "templates" / "router").mkdir(parents=True)
    parent = LLM_D_CHARTS / "llm-d-router-gateway"
    meta = yaml.safe_load((parent / "Chart.yaml").read_text())
    (alias,) = [dep["alias"] for dep in meta.pop("dependencies")]
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta))
    for template in (parent / "templates").iterdir():
        shutil.copy(template, chart / "templates" / template.name)
    for template in (LLM_D_CHARTS / "routerlib" / "templates").iterdir():
        shutil.copy(template, chart / "templates" / "router" / template.name)
    library_values = yaml.safe_load((LLM_D_CHARTS / "routerlib" / "values.yaml").read_text())
    (chart / "values.yaml").write_text(yaml.safe_dump({alias: library_values}))
    return chart


# Values an operator of the llm-d router's chart sets (its values.yaml marks matchLabels
# REQUIRED): several replicas (leader election), Prometheus without auth, verbosity.
LLM_D_OPERATOR_VALUES: dict[str, Any] = {
    "router": {
        "modelServers": {"matchLabels": {"app": "vllm"}},
        "epp": {"replicas": 2, "flags": {"v": 4}},
        "monitoring": {"prometheus": {"auth": {"enabled": False}}},
    }
}
# The chart's standalone mode (no InferencePool): --endpoint-selector.
LLM_D_STANDALONE_VALUES: dict[str, Any] = {
    "router": {
        "modelServers": {"matchLabels": {"app": "vllm"}},
        "inferencePool": {"create": False},
    }
}
