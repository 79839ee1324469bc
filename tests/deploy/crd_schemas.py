"""Custom resources checked against the upstream CRDs' own schemas.

Every CustomResourceDefinition under tests/fixtures/upstream (the `crd/` folders and the
Istio CRDs llm-d installs) is loaded; each served version's `openAPIV3Schema` becomes a
JSON schema that `jsonschema` checks an object against, as the API server would:

- unknown fields are errors (the API server's strict field validation, kubectl's default):
  every object schema with `properties` and no `additionalProperties` or
  `x-kubernetes-preserve-unknown-fields` gets `additionalProperties: false`;
- `x-kubernetes-int-or-string` accepts an integer or a string, `nullable` accepts null;
- `metadata` is an ObjectMeta: checked by `kubernetes-validate` (strict) as a ConfigMap's;
- CEL rules (`x-kubernetes-validations`): there is no CEL evaluator here, so the rules
  are translated by hand into Python (`CEL_RULES`, keyed by the rule's exact text) and
  evaluated on the object with the schema's defaults applied, as the API server stores
  it. Translated: every rule of the inference CRDs (InferencePool, InferenceObjective,
  InferenceModelRewrite, InferenceModel; a test checks none is missing) and the Gateway
  API rules that apply to routes without filters and listeners without TLS. A rule that
  applies to an object and has no translation is returned as `unevaluated`, and the
  callers count it as a failure: add its translation rather than let it pass.

A kind whose CRD is not among the fixtures has no schema here: `schema_for` returns None
and the callers fail the object.
"""

from __future__ import annotations

import copy
import re
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


# Gateway API v1.5 (Gateway, HTTPRoute): the rules that apply to objects without filters
# and listeners without TLS, as this chart and deploy/kubernetes render them, translated
# one by one. The long rule texts, exactly as in the CRDs:
_PARENT_SECTION_ALL_OR_NONE = "self.all(p1, self.all(p2, p1.group == p2.group && p1.kind == p2.kind && p1.name == p2.name && (((!has(p1.__namespace__) || p1.__namespace__ == '') && (!has(p2.__namespace__) || p2.__namespace__ == '')) || (has(p1.__namespace__) && has(p2.__namespace__) && p1.__namespace__ == p2.__namespace__ )) ? ((!has(p1.sectionName) || p1.sectionName == '') == (!has(p2.sectionName) || p2.sectionName == '')) : true))"
_PARENT_UNIQUE = "self.all(p1, self.exists_one(p2, p1.group == p2.group && p1.kind == p2.kind && p1.name == p2.name && (((!has(p1.__namespace__) || p1.__namespace__ == '') && (!has(p2.__namespace__) || p2.__namespace__ == '')) || (has(p1.__namespace__) && has(p2.__namespace__) && p1.__namespace__ == p2.__namespace__ )) && (((!has(p1.sectionName) || p1.sectionName == '') && (!has(p2.sectionName) || p2.sectionName == '')) || (has(p1.sectionName) && has(p2.sectionName) && p1.sectionName == p2.sectionName))))"
_RULES_MATCHES_MAX = "(self.size() > 0 ? self[0].matches.size() : 0) + (self.size() > 1 ? self[1].matches.size() : 0) + (self.size() > 2 ? self[2].matches.size() : 0) + (self.size() > 3 ? self[3].matches.size() : 0) + (self.size() > 4 ? self[4].matches.size() : 0) + (self.size() > 5 ? self[5].matches.size() : 0) + (self.size() > 6 ? self[6].matches.size() : 0) + (self.size() > 7 ? self[7].matches.size() : 0) + (self.size() > 8 ? self[8].matches.size() : 0) + (self.size() > 9 ? self[9].matches.size() : 0) + (self.size() > 10 ? self[10].matches.size() : 0) + (self.size() > 11 ? self[11].matches.size() : 0) + (self.size() > 12 ? self[12].matches.size() : 0) + (self.size() > 13 ? self[13].matches.size() : 0) + (self.size() > 14 ? self[14].matches.size() : 0) + (self.size() > 15 ? self[15].matches.size() : 0) <= 128"
_BACKEND_REDIRECT_PREFIX = "(has(self.backendRefs) && self.backendRefs.exists_one(b, (has(b.filters) && b.filters.exists_one(f, has(f.requestRedirect) && has(f.requestRedirect.path) && f.requestRedirect.path.type == 'ReplacePrefixMatch' && has(f.requestRedirect.path.replacePrefixMatch))) )) ? ((size(self.matches) != 1 || !has(self.matches[0].path) || self.matches[0].path.type != 'PathPrefix') ? false : true) : true"
_BACKEND_REWRITE_PREFIX = "(has(self.backendRefs) && self.backendRefs.exists_one(b, (has(b.filters) && b.filters.exists_one(f, has(f.urlRewrite) && has(f.urlRewrite.path) && f.urlRewrite.path.type == 'ReplacePrefixMatch' && has(f.urlRewrite.path.replacePrefixMatch))) )) ? ((size(self.matches) != 1 || !has(self.matches[0].path) || self.matches[0].path.type != 'PathPrefix') ? false : true) : true"
_RULE_REDIRECT_PREFIX = "(has(self.filters) && self.filters.exists_one(f, has(f.requestRedirect) && has(f.requestRedirect.path) && f.requestRedirect.path.type == 'ReplacePrefixMatch' && has(f.requestRedirect.path.replacePrefixMatch))) ? ((size(self.matches) != 1 || !has(self.matches[0].path) || self.matches[0].path.type != 'PathPrefix') ? false : true) : true"
_RULE_REWRITE_PREFIX = "(has(self.filters) && self.filters.exists_one(f, has(f.urlRewrite) && has(f.urlRewrite.path) && f.urlRewrite.path.type == 'ReplacePrefixMatch' && has(f.urlRewrite.path.replacePrefixMatch))) ? ((size(self.matches) != 1 || !has(self.matches[0].path) || self.matches[0].path.type != 'PathPrefix') ? false : true) : true"
_PATH_CHARS = '(self.type in [\'Exact\',\'PathPrefix\']) ? self.value.matches(r"""^(?:[-A-Za-z0-9/._~!$&\'()*+,;=:@]|[%][0-9a-fA-F]{2})+$""") : true'


