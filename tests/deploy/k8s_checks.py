"""Offline checks of a set of Kubernetes objects.

- Built-in kinds: the Kubernetes OpenAPI schemas shipped by `kubernetes-validate`
  (strict: unknown fields are errors).
- CRD kinds (InferencePool, InferenceModel, Gateway, GatewayClass, HTTPRoute,
  ServiceMonitor): small JSON schemas written HERE, for this test, from the CRDs' published
  fields and their required ones. They are not the upstream CRDs: they check the fields
  these manifests use, their types and enums, and reject fields the CRDs do not have.
- Wiring: the names that tie the objects together resolve (Service -> Deployment pods,
  InferencePool -> EPP Service port, HTTPRoute -> pool, volumes -> ConfigMaps, ...).
"""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate

BUILTIN_KINDS = {
    "ConfigMap",
    "Deployment",
    "PodDisruptionBudget",
    "Role",
    "RoleBinding",
    "Secret",
    "Service",
    "ServiceAccount",
}

_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_DNS_LABEL = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
_PORT = {"type": "integer", "minimum": 1, "maximum": 65535}
_GROUP = {
    "type": "string",
    "pattern": r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$",
}


def _object(properties: dict, required: list[str], *, closed: bool = True) -> dict:
    schema: dict[str, Any] = {"type": "object", "properties": properties, "required": required}
    if closed:
        schema["additionalProperties"] = False
    return schema


def _resource(api_version: str, kind: str, spec: dict) -> dict:
    return _object(
        {
            "apiVersion": {"const": api_version},
            "kind": {"const": kind},
            "metadata": _object(
                {
                    "name": _DNS_LABEL,
                    "namespace": _DNS_LABEL,
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                    "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
                },
                ["name"],
            ),
            "spec": spec,
        },
        ["apiVersion", "kind", "metadata", "spec"],
    )


# inference.networking.k8s.io/v1 InferencePool (GIE v1): selector.matchLabels (1-64
# labels), targetPorts 1-8 unique ports, endpointPickerRef optional but, for a Service,
# with a port; failureMode FailOpen | FailClose.
INFERENCE_POOL = _resource(
    "inference.networking.k8s.io/v1",
    "InferencePool",
    _object(
        {
            "selector": _object(
                {
                    "matchLabels": {
                        "type": "object",
                        "minProperties": 1,
                        "maxProperties": 64,
                        "additionalProperties": {"type": "string", "maxLength": 63},
                    }
                },
                ["matchLabels"],
            ),
            "targetPorts": {
                "type": "array",
                "minItems": 1,
                "maxItems": 8,
                "uniqueItems": True,
                "items": _object({"number": _PORT}, ["number"]),
            },
            "endpointPickerRef": _object(
                {
                    "group": _GROUP,
                    "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                    "name": _NAME,
                    "port": _object({"number": _PORT}, ["number"]),
                    "failureMode": {"enum": ["FailOpen", "FailClose"]},
                },
                ["name", "port"],
            ),
            "appProtocol": {"enum": ["http", "kubernetes.io/h2c"]},
        },
        ["selector", "targetPorts"],
    ),
)

# inference.networking.x-k8s.io/v1alpha2 InferenceModel: modelName and poolRef required;
# criticality Critical | Standard | Sheddable; at most 10 targetModels with weights 1-1e6,
# weights on all of them or none.
INFERENCE_MODEL = _resource(
    "inference.networking.x-k8s.io/v1alpha2",
    "InferenceModel",
    _object(
        {
            "modelName": {"type": "string", "minLength": 1, "maxLength": 256},
            "criticality": {"enum": ["Critical", "Standard", "Sheddable"]},
            "poolRef": _object(
                {
                    "group": _GROUP,
                    "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                    "name": _NAME,
                },
                ["name"],
            ),
            "targetModels": {
                "type": "array",
                "maxItems": 10,
                "items": _object(
                    {
                        "name": _NAME,
                        "weight": {"type": "integer", "minimum": 1, "maximum": 1_000_000},
                    },
                    ["name"],
                ),
                "anyOf": [
                    {"items": {"required": ["weight"]}},
                    {"items": {"not": {"required": ["weight"]}}},
                ],
            },
        },
        ["modelName", "poolRef"],
    ),
)

GATEWAY_CLASS = _resource(
    "gateway.networking.k8s.io/v1",
    "GatewayClass",
    _object(
        {
            "controllerName": {
                "type": "string",
                "pattern": r"^[a-z0-9.-]+/[A-Za-z0-9/\-._~%!$&'()*+,;=:]+$",
            }
        },
        ["controllerName"],
    ),
)

