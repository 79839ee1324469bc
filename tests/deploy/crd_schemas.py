"""Custom resources checked against the upstream CRDs' own schemas.

Every CustomResourceDefinition under tests/fixtures/upstream (the `crd/` folders and the
Istio CRDs llm-d installs) is loaded; each served version's `openAPIV3Schema` becomes a
JSON schema that `jsonschema` checks an object against, as the API server would:

- unknown fields are errors (the API server's strict field validation, kubectl's default):
  every object schema with `properties` and no `additionalProperties` or
  `x-kubernetes-preserve-unknown-fields` gets `additionalProperties: false`;
- `x-kubernetes-int-or-string` accepts an integer or a string, `nullable` accepts null;
- `metadata` is an ObjectMeta: checked by `kubernetes-validate` (strict) as a ConfigMap's;
- CEL rules (`x-kubernetes-validations`): jsonschema cannot run CEL. The rules of the
  inference CRDs (InferencePool, InferenceObjective, InferenceModelRewrite,
  InferenceModel) are translated by hand in `CEL_RULES` and evaluated, with the schema's
  defaults applied first (a test fails if one of their rules has no translation). The
  rules of the other CRDs (Gateway API, Istio, prometheus-operator) are NOT evaluated:
  `validate_custom` returns them as `unevaluated`, and the callers name them.

A kind whose CRD is not among the fixtures has no schema here: `schema_for` returns None
and the callers fail the object.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "upstream"
CRD_FILES = (
    *sorted(FIXTURES.glob("*/crd/*.yaml")),
    FIXTURES / "llm-d-router-v0.10.0" / "deploy" / "components" / "crds-istio" / "istio.yaml",
)
# The CRDs whose every CEL rule must have a translation in CEL_RULES.
INFERENCE_GROUPS = {"inference.networking.k8s.io", "inference.networking.x-k8s.io", "llm-d.ai"}


def _unique_numbers(ports: list[dict]) -> bool:
    numbers = [p.get("number") for p in ports]
    return len(numbers) == len(set(numbers))


def _weights_all_or_none(models: list[dict]) -> bool:
    return all("weight" in m for m in models) or not any("weight" in m for m in models)


# CEL rule text (exactly as in the CRDs) -> the same test in Python, on the defaulted value.
CEL_RULES: dict[str, Callable[[Any], bool]] = {
    "self.kind != 'Service' || has(self.port)": lambda v: v.get("kind") != "Service" or "port" in v,
    "self.all(p1, self.exists_one(p2, p1.number==p2.number))": _unique_numbers,
    "self.all(model, has(model.weight)) || self.all(model, !has(model.weight))": (
        _weights_all_or_none
    ),
    # A transition rule: it compares with the stored object, and a create has none.
    "self == oldSelf": lambda v: True,
}


@dataclass
class CrdVersion:
    source: str  # the fixture's path under tests/fixtures/upstream
    group: str
    version: str
    kind: str
    openapi: dict
    json_schema: dict = field(init=False)

    def __post_init__(self) -> None:
        self.json_schema = to_json_schema(self.openapi)

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"


def to_json_schema(openapi: dict) -> dict:
    """A structural openAPIV3Schema as a closed JSON schema (see the module docstring)."""
    node = {k: v for k, v in openapi.items() if not k.startswith("x-kubernetes-validations")}
    if node.get("x-kubernetes-int-or-string"):
        node.pop("type", None)
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.pop("nullable", False) and "type" in node:
        node["type"] = [node["type"], "null"]
    if "properties" in node:
        node["properties"] = {k: to_json_schema(v) for k, v in node["properties"].items()}
        if "additionalProperties" not in node and not node.get(
            "x-kubernetes-preserve-unknown-fields"
        ):
            node["additionalProperties"] = False
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = to_json_schema(node["additionalProperties"])
    if isinstance(node.get("items"), dict):
        node["items"] = to_json_schema(node["items"])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in node:
            node[key] = [to_json_schema(s) for s in node[key]]
    if "not" in node:
        node["not"] = to_json_schema(node["not"])
    return node


@cache
def crd_versions() -> dict[tuple[str, str], list[CrdVersion]]:
    """(apiVersion, kind) -> every served version of it among the fixtures."""
    index: dict[tuple[str, str], list[CrdVersion]] = {}
    for path in CRD_FILES:
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc.get("kind") != "CustomResourceDefinition":
                continue
            spec = doc["spec"]
            for version in spec["versions"]:
                if not version.get("served"):
                    continue
                crd = CrdVersion(
                    str(path.relative_to(FIXTURES)),
                    spec["group"],
                    version["name"],
                    spec["names"]["kind"],
                    version["schema"]["openAPIV3Schema"],
                )
                index.setdefault((crd.api_version, crd.kind), []).append(crd)
    return index


def schema_for(api_version: str, kind: str) -> list[CrdVersion] | None:
    return crd_versions().get((api_version, kind))


def cel_rules(openapi: dict, path: str = "") -> Iterator[tuple[str, str]]:
    """(path, rule) of every CEL rule in a schema."""
    for rule in openapi.get("x-kubernetes-validations", []):
        yield path, rule["rule"]
    for name, sub in openapi.get("properties", {}).items():
        yield from cel_rules(sub, f"{path}.{name}")
    if isinstance(openapi.get("items"), dict):
        yield from cel_rules(openapi["items"], f"{path}[]")
    if isinstance(openapi.get("additionalProperties"), dict):
        yield from cel_rules(openapi["additionalProperties"], f"{path}{{}}")


def _defaulted(openapi: dict, value: Any) -> Any:
    """The value with the schema's defaults filled in, as the API server stores it."""
    if isinstance(value, dict) and "properties" in openapi:
        value = dict(value)
        for name, sub in openapi["properties"].items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                value[name] = _defaulted(sub, value[name])
    elif isinstance(value, list) and isinstance(openapi.get("items"), dict):
        value = [_defaulted(openapi["items"], v) for v in value]
    return value