def _exists_one(items: list, test: Callable[[Any], bool]) -> bool:
    return sum(1 for item in items if test(item)) == 1


def _empty(obj: dict, key: str) -> bool:
    return obj.get(key, "") == ""


def _same_parent(p1: dict, p2: dict) -> bool:
    same_ns = (_empty(p1, "namespace") and _empty(p2, "namespace")) or (
        "namespace" in p1 and "namespace" in p2 and p1["namespace"] == p2["namespace"]
    )
    return (
        p1.get("group") == p2.get("group")
        and p1.get("kind") == p2.get("kind")
        and p1["name"] == p2["name"]
        and same_ns
    )


def _parents_sections_all_or_none(parents: list[dict]) -> bool:
    return all(
        _empty(p1, "sectionName") == _empty(p2, "sectionName")
        for p1 in parents
        for p2 in parents
        if _same_parent(p1, p2)
    )


def _parents_unique(parents: list[dict]) -> bool:
    def same_section(p1: dict, p2: dict) -> bool:
        return (_empty(p1, "sectionName") and _empty(p2, "sectionName")) or (
            "sectionName" in p1 and "sectionName" in p2 and p1["sectionName"] == p2["sectionName"]
        )

    return all(
        _exists_one(parents, lambda p2, p1=p1: _same_parent(p1, p2) and same_section(p1, p2))
        for p1 in parents
    )


def _prefix_replacing(filters: list[dict], kind: str) -> bool:
    """exists_one filter of `kind` (requestRedirect, urlRewrite) with a ReplacePrefixMatch."""
    return _exists_one(
        filters,
        lambda f: (
            kind in f
            and "path" in f[kind]
            and f[kind]["path"].get("type") == "ReplacePrefixMatch"
            and "replacePrefixMatch" in f[kind]["path"]
        ),
    )


def _one_path_prefix_match(rule: dict) -> bool:
    matches = rule.get("matches", [])
    return len(matches) == 1 and matches[0].get("path", {}).get("type") == "PathPrefix"


def _backends_replace_prefix(kind: str) -> Callable[[dict], bool]:
    def test(rule: dict) -> bool:
        backends = rule.get("backendRefs")
        if backends is not None and _exists_one(
            backends, lambda b: "filters" in b and _prefix_replacing(b["filters"], kind)
        ):
            return _one_path_prefix_match(rule)
        return True

    return test


def _rule_replaces_prefix(kind: str) -> Callable[[dict], bool]:
    def test(rule: dict) -> bool:
        if "filters" in rule and _prefix_replacing(rule["filters"], kind):
            return _one_path_prefix_match(rule)
        return True

    return test


