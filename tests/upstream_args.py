"""The EPP container `args:` of the upstream manifests and charts, read from the files under
tests/fixtures/upstream (never copied by hand): GIE's conformance base manifest (v1.6.0),
GIE v0.5.0's manifest and chart (Go flag syntax, camelCase), and the llm-d router's chart
(v0.10.0) and GIE v1.5.0's chart. The charts are rendered with tools/helm_render
(tests/deploy/conftest.py).

The llm-d router's chart and GIE v1.5.0's take their templates from a library subchart
(`routerlib`, `epplib`), and helm_render renders no subcharts: `with_library` lays out in
a scratch directory what Helm would (see its docstring).
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
GIE_V15_CHARTS = UPSTREAM / "gie-v1.5.0" / "charts"
GIE_V15_VALUES = GIE_V15_CHARTS / "inferencepool" / "values.yaml"


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


def with_library(parent: Path, library: Path, scratch: Path) -> Path:
    """`parent` with its one library subchart (`library`, under the dependency's alias)
    laid out for helm_render: the library's templates under templates/<alias>/, its
    values.yaml under the alias key as the defaults (the parent's values.yaml is then
    given as the first `-f`, as Helm coalesces the parent's values over the subchart's)."""
    chart = scratch / parent.name
    if chart.exists():
        shutil.rmtree(chart)
    meta = yaml.safe_load((parent / "Chart.yaml").read_text())
    (alias,) = [dep["alias"] for dep in meta.pop("dependencies")]
    (chart / "templates" / alias).mkdir(parents=True)
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta))
    for template in (parent / "templates").iterdir():
        shutil.copy(template, chart / "templates" / template.name)
    for template in (library / "templates").iterdir():
        shutil.copy(template, chart / "templates" / alias / template.name)
    library_values = yaml.safe_load((library / "values.yaml").read_text())
    (chart / "values.yaml").write_text(yaml.safe_dump({alias: library_values}))
    return chart


def llm_d_chart(scratch: Path) -> Path:
    """The llm-d router's chart (`llm-d-router-gateway` on the `routerlib` library)."""
    return with_library(LLM_D_CHARTS / "llm-d-router-gateway", LLM_D_CHARTS / "routerlib", scratch)


def gie_v15_chart(scratch: Path) -> Path:
    """GIE v1.5.0's chart (`inferencepool` on the `epplib` library), the last GIE release
    with the EPP charts."""
    return with_library(GIE_V15_CHARTS / "inferencepool", GIE_V15_CHARTS / "epplib", scratch)


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

# GIE v1.5.0's chart as its README's examples set it: several replicas, extra flags (its
# `flags:` map renders `--key` then `"value"`), a Triton model server (legacy metric flags).
GIE_V15_OPERATOR_VALUES: dict[str, Any] = {
    "inferenceExtension": {
        "replicas": 3,
        "flags": {"v": 3, "secure-serving": False, "refresh-metrics-interval": "100ms"},
        "monitoring": {"prometheus": {"auth": {"enabled": False}}},
    },
    "inferencePool": {
        "modelServers": {"matchLabels": {"app": "vllm"}},
        "modelServerType": "triton-tensorrt-llm",
    },
}