def _check_rules(
    openapi: dict, value: Any, path: str, failed: list[str], unevaluated: list[str]
) -> None:
    for rule in openapi.get("x-kubernetes-validations", []):
        test = CEL_RULES.get(rule["rule"])
        if test is None:
            unevaluated.append(f"{path}: {rule['rule']}")
        elif not test(value):
            failed.append(f"{path}: {rule.get('message', rule['rule'])}")
    if isinstance(value, dict):
        for name, sub in openapi.get("properties", {}).items():
            if name in value:
                _check_rules(sub, value[name], f"{path}.{name}", failed, unevaluated)
        extra = openapi.get("additionalProperties")
        if isinstance(extra, dict):
            for name, item in value.items():
                _check_rules(extra, item, f"{path}.{name}", failed, unevaluated)
    elif isinstance(value, list) and isinstance(openapi.get("items"), dict):
        for i, item in enumerate(value):
            _check_rules(openapi["items"], item, f"{path}[{i}]", failed, unevaluated)


@dataclass
class CustomResult:
    errors: list[str]
    unevaluated: list[str]  # CEL rules that applied but were not run
    checked_against: list[str]  # the fixtures used


def validate_custom(obj: dict, kube_version: str) -> CustomResult | None:
    """The object against every served CRD version of its apiVersion and kind among the
    fixtures (several releases may define it: it must pass all); None: no CRD known."""
    versions = schema_for(obj.get("apiVersion", ""), obj.get("kind", ""))
    if not versions:
        return None
    errors: list[str] = []
    unevaluated: list[str] = []
    meta = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj.get("metadata", {})}
    try:
        kubernetes_validate.validate(meta, kube_version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        errors.append(f"metadata: {exc.message} at {list(exc.path)}")
    for crd in versions:
        schema = copy.deepcopy(crd.json_schema)
        # The API server takes these at the root of every kind, listed in its schema or not.
        schema["properties"]["apiVersion"] = {"const": crd.api_version}
        schema["properties"]["kind"] = {"const": crd.kind}
        schema["properties"]["metadata"] = {"type": "object"}
        for error in jsonschema.Draft7Validator(schema).iter_errors(obj):
            errors.append(f"{error.message} at {list(error.absolute_path)} ({crd.source})")
        defaulted = _defaulted(crd.openapi, obj)
        _check_rules(crd.openapi, defaulted, "", errors, unevaluated)
    return CustomResult(errors, sorted(set(unevaluated)), [c.source for c in versions])