def _duration_s(text: str) -> float:
    """A Gateway API Duration (GEP-2257: 1h, 30m, 10s, 500ms, combined) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"([0-9]+)(ms|h|m|s)", text)
    assert "".join(n + u for n, u in parts) == text, f"not a duration: {text!r}"
    return sum(int(n) * units[u] for n, u in parts)


def _timeouts_ordered(t: dict) -> bool:
    if "request" in t and "backendRequest" in t and _duration_s(t["request"]) != 0:
        return _duration_s(t["backendRequest"]) <= _duration_s(t["request"])
    return True


def _listeners_unique_port_protocol_host(listeners: list[dict]) -> bool:
    def same(l1: dict, l2: dict) -> bool:
        if "hostname" in l1 and "hostname" in l2:
            host = l1["hostname"] == l2["hostname"]
        else:
            host = "hostname" not in l1 and "hostname" not in l2
        return l1["port"] == l2["port"] and l1["protocol"] == l2["protocol"] and host

    return all(_exists_one(listeners, lambda l2, l1=l1: same(l1, l2)) for l1 in listeners)


def _path_ok(test: Callable[[str], bool]) -> Callable[[dict], bool]:
    return lambda p: test(p["value"]) if p.get("type") in ("Exact", "PathPrefix") else True


_PATH_CHARS_RE = re.compile(r"^(?:[-A-Za-z0-9/._~!$&'()*+,;=:@]|[%][0-9a-fA-F]{2})+$")

GATEWAY_API_RULES: dict[str, Callable[[Any], bool]] = {
    _PARENT_SECTION_ALL_OR_NONE: _parents_sections_all_or_none,
    _PARENT_UNIQUE: _parents_unique,
    _RULES_MATCHES_MAX: lambda rules: sum(len(r.get("matches", [])) for r in rules[:16]) <= 128,
    _BACKEND_REDIRECT_PREFIX: _backends_replace_prefix("requestRedirect"),
    _BACKEND_REWRITE_PREFIX: _backends_replace_prefix("urlRewrite"),
    _RULE_REDIRECT_PREFIX: _rule_replaces_prefix("requestRedirect"),
    _RULE_REWRITE_PREFIX: _rule_replaces_prefix("urlRewrite"),
    "(has(self.backendRefs) && size(self.backendRefs) > 0) ? (!has(self.filters) || "
    "self.filters.all(f, !has(f.requestRedirect))): true": lambda r: (
        not r.get("backendRefs") or all("requestRedirect" not in f for f in r.get("filters", []))
    ),
    "(size(self.group) == 0 && self.kind == 'Service') ? has(self.port) : true": lambda b: (
        not (b.get("group", "") == "" and b.get("kind") == "Service") or "port" in b
    ),
    "(self.type in ['Exact','PathPrefix']) ? !self.value.contains('#') : true": _path_ok(
        lambda v: "#" not in v
    ),
    "(self.type in ['Exact','PathPrefix']) ? !self.value.contains('%2F') : true": _path_ok(
        lambda v: "%2F" not in v
    ),
    "(self.type in ['Exact','PathPrefix']) ? !self.value.contains('%2f') : true": _path_ok(
        lambda v: "%2f" not in v
    ),
    "(self.type in ['Exact','PathPrefix']) ? !self.value.contains('/../') : true": _path_ok(
        lambda v: "/../" not in v
    ),
    "(self.type in ['Exact','PathPrefix']) ? !self.value.contains('/./') : true": _path_ok(
        lambda v: "/./" not in v
    ),
    "(self.type in ['Exact','PathPrefix']) ? !self.value.contains('//') : true": _path_ok(
        lambda v: "//" not in v
    ),
    "(self.type in ['Exact','PathPrefix']) ? !self.value.endsWith('/.') : true": _path_ok(
        lambda v: not v.endswith("/.")
    ),
    "(self.type in ['Exact','PathPrefix']) ? !self.value.endsWith('/..') : true": _path_ok(
        lambda v: not v.endswith("/..")
    ),
    _PATH_CHARS: _path_ok(lambda v: _PATH_CHARS_RE.match(v) is not None),
    "(self.type in ['Exact','PathPrefix']) ? self.value.startsWith('/') : true": _path_ok(
        lambda v: v.startswith("/")
    ),
    "self.type in ['Exact','PathPrefix'] || self.type == 'RegularExpression'": lambda p: (
        p.get("type") in ("Exact", "PathPrefix", "RegularExpression")
    ),
    "!(has(self.request) && has(self.backendRequest) && duration(self.request) != "
    "duration('0s') && duration(self.backendRequest) > duration(self.request))": _timeouts_ordered,
    "self.all(l, (l.protocol == 'HTTPS' && has(l.tls)) ? (l.tls.mode == '' || "
    "l.tls.mode == 'Terminate') : true)": lambda ls: all(
        not (li["protocol"] == "HTTPS" and "tls" in li)
        or li["tls"].get("mode", "") in ("", "Terminate")
        for li in ls
    ),
    "self.all(l, (l.protocol == 'TLS' ? has(l.tls) && has(l.tls.mode) && "
    "l.tls.mode != '' : true))": lambda ls: all(
        li["protocol"] != "TLS" or li.get("tls", {}).get("mode", "") != "" for li in ls
    ),
    "self.all(l, l.protocol in ['HTTP', 'TCP', 'UDP'] ? !has(l.tls) : true)": lambda ls: all(
        li["protocol"] not in ("HTTP", "TCP", "UDP") or "tls" not in li for li in ls
    ),
    "self.all(l, l.protocol in ['TCP', 'UDP']  ? (!has(l.hostname) || l.hostname == '') "
    ": true)": lambda ls: all(
        li["protocol"] not in ("TCP", "UDP") or li.get("hostname", "") == "" for li in ls
    ),
    "self.all(l1, self.exists_one(l2, l1.name == l2.name))": lambda ls: all(
        _exists_one(ls, lambda l2, l1=l1: l1["name"] == l2["name"]) for l1 in ls
    ),
    "self.all(l1, self.exists_one(l2, l1.port == l2.port && l1.protocol == l2.protocol && "
    "(has(l1.hostname) && has(l2.hostname) ? l1.hostname == l2.hostname : "
    "!has(l1.hostname) && !has(l2.hostname))))": _listeners_unique_port_protocol_host,
}
CEL_RULES.update(GATEWAY_API_RULES)


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
