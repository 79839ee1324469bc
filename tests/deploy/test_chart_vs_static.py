"""The chart with its default values renders the objects of deploy/kubernetes/.

Compared after removing what only Helm adds (the labels helm.sh/chart,
app.kubernetes.io/managed-by and app.kubernetes.io/version, and the checksum/* pod
annotations that roll pods when a ConfigMap changes); configuration files inside
ConfigMaps are compared as parsed YAML, since comments differ. Every other difference
is listed in DOCUMENTED and in charts/epp/README.md.
"""

from __future__ import annotations

import copy

import yaml

from deploy.conftest import CHART, example_objects, standalone_envoy_objects, static_objects

HELM_ONLY_LABELS = {"helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/version"}
# (kind, name) in deploy/kubernetes/ but not in the default render, and why.
DOCUMENTED: dict[tuple[str, str], str] = {}


def normalise(obj: dict) -> dict:
    obj = copy.deepcopy(obj)
    labels = obj["metadata"].get("labels", {})
    for key in HELM_ONLY_LABELS:
        labels.pop(key, None)
    template = obj.get("spec", {}).get("template")
    if template:
        annotations = template["metadata"].get("annotations", {})
        for key in [k for k in annotations if k.startswith("checksum/")]:
            del annotations[key]
        if not annotations:
            template["metadata"].pop("annotations", None)
    if obj["kind"] == "ConfigMap":
        obj["data"] = {
            key: yaml.safe_load(value) if key.endswith(".yaml") else value
            for key, value in obj["data"].items()
        }
    return obj


def by_key(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): normalise(o) for o in objects}


def diff(a: dict, b: dict, path: str = "") -> list[str]:
    """Readable differences between two objects (for the assertion message)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                out.append(
                    f"{path}.{key}: {a.get(key, '<absent>')!r} != {b.get(key, '<absent>')!r}"
                )
            else:
                out += diff(a[key], b[key], f"{path}.{key}")
        return out
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def test_default_render_matches_deploy_kubernetes(render_chart):
    static = by_key(static_objects())
    chart = by_key(render_chart(name="epp", namespace="default").objects)
    assert set(static) - set(chart) == set(DOCUMENTED)
    assert set(chart) - set(static) == set()
    problems = {key: diff(static[key], chart[key]) for key in chart}
    assert {k: v for k, v in problems.items() if v} == {}


def test_examples_match_the_chart_with_the_same_values(render_chart):
    """deploy/kubernetes/examples/ (a Gateway and its class, an objective, a rewrite) are
    what the chart renders when asked for them."""
    examples = by_key(example_objects())
    rendered = render_chart(
        set=[
            "gateway.create=true",
            "gateway.className=envoy-gateway",
            "gateway.createClass=true",
            "gateway.controllerName=gateway.envoyproxy.io/gatewayclass-controller",
        ],
        extra_args=[],
    )
    chart = by_key(rendered.objects)
    for key in [("Gateway", "inference-gateway"), ("GatewayClass", "envoy-gateway")]:
        assert diff(examples[key], chart[key]) == []
    for kind in ("InferenceObjective", "InferenceModelRewrite"):
        (example,) = [o for k, o in examples.items() if k[0] == kind]
        assert example["apiVersion"].startswith("llm-d.ai/")  # the chart's default group
        assert example["spec"]["poolRef"] == {
            "group": "inference.networking.k8s.io",
            "kind": "InferencePool",
            "name": chart[("InferencePool", "vllm-llama3-8b-instruct")]["metadata"]["name"],
        }


def test_standalone_envoy_render_matches_deploy_kubernetes(render_chart):
    static = by_key(standalone_envoy_objects())
    rendered = by_key(render_chart(set=["standaloneEnvoy.enabled=true"]).objects)
    chart = {key: obj for key, obj in rendered.items() if key[1].endswith("-envoy")}
    assert set(chart) == set(static)
    assert {k: diff(static[k], chart[k]) for k in chart if diff(static[k], chart[k])} == {}


def test_differences_are_documented_in_the_chart_readme():
    readme = (CHART / "README.md").read_text()
    assert "## Differences from deploy/kubernetes" in readme
    assert "examples/" in readme
    for kind, name in DOCUMENTED:
        assert f"{kind} `{name}`" in readme
    for label in HELM_ONLY_LABELS:
        assert label in readme
