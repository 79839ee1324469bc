"""Offline checks of a set of Kubernetes objects.

- Built-in kinds: the Kubernetes OpenAPI schemas shipped by `kubernetes-validate`
  (strict: unknown fields are errors).
- Custom kinds with an upstream CRD among tests/fixtures/upstream (InferencePool,
  InferenceObjective and InferenceModelRewrite in both groups, InferenceModel, Gateway,
  GatewayClass, HTTPRoute, ServiceMonitor, Istio's DestinationRule): that CRD's own
  openAPIV3Schema, closed to unknown fields, and its CEL rules, translated by hand
  (crd_schemas.py); a CEL rule that applies and has no translation is a failure.
- GKE's HealthCheckPolicy and GCPBackendPolicy (`networking.gke.io/v1`): GKE installs
  these CRDs itself and publishes no CRD file to test against, so they are checked only
  against the small structural schemas written HERE from GKE's documented fields
  (`OUR_SCHEMAS`), not against an upstream file.
- Any other kind fails: there is nothing to check it against.
- Wiring: the names that tie the objects together resolve (Service -> Deployment pods,
  InferencePool -> EPP Service port, HTTPRoute -> pool, volumes -> ConfigMaps, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import jsonschema
import kubernetes_validate

from deploy.crd_schemas import validate_custom

BUILTIN_KINDS = {
    "ConfigMap",
    "Deployment",
    "NetworkPolicy",
    "PodDisruptionBudget",
    "Role",
    "RoleBinding",
    "Secret",
    "Service",
    "ServiceAccount",
}


def _object(properties: dict, required: list[str]) -> dict:
    schema: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    schema["additionalProperties"] = False
    return schema


_TARGET_REF = _object(
    {
        "group": {"type": "string"},
        "kind": {"type": "string", "minLength": 1},
        "name": {"type": "string", "minLength": 1},
        "namespace": {"type": "string"},
    },
    ["group", "kind", "name"],
)
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_PORT_SPEC = {"enum": ["USE_FIXED_PORT", "USE_NAMED_PORT", "USE_SERVING_PORT"]}


def _gke_policy(kind: str, default: dict) -> dict:
    return _object(
        {
            "apiVersion": {"const": "networking.gke.io/v1"},
            "kind": {"const": kind},
            "metadata": {"type": "object"},
            "spec": _object({"default": default, "targetRef": _TARGET_REF}, ["targetRef"]),
        },
        ["apiVersion", "kind", "metadata", "spec"],
    )


# From GKE's documentation of the two policies (Gateway API on GKE: "Configure Gateway
# resources using Policies"); only the fields documented there, types and enums.
OUR_SCHEMAS = {
    "HealthCheckPolicy": _gke_policy(
        "HealthCheckPolicy",
        _object(
            {
                "checkIntervalSec": {"type": "integer", "minimum": 1, "maximum": 300},
                "timeoutSec": {"type": "integer", "minimum": 1, "maximum": 300},
                "healthyThreshold": {"type": "integer", "minimum": 1, "maximum": 10},
                "unhealthyThreshold": {"type": "integer", "minimum": 1, "maximum": 10},
                "logConfig": _object({"enabled": {"type": "boolean"}}, []),
                "config": _object(
                    {
                        "type": {"enum": ["TCP", "HTTP", "HTTPS", "HTTP2", "GRPC"]},
                        "httpHealthCheck": _object(
                            {
                                "portSpecification": _PORT_SPEC,
                                "port": _PORT,
                                "portName": {"type": "string"},
                                "host": {"type": "string"},
                                "requestPath": {"type": "string", "pattern": "^/"},
                                "response": {"type": "string"},
                                "proxyHeader": {"enum": ["NONE", "PROXY_V1"]},
                            },
                            [],
                        ),
                        "grpcHealthCheck": _object(
                            {
                                "portSpecification": _PORT_SPEC,
                                "port": _PORT,
                                "portName": {"type": "string"},
                                "grpcServiceName": {"type": "string"},
                            },
                            [],
                        ),
                    },
                    ["type"],
                ),
            },
            [],
        ),
    ),
    "GCPBackendPolicy": _gke_policy(
        "GCPBackendPolicy",
        _object(
            {
                "timeoutSec": {"type": "integer", "minimum": 1, "maximum": 86400},
                "logging": _object(
                    {
                        "enabled": {"type": "boolean"},
                        "sampleRate": {"type": "integer", "minimum": 0, "maximum": 1000000},
                    },
                    [],
                ),
                "connectionDraining": _object(
                    {"drainingTimeoutSec": {"type": "integer", "minimum": 0, "maximum": 3600}},
                    [],
                ),
                "securityPolicy": {"type": "string"},
            },
            [],
        ),
    ),
}


@dataclass
class Report:
    errors: list[str] = field(default_factory=list)
    # "Kind name: path: rule" for CEL rules that applied and have no translation (each is
    # in `errors` too).
    unevaluated: list[str] = field(default_factory=list)
    # kinds checked only against OUR_SCHEMAS, not an upstream CRD
    ours_only: set[str] = field(default_factory=set)


def validation_report(objects: list[dict], kube_version: str) -> Report:
    """Every object against its schema (see the module docstring)."""
    report = Report()
    for obj in objects:
        kind, name = obj.get("kind"), obj.get("metadata", {}).get("name")
        if kind in BUILTIN_KINDS:
            try:
                kubernetes_validate.validate(obj, kube_version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                report.errors.append(f"{kind} {name}: {exc.message} at {list(exc.path)}")
            continue
        custom = validate_custom(obj, kube_version)
        if custom is not None:
            report.errors += [f"{kind} {name}: {e}" for e in custom.errors]
            report.unevaluated += [f"{kind} {name}: {r}" for r in custom.unevaluated]
            report.errors += [
                f"{kind} {name}: CEL rule not evaluated (no translation): {r}"
                for r in custom.unevaluated
            ]
        elif kind in OUR_SCHEMAS:
            report.ours_only.add(kind)
            try:
                jsonschema.validate(obj, OUR_SCHEMAS[kind])
            except jsonschema.ValidationError as exc:
                report.errors.append(f"{kind} {name}: {exc.message} at {list(exc.absolute_path)}")
        else:
            report.errors.append(
                f"{obj.get('apiVersion')} {kind} {name}: no schema to check it against"
            )
    return report


def validate_objects(objects: list[dict], kube_version: str) -> list[str]:
    """The failures of validation_report (empty when every object passes)."""
    return validation_report(objects, kube_version).errors


def _by(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def check_wiring(
    objects: list[dict],
    *,
    external_pool: str | None = None,
    external_gateways: frozenset[str] | set[str] = frozenset(),
) -> list[str]:
    """Names that connect the objects resolve within the set. `external_pool` is the name
    of an InferencePool that exists outside the set (the chart's pool.create=false);
    `external_gateways` are the "namespace/name" of Gateways that exist outside it (the
    chart attaches its HTTPRoute to an existing Gateway by default)."""
    problems = []
    deployments, services = _by(objects, "Deployment"), _by(objects, "Service")
    config_maps = _by(objects, "ConfigMap")
    pools = set(_by(objects, "InferencePool")) | ({external_pool} if external_pool else set())
    gateways = _by(objects, "Gateway")
    for name, svc in services.items():
        selector = svc["spec"]["selector"]
        matches = [
            d
            for d in deployments.values()
            if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
        ]
        if len(matches) != 1:
            problems.append(f"Service {name} selects {len(matches)} Deployments")
            continue
        container_ports = {
            p["name"]
            for c in matches[0]["spec"]["template"]["spec"]["containers"]
            for p in c["ports"]
        }
        for port in svc["spec"]["ports"]:
            if port["targetPort"] not in container_ports:
                problems.append(
                    f"Service {name} port {port['name']}: no container port {port['targetPort']}"
                )
    for name, dep in deployments.items():
        spec = dep["spec"]
        if (
            not spec["selector"]["matchLabels"].items()
            <= spec["template"]["metadata"]["labels"].items()
        ):
            problems.append(f"Deployment {name}: selector does not match its pod labels")
        for volume in spec["template"]["spec"].get("volumes", []):
            if "configMap" in volume and volume["configMap"]["name"] not in config_maps:
                problems.append(
                    f"Deployment {name}: ConfigMap {volume['configMap']['name']} missing"
                )
        mounts = {
            m["name"]
            for c in spec["template"]["spec"]["containers"]
            for m in c.get("volumeMounts", [])
        }
        volumes = {v["name"] for v in spec["template"]["spec"].get("volumes", [])}
        if mounts - volumes:
            problems.append(f"Deployment {name}: mounts without volumes {sorted(mounts - volumes)}")
        sa = spec["template"]["spec"].get("serviceAccountName", "default")
        if sa != "default" and sa not in _by(objects, "ServiceAccount"):
            problems.append(f"Deployment {name}: ServiceAccount {sa} missing")
    for name, pool in _by(objects, "InferencePool").items():
        ref = pool["spec"]["endpointPickerRef"]
        svc = services.get(ref["name"])
        if svc is None or ref["port"]["number"] not in {p["port"] for p in svc["spec"]["ports"]}:
            problems.append(
                f"InferencePool {name}: endpointPickerRef {ref} resolves to no Service port"
            )
    for name, route in _by(objects, "HTTPRoute").items():
        for parent in route["spec"]["parentRefs"]:
            namespace = parent.get("namespace", route["metadata"].get("namespace"))
            inside = (
                parent["name"] in gateways
                and gateways[parent["name"]]["metadata"].get("namespace") == namespace
            )
            if not inside and f"{namespace}/{parent['name']}" not in external_gateways:
                problems.append(
                    f"HTTPRoute {name}: parent Gateway {namespace}/{parent['name']} "
                    "neither in the set nor expected outside it"
                )
        for rule in route["spec"]["rules"]:
            for backend in rule["backendRefs"]:
                if backend.get("kind") == "InferencePool" and backend["name"] not in pools:
                    problems.append(f"HTTPRoute {name}: InferencePool {backend['name']} missing")
    for kind in ("InferenceModel", "InferenceObjective", "InferenceModelRewrite"):
        for name, model in _by(objects, kind).items():
            ref = model["spec"]["poolRef"]
            pool_groups = {"inference.networking.k8s.io", "inference.networking.x-k8s.io"}
            if ref["name"] not in pools or ref.get("group") not in pool_groups:
                problems.append(f"{kind} {name}: pool {ref} missing")
    for name, rule in _by(objects, "DestinationRule").items():
        host = rule["spec"]["host"]
        svc_name, _, rest = host.partition(".")
        svc = services.get(svc_name)
        if svc is None or not rest.startswith(f"{svc['metadata'].get('namespace')}.svc"):
            problems.append(f"DestinationRule {name}: host {host} is no Service of the set")
    for kind in ("HealthCheckPolicy", "GCPBackendPolicy"):
        for name, policy in _by(objects, kind).items():
            ref = policy["spec"]["targetRef"]
            targets = services if ref["kind"] == "Service" else _by(objects, ref["kind"])
            if ref["kind"] == "InferencePool":
                targets = {p: None for p in pools}
            if ref["name"] not in targets:
                problems.append(f"{kind} {name}: target {ref['kind']} {ref['name']} missing")
    roles = _by(objects, "Role")
    for name, binding in _by(objects, "RoleBinding").items():
        if binding["roleRef"]["name"] not in roles:
            problems.append(f"RoleBinding {name}: Role {binding['roleRef']['name']} missing")
        for subject in binding["subjects"]:
            if subject["kind"] == "ServiceAccount" and subject["name"] not in _by(
                objects, "ServiceAccount"
            ):
                problems.append(f"RoleBinding {name}: ServiceAccount {subject['name']} missing")
    for name, gateway in gateways.items():
        classes = _by(objects, "GatewayClass")
        if classes and gateway["spec"]["gatewayClassName"] not in classes:
            problems.append(
                f"Gateway {name}: GatewayClass {gateway['spec']['gatewayClassName']} missing"
            )
    return problems


def epp_container(objects: list[dict]) -> dict:
    (deployment,) = [
        o
        for o in objects
        if o["kind"] == "Deployment"
        and o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
        == "endpoint-picker"
    ]
    (container,) = [
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "epp"
    ]
    return container


def epp_config_text(objects: list[dict]) -> str:
    """The EPP's config file: the ConfigMap volume mounted at /etc/epp/config.yaml."""
    (deployment,) = [
        o
        for o in objects
        if o["kind"] == "Deployment"
        and o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
        == "endpoint-picker"
    ]
    container = epp_container(objects)
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/etc/epp/config.yaml"]
    (volume,) = [
        v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    ]
    (config_map,) = [
        o
        for o in objects
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == volume["configMap"]["name"]
    ]
    return config_map["data"][mount["subPath"]]