GATEWAY = _resource(
    "gateway.networking.k8s.io/v1",
    "Gateway",
    _object(
        {
            "gatewayClassName": _NAME,
            "listeners": {
                "type": "array",
                "minItems": 1,
                "maxItems": 64,
                "items": _object(
                    {
                        "name": _DNS_LABEL,
                        "hostname": {"type": "string"},
                        "port": _PORT,
                        "protocol": {"enum": ["HTTP", "HTTPS", "TLS", "TCP", "UDP"]},
                    },
                    ["name", "port", "protocol"],
                ),
            },
        },
        ["gatewayClassName", "listeners"],
    ),
)

_BACKEND_REF = _object(
    {
        "group": _GROUP,
        "kind": {"type": "string", "minLength": 1},
        "name": _NAME,
        "port": _PORT,
        "weight": {"type": "integer", "minimum": 0},
    },
    ["name"],
)

HTTP_ROUTE = _resource(
    "gateway.networking.k8s.io/v1",
    "HTTPRoute",
    _object(
        {
            "parentRefs": {
                "type": "array",
                "minItems": 1,
                "items": _object(
                    {
                        "group": _GROUP,
                        "kind": {"type": "string"},
                        "name": _NAME,
                        "namespace": _DNS_LABEL,
                        "sectionName": _DNS_LABEL,
                    },
                    ["name"],
                ),
            },
            "hostnames": {"type": "array", "items": {"type": "string"}},
            "rules": {
                "type": "array",
                "minItems": 1,
                "items": _object(
                    {
                        "matches": {
                            "type": "array",
                            "items": _object(
                                {
                                    "path": _object(
                                        {
                                            "type": {
                                                "enum": ["Exact", "PathPrefix", "RegularExpression"]
                                            },
                                            "value": {"type": "string", "pattern": "^/"},
                                        },
                                        ["type", "value"],
                                    )
                                },
                                [],
                            ),
                        },
                        "backendRefs": {"type": "array", "minItems": 1, "items": _BACKEND_REF},
                        "timeouts": _object(
                            {
                                "request": {
                                    "type": "string",
                                    "pattern": r"^([0-9]{1,5}(h|m|s|ms)){1,4}$",
                                },
                                "backendRequest": {"type": "string"},
                            },
                            [],
                        ),
                    },
                    ["backendRefs"],
                ),
            },
        },
        ["parentRefs", "rules"],
    ),
)

SERVICE_MONITOR = _resource(
    "monitoring.coreos.com/v1",
    "ServiceMonitor",
    _object(
        {
            "selector": _object(
                {"matchLabels": {"type": "object", "minProperties": 1}}, ["matchLabels"]
            ),
            "endpoints": {
                "type": "array",
                "minItems": 1,
                "items": _object(
                    {
                        "port": {"type": "string"},
                        "path": {"type": "string", "pattern": "^/"},
                        "interval": {
                            "type": "string",
                            "pattern": r"^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
                        },
                        "honorLabels": {"type": "boolean"},
                    },
                    ["port"],
                ),
            },
        },
        ["selector", "endpoints"],
    ),
)

CRD_SCHEMAS = {
    "InferencePool": INFERENCE_POOL,
    "InferenceModel": INFERENCE_MODEL,
    "GatewayClass": GATEWAY_CLASS,
    "Gateway": GATEWAY,
    "HTTPRoute": HTTP_ROUTE,
    "ServiceMonitor": SERVICE_MONITOR,
}


def validate_objects(objects: list[dict], kube_version: str) -> list[str]:
    """Every object against its schema; returns the failures (empty when all pass)."""
    errors = []
    for obj in objects:
        kind, name = obj.get("kind"), obj.get("metadata", {}).get("name")
        try:
            if kind in BUILTIN_KINDS:
                kubernetes_validate.validate(obj, kube_version, strict=True)
            elif kind in CRD_SCHEMAS:
                jsonschema.validate(obj, CRD_SCHEMAS[kind])
            else:
                errors.append(f"{kind} {name}: no schema to check it against")
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{kind} {name}: {exc.message} at {list(exc.path)}")
        except jsonschema.ValidationError as exc:
            errors.append(f"{kind} {name}: {exc.message} at {list(exc.absolute_path)}")
    return errors


def _by(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def check_wiring(objects: list[dict], *, external_pool: str | None = None) -> list[str]:
    """Names that connect the objects resolve within the set. `external_pool` is the name
    of an InferencePool that exists outside the set (the chart's pool.create=false)."""
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
            if parent["name"] not in gateways:
                problems.append(f"HTTPRoute {name}: parent Gateway {parent['name']} not in the set")
        for rule in route["spec"]["rules"]:
            for backend in rule["backendRefs"]:
                if backend.get("kind") == "InferencePool" and backend["name"] not in pools:
                    problems.append(f"HTTPRoute {name}: InferencePool {backend['name']} missing")
    for name, model in _by(objects, "InferenceModel").items():
        if model["spec"]["poolRef"]["name"] not in pools:
            problems.append(
                f"InferenceModel {name}: pool {model['spec']['poolRef']['name']} missing"
            )
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
