"""The chart as a drop-in for a current Gateway API Inference Extension / llm-d cluster,
checked against the upstream files in tests/fixtures/upstream:

- with default values it renders only kinds a current cluster serves (GIE v1.6.0's
  InferencePool, Gateway API v1's HTTPRoute): no InferenceModel (gone since GIE v1.0),
  no Gateway; InferenceModel only when asked and served;
- every provider (none, istio, gke, kgateway, envoy-ai-gateway) renders objects that
  validate against the upstream CRDs (GKE's two policies only against our own structural
  schemas: GKE publishes no CRD file) and says in NOTES.txt what its gateway needs;
- ports, probes, Service port names and RBAC as the upstream charts have them;
- the validation itself fails on a broken object and on a kind it has no schema for.

No cluster and no Gateway controller run here: whether a controller accepts these objects
(e.g. Envoy AI Gateway's InferencePool backend, GKE's policies) is not proven by this file.
"""

from __future__ import annotations

import copy
import re
import tempfile
from pathlib import Path

import pytest
import yaml

from deploy.conftest import KUBE_VERSION, VALUES_ALL, VALUES_STATIC, VALUES_UPSTREAM
from deploy.crd_schemas import (
    CEL_RULES,
    FIXTURES,
    INFERENCE_GROUPS,
    cel_rules,
    crd_versions,
    schema_for,
    validate_custom,
)
from deploy.k8s_checks import (
    BUILTIN_KINDS,
    OUR_SCHEMAS,
    check_wiring,
    epp_config_text,
    epp_container,
    validation_report,
)
from epp.app import config_from_args, parse_serve_args
from epp.config import EppConfig

PROVIDERS = ["none", "istio", "gke", "kgateway", "envoy-ai-gateway"]
UPSTREAM_CHART = FIXTURES / "llm-d-router-v0.10.0" / "charts"
# What a cluster with GIE v1.6.0's CRDs and the Gateway API v1.5 standard channel serves,
# besides the built-in kinds.
CURRENT_CLUSTER = {
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
}
LEGACY_API = "inference.networking.x-k8s.io/v1alpha2/InferenceModel"


def checked(rendered, *, external_gateways=frozenset(), external_pool=None) -> None:
    report = validation_report(rendered.objects, KUBE_VERSION)
    assert report.errors == []
    assert (
        check_wiring(
            rendered.objects, external_pool=external_pool, external_gateways=external_gateways
        )
        == []
    )
    assert report.ours_only <= set(OUR_SCHEMAS)
    EppConfig.model_validate(yaml.safe_load(epp_config_text(rendered.objects)))


def render_with(render_chart, values: dict, **kwargs):
    """The chart rendered with `values` as a values file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        return render_chart(path, **kwargs)


def custom_kinds(objects: list[dict]) -> set[tuple[str, str]]:
    return {(o["apiVersion"], o["kind"]) for o in objects if o["kind"] not in BUILTIN_KINDS}


# --- defaults -----------------------------------------------------------------------------


def test_defaults_render_only_kinds_a_current_cluster_serves(render_chart):
    rendered = render_chart(namespace="llm")
    assert custom_kinds(rendered.objects) == CURRENT_CLUSTER
    for kind in ("InferenceModel", "Gateway", "GatewayClass"):
        assert rendered.of_kind(kind) == []
    for api_version, kind in CURRENT_CLUSTER:
        sources = [c.source for c in schema_for(api_version, kind) or []]
        assert any(s.startswith(("gie-v1.6.0/", "gateway-api-")) for s in sources), sources
    checked(rendered, external_gateways={"llm/inference-gateway"})


def test_inference_pool_has_every_field_of_the_v1_crd(render_chart):
    (crd,) = [
        c
        for c in schema_for("inference.networking.k8s.io/v1", "InferencePool") or []
        if c.source.startswith("gie-v1.6.0/")
    ]
    spec_schema = crd.openapi["properties"]["spec"]
    pool = render_chart(set=["pool.appProtocol=kubernetes.io/h2c"]).one("InferencePool")["spec"]
    assert set(pool) == set(spec_schema["properties"])
    ref_fields = spec_schema["properties"]["endpointPickerRef"]["properties"]
    assert set(pool["endpointPickerRef"]) == set(ref_fields)
    assert pool["endpointPickerRef"]["port"] == {"number": 9002}
    assert pool["appProtocol"] == "kubernetes.io/h2c"
    # Left out by default: the CRD's default (http) applies.
    assert "appProtocol" not in render_chart().one("InferencePool")["spec"]


# --- models: objectives, rewrites, legacy InferenceModel --------------------------------


@pytest.mark.parametrize("group", ["llm-d.ai", "inference.networking.x-k8s.io"])
def test_objectives_and_rewrites_in_either_group(render_chart, group):
    values = {
        "inferenceApiGroup": group,
        "inferenceObjectives": [{"name": "high-priority", "priority": 5}, {"name": "any"}],
        "modelRewrites": [
            {
                "name": "food-review",
                "rules": [
                    {
                        "matches": [{"model": {"value": "food-review"}}],
                        "targets": [
                            {"modelRewrite": "food-review-1", "weight": 50},
                            {"modelRewrite": "food-review-2", "weight": 50},
                        ],
                    }
                ],
            }
        ],
    }
    rendered = render_with(render_chart, values)
    objectives = rendered.of_kind("InferenceObjective")
    rewrites = rendered.of_kind("InferenceModelRewrite")
    assert {o["apiVersion"] for o in objectives + rewrites} == {f"{group}/v1alpha2"}
    assert [o["spec"].get("priority") for o in objectives] == [5, None]
    assert rewrites[0]["spec"]["rules"] == values["modelRewrites"][0]["rules"]
    for obj in objectives + rewrites:
        result = validate_custom(obj, KUBE_VERSION)
        assert result is not None and result.errors == [] and result.unevaluated == []
    checked(rendered, external_gateways={"default/inference-gateway"})


LEGACY = {
    "legacyInferenceModels": {
        "models": [
            {
                "name": "food-review",
                "modelName": "food-review",
                "criticality": "Critical",
                "targetModels": [{"name": "a", "weight": 50}, {"name": "b", "weight": 50}],
            }
        ]
    }
}


def test_legacy_inference_models_only_when_the_cluster_serves_them(render_chart):
    not_served = render_with(render_chart, LEGACY)
    assert not_served.of_kind("InferenceModel") == []
    assert "legacyInferenceModels.models were NOT rendered" in not_served.notes
    served = render_with(render_chart, LEGACY, extra_args=["--api-versions", LEGACY_API])
    (model,) = served.of_kind("InferenceModel")
    assert validate_custom(model, KUBE_VERSION).errors == []  # type: ignore[union-attr]
    assert "NOT rendered" not in served.notes
    forced = render_with(
        render_chart,
        {"legacyInferenceModels": {**LEGACY["legacyInferenceModels"], "render": "always"}},
    )
    assert len(forced.of_kind("InferenceModel")) == 1
    checked(served, external_gateways={"default/inference-gateway"})


# --- gateway attachment -------------------------------------------------------------------


def test_route_attaches_to_an_existing_gateway_in_any_namespace(render_chart):
    rendered = render_chart(
        namespace="llm",
        set=[
            "gateway.name=infra-inference-gateway",
            "gateway.namespace=llm-d-infra",
            "gateway.sectionName=https",
        ],
    )
    assert rendered.of_kind("Gateway") == []
    (parent,) = rendered.one("HTTPRoute")["spec"]["parentRefs"]
    assert parent == {
        "group": "gateway.networking.k8s.io",
        "kind": "Gateway",
        "name": "infra-inference-gateway",
        "namespace": "llm-d-infra",
        "sectionName": "https",
    }
    assert "must admit routes from namespace llm" in rendered.notes
    checked(rendered, external_gateways={"llm-d-infra/infra-inference-gateway"})
    # The wiring check notices a route whose Gateway is neither rendered nor expected.
    assert check_wiring(rendered.objects) != []


def test_gateway_is_created_only_when_asked(render_chart):
    rendered = render_chart(
        set=["gateway.create=true", "gateway.className=istio", "gateway.sectionName=web"]
    )
    gateway = rendered.one("Gateway")
    assert gateway["spec"]["gatewayClassName"] == "istio"
    assert gateway["spec"]["listeners"][0]["name"] == "web"
    assert rendered.of_kind("GatewayClass") == []
    checked(rendered)


# --- providers --------------------------------------------------------------------------


@pytest.mark.parametrize("provider", PROVIDERS)
def test_each_provider_renders_valid_objects(render_chart, provider):
    rendered = render_chart(namespace="llm", set=[f"provider.name={provider}"])
    checked(rendered, external_gateways={"llm/inference-gateway"})
    extra = custom_kinds(rendered.objects) - CURRENT_CLUSTER
    expected = {
        "none": set(),
        "kgateway": set(),
        "envoy-ai-gateway": set(),
        "istio": {("networking.istio.io/v1beta1", "DestinationRule")},
        "gke": {
            ("networking.gke.io/v1", "HealthCheckPolicy"),
            ("networking.gke.io/v1", "GCPBackendPolicy"),
        },
    }[provider]
    assert extra == expected
    annotations = rendered.one("Service", "epp")["metadata"].get("annotations", {})
    assert ("cloud.google.com/neg" in annotations) is (provider == "gke")


def test_istio_destination_rule_originates_tls_to_the_epp_service(render_chart):
    rendered = render_chart(namespace="llm", set=["provider.name=istio"])
    rule = rendered.one("DestinationRule")
    assert rule["spec"] == {
        "host": "epp.llm.svc.cluster.local",
        "trafficPolicy": {"tls": {"mode": "SIMPLE", "insecureSkipVerify": True}},
    }
    assert "ENABLE_GATEWAY_API_INFERENCE_EXTENSION" in rendered.notes
    # Plaintext EPP: Istio dials plaintext by itself, no DestinationRule...
    plain = render_chart(set=["provider.name=istio", "tls.secureServing=false"])
    assert plain.of_kind("DestinationRule") == []
    # ...unless a traffic policy is given: then one without TLS.
    upstream = render_chart(VALUES_UPSTREAM, set=["tls.secureServing=false"])
    (rule,) = upstream.of_kind("DestinationRule")
    assert "tls" not in rule["spec"]["trafficPolicy"]
    assert rule["spec"]["trafficPolicy"]["connectionPool"]["http"] == {
        "maxRequestsPerConnection": 256000
    }
    # A tls of one's own replaces the unverified one.
    own = render_with(
        render_chart,
        {
            "provider": {
                "name": "istio",
                "istio": {
                    "destinationRule": {
                        "trafficPolicy": {
                            "tls": {"mode": "SIMPLE", "caCertificates": "/etc/ca.pem"}
                        }
                    }
                },
            }
        },
    )
    assert own.one("DestinationRule")["spec"]["trafficPolicy"] == {
        "tls": {"mode": "SIMPLE", "caCertificates": "/etc/ca.pem"}
    }
    checked(own, external_gateways={"default/inference-gateway"})


def test_istio_rule_is_the_upstream_charts_rule(render_chart):
    """The upstream template's DestinationRule spec, its Go template lines replaced by the
    values they take by default, equals ours."""
    text = (UPSTREAM_CHART / "llm-d-router-gateway" / "templates" / "istio.yaml").read_text()
    body = "\n".join(
        line
        for line in text.splitlines()
        if "{{" not in line or line.strip().startswith(("name:", "host:"))
    )
    body = re.sub(r"\{\{.*?\}\}", "X", body)
    upstream = yaml.safe_load(body)
    # Only under `with trafficPolicy.connectionPool` (empty by default).
    assert upstream["spec"]["trafficPolicy"].pop("connectionPool") is None
    ours = render_chart(set=["provider.name=istio"]).one("DestinationRule")
    assert upstream["apiVersion"] == ours["apiVersion"]
    assert upstream["spec"]["trafficPolicy"] == ours["spec"]["trafficPolicy"]


def test_gke_policies_as_upstream(render_chart):
    rendered = render_chart(set=["provider.name=gke"])
    health = rendered.one("HealthCheckPolicy")
    backend = rendered.one("GCPBackendPolicy")
    pool_ref = {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": "vllm-llama3-8b-instruct",
    }
    assert health["spec"]["targetRef"] == backend["spec"]["targetRef"] == pool_ref
    assert health["spec"]["default"]["config"] == {
        "type": "HTTP",
        "httpHealthCheck": {"requestPath": "/health", "port": 8000},
    }
    assert backend["spec"]["default"] == {"timeoutSec": 300, "logging": {"enabled": True}}
    assert rendered.one("Service", "epp")["metadata"]["annotations"] == {
        "cloud.google.com/neg": '{"exposed_ports":{"9002":{}}}'
    }
    # GKE ignores HTTPRoute timeouts (upstream leaves them out too).
    assert "timeouts" not in rendered.one("HTTPRoute")["spec"]["rules"][0]
    # GKE health-checks the EPP on gRPC 9003 by default; another port needs a policy.
    moved = render_chart(set=["provider.name=gke", "ports.grpcHealth=9100"])
    (epp_policy,) = [
        p for p in moved.of_kind("HealthCheckPolicy") if p["metadata"]["name"] == "epp-epp"
    ]
    assert epp_policy["spec"]["targetRef"] == {"group": "", "kind": "Service", "name": "epp"}
    assert epp_policy["spec"]["default"]["config"]["grpcHealthCheck"]["port"] == 9100
    checked(moved, external_gateways={"default/inference-gateway"})


@pytest.mark.parametrize(
    ("provider", "needs"),
    [
        (
            "envoy-ai-gateway",
            ["extension manager", "backendResources InferencePool", "InvalidKind"],
        ),
        ("kgateway", ["inferenceExtension.enabled"]),
        ("istio", ["ENABLE_GATEWAY_API_INFERENCE_EXTENSION", "DestinationRule"]),
        ("gke", ["NEG", "gRPC on 9003"]),
        ("none", ["ENABLE_GATEWAY_API_INFERENCE_EXTENSION", "backendResources InferencePool"]),
    ],
)
def test_notes_say_what_each_gateway_needs(render_chart, provider, needs):
    notes = render_chart(set=[f"provider.name={provider}"]).notes
    for phrase in needs:
        assert phrase in notes, phrase
    plain = render_chart(set=[f"provider.name={provider}", "tls.secureServing=false"]).notes
    if provider in ("kgateway", "envoy-ai-gateway"):
        assert "every request fails" in plain


# --- ports, probes, Service, RBAC as upstream -----------------------------------------------


def _upstream_template(name: str) -> str:
    return (UPSTREAM_CHART / "routerlib" / "templates" / name).read_text()


def test_ports_and_service_names_are_the_upstream_charts(render_chart):
    deployment = _upstream_template("_deployment.yaml")
    service = _upstream_template("_service.yaml")
    upstream_container_ports = re.findall(r"- name: (grpc|grpc-health|metrics)\n", deployment)
    upstream_service_ports = set(re.findall(r"- name: ([a-z-]+)\n\s+protocol: TCP", service))
    rendered = render_chart()
    ports = {p["name"]: p["containerPort"] for p in epp_container(rendered.objects)["ports"]}
    assert list(ports) == upstream_container_ports == ["grpc", "grpc-health", "metrics"]
    assert ports == {"grpc": 9002, "grpc-health": 9003, "metrics": 9090}
    svc = rendered.one("Service", "epp")["spec"]["ports"]
    assert {p["name"] for p in svc} == upstream_service_ports == {"grpc-ext-proc", "http-metrics"}
    assert {p["name"]: p["port"] for p in svc} == {"grpc-ext-proc": 9002, "http-metrics": 9090}
    # The peers port only with several replicas, and then on 9010.
    several = render_chart(set=["replicaCount=2"])
    ports = {p["name"]: p["containerPort"] for p in epp_container(several.objects)["ports"]}
    assert ports["peers"] == 9010


def test_probe_services_are_the_upstream_charts(render_chart):
    deployment = _upstream_template("_deployment.yaml")
    upstream_services = set(re.findall(r"service: ([a-z-]+)", deployment))
    assert upstream_services == {"inference-extension", "liveness", "readiness"}
    for sets in ([], ["replicaCount=3"]):
        container = epp_container(render_chart(set=sets).objects)
        for probe in ("livenessProbe", "readinessProbe"):
            assert container[probe]["grpc"]["service"] in upstream_services
            assert container[probe]["grpc"]["port"] == 9003


def _upstream_role_grants() -> set[tuple[str, str]]:
    """(apiGroup, resource) the upstream chart's EPP Roles grant (template lines dropped)."""
    grants = set()
    for path in (
        UPSTREAM_CHART / "llm-d-router-gateway" / "templates" / "rbac.yaml",
        UPSTREAM_CHART / "routerlib" / "templates" / "_rbac.yaml",
    ):
        text = "\n".join(line for line in path.read_text().splitlines() if "{{" not in line)
        for doc in yaml.safe_load_all(text):
            if doc and doc.get("kind") == "Role":
                for rule in doc["rules"]:
                    grants |= {(g, r) for g in rule["apiGroups"] for r in rule["resources"]}
    return grants


def test_rbac_covers_what_the_upstream_chart_grants(render_chart):
    upstream = _upstream_role_grants()
    assert ("llm-d.ai", "inferenceobjectives") in upstream  # the parse found the rules
    role = render_chart().one("Role")
    ours = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert upstream <= ours
    assert {verb for rule in role["rules"] for verb in rule["verbs"]} == {"get", "list", "watch"}


def test_extra_volumes_and_pod_options(render_chart):
    rendered = render_chart(VALUES_ALL)
    pod = rendered.one("Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert {"name": "tokenizer", "mountPath": "/etc/epp/tokenizer", "readOnly": True} in container[
        "volumeMounts"
    ]
    assert any(v["name"] == "tokenizer" and "persistentVolumeClaim" in v for v in pod["volumes"])
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert pod["tolerations"][0]["key"] == "dedicated"
    assert (
        rendered.one("Deployment")["spec"]["template"]["metadata"]["annotations"][
            "example.com/scrape"
        ]
        == "true"
    )


def test_upstream_style_values(render_chart):
    rendered = render_chart(VALUES_UPSTREAM, namespace="llm")
    checked(rendered, external_gateways={"llm-d-infra/infra-inference-gateway"})
    objectives = {o["metadata"]["name"]: o for o in rendered.of_kind("InferenceObjective")}
    assert {n: o["spec"]["priority"] for n, o in objectives.items()} == {
        "high-priority": 5,
        "low-priority": 1,
    }
    assert rendered.one("InferencePool")["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    config = yaml.safe_load(epp_config_text(rendered.objects))
    assert config["server"]["secure_serving"] is True
    assert config["replicas"]["listen_port"] == 9010


# --- the validation itself ---------------------------------------------------------------


def test_every_cel_rule_of_the_inference_crds_is_evaluated():
    rules = {
        rule
        for (api_version, _), versions in crd_versions().items()
        if api_version.split("/")[0] in INFERENCE_GROUPS
        for crd in versions
        for _, rule in cel_rules(crd.openapi)
    }
    assert rules and rules <= set(CEL_RULES)


def test_cel_rules_of_every_render_are_evaluated(render_chart):
    for values in ((), (VALUES_ALL,), (VALUES_UPSTREAM,)):
        report = validation_report(render_chart(*values).objects, KUBE_VERSION)
        assert report.unevaluated == [] and report.errors == []


def test_a_cel_rule_without_translation_fails(render_chart):
    route = copy.deepcopy(render_chart().one("HTTPRoute"))
    route["spec"]["rules"][0]["filters"] = [
        {
            "type": "RequestHeaderModifier",
            "requestHeaderModifier": {"set": [{"name": "x", "value": "y"}]},
        }
    ]
    report = validation_report([route], KUBE_VERSION)
    assert report.unevaluated
    assert any("CEL rule not evaluated" in e for e in report.errors)


def _route_and_gateway(render_chart) -> tuple[dict, dict]:
    rendered = render_chart(set=["gateway.create=true", "gateway.className=istio"])
    return copy.deepcopy(rendered.one("HTTPRoute")), copy.deepcopy(rendered.one("Gateway"))


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda r, g: r["spec"]["rules"][0]["matches"][0]["path"].update(value="/a//b"), "rules"),
        (lambda r, g: r["spec"]["rules"][0]["matches"][0]["path"].update(value="/a b"), "rules"),
        (
            lambda r, g: r["spec"]["parentRefs"].append(dict(r["spec"]["parentRefs"][0])),
            "parentRefs",
        ),
        (
            lambda r, g: r["spec"]["rules"][0]["timeouts"].update(backendRequest="700s"),
            "timeouts",
        ),
        (lambda r, g: g["spec"]["listeners"].append(dict(g["spec"]["listeners"][0])), "listeners"),
        (
            lambda r, g: g["spec"]["listeners"][0].update(tls={"mode": "Terminate"}),
            "listeners",
        ),
    ],
    ids=[
        "double-slash",
        "bad-char",
        "duplicate-parent",
        "backend-timeout",
        "dup-listener",
        "http-tls",
    ],
)
def test_gateway_api_cel_translations_reject_what_the_api_server_would(
    render_chart, breakage, message
):
    route, gateway = _route_and_gateway(render_chart)
    assert validation_report([route, gateway], KUBE_VERSION).errors == []
    breakage(route, gateway)
    errors = validation_report([route, gateway], KUBE_VERSION).errors
    assert errors and all(message in e for e in errors), errors


@pytest.mark.parametrize(
    ("breakage", "message"),
    [
        (lambda o: o["spec"]["targetPorts"].append({"number": 8000}), "port number must be unique"),
        (lambda o: o["spec"]["endpointPickerRef"].pop("port"), "port is required"),
        (lambda o: o["spec"].update(appProtocol="grpc"), "'grpc' is not one of"),
        (lambda o: o["spec"].update(unknownField=1), "Additional properties"),
        (lambda o: o["spec"]["selector"].pop("matchLabels"), "'matchLabels' is a required"),
        (lambda o: o["metadata"].update(labelz={}), "metadata"),
        (lambda o: o.update(apiVersion="inference.networking.k8s.io/v2"), "no schema"),
    ],
    ids=["dup-ports", "no-port", "app-protocol", "unknown-field", "no-selector", "meta", "version"],
)
def test_a_broken_pool_fails_validation(render_chart, breakage, message):
    rendered = render_chart()
    pool = copy.deepcopy(rendered.one("InferencePool"))
    breakage(pool)
    errors = validation_report([pool], KUBE_VERSION).errors
    assert errors and any(message in e for e in errors), errors


def test_a_kind_without_a_schema_fails():
    unknown = {
        "apiVersion": "example.com/v1",
        "kind": "Widget",
        "metadata": {"name": "w"},
        "spec": {},
    }
    assert validation_report([unknown], KUBE_VERSION).errors == [
        "example.com/v1 Widget w: no schema to check it against"
    ]


def test_gke_policies_are_checked_only_against_our_schemas(render_chart):
    rendered = render_chart(set=["provider.name=gke"])
    report = validation_report(rendered.objects, KUBE_VERSION)
    assert report.ours_only == {"HealthCheckPolicy", "GCPBackendPolicy"}
    broken = copy.deepcopy(rendered.one("GCPBackendPolicy"))
    broken["spec"]["default"]["timeoutSecs"] = 300
    assert validation_report([broken], KUBE_VERSION).errors


# --- what `epp serve` makes of the rendered Deployment ------------------------------------


def effective_config(rendered, tmp_path: Path, namespace: str) -> EppConfig:
    """The EppConfig `epp serve` builds from the rendered container's args (through its
    real argument parsing, upstream flags included) and the rendered config file, with the
    paths the pod mounts moved under tmp_path and $(POD_NAMESPACE) expanded as the kubelet
    does."""
    container = epp_container(rendered.objects)
    config_file = tmp_path / "config.yaml"
    config_file.write_text(epp_config_text(rendered.objects))
    endpoints = [
        o for o in rendered.of_kind("ConfigMap") if o["metadata"]["name"].endswith("-endpoints")
    ]
    args = []
    for arg in container["args"]:
        arg = arg.replace("$(POD_NAMESPACE)", namespace)
        if arg.startswith("--config="):
            arg = f"--config={config_file}"
        elif arg.startswith("--endpoints="):
            path = tmp_path / "endpoints.yaml"
            path.write_text(endpoints[0]["data"]["endpoints.yaml"])
            arg = f"--endpoints={path}"
        args.append(arg)
    parsed, upstream = parse_serve_args(args)
    return config_from_args(parsed, upstream)


@pytest.mark.parametrize(
    ("values", "sets"),
    [
        ((), []),
        ((VALUES_ALL,), []),
        ((VALUES_UPSTREAM,), []),
        ((VALUES_STATIC,), []),
        ((), ["tls.secureServing=false", "replicaCount=2"]),
        ((), ["pool.create=false", "pool.group=inference.networking.x-k8s.io"]),
    ],
    ids=["defaults", "values-all", "values-upstream", "values-static", "plaintext", "alpha-pool"],
)
def test_epp_serve_builds_the_intended_config_from_the_render(render_chart, tmp_path, values, sets):
    rendered = render_chart(*values, set=sets, namespace="llm")
    config = effective_config(rendered, tmp_path, "llm")
    (deployment,) = [
        d
        for d in rendered.of_kind("Deployment")
        if d["metadata"]["labels"]["app.kubernetes.io/component"] == "endpoint-picker"
    ]
    service = rendered.one("Service", deployment["metadata"]["name"])
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert config.server.grpc_port == ports["grpc-ext-proc"]
    assert config.server.metrics_port == ports["http-metrics"]
    probe_port = epp_container(rendered.objects)["readinessProbe"]["grpc"]["port"]
    assert config.server.grpc_health_port == probe_port
    assert config.server.secure_serving is ("tls.secureServing=false" not in sets)
    if rendered.of_kind("InferencePool") or "pool.create=false" in sets:
        assert config.discovery.pool_namespace == "llm"
        assert (
            config.discovery.pool_name
            == (rendered.one("HTTPRoute")["spec"]["rules"][0]["backendRefs"][0]["name"])
        )
    if "pool.group=inference.networking.x-k8s.io" in sets:
        assert config.discovery.pool_group == "inference.networking.x-k8s.io"
        (backend,) = rendered.one("HTTPRoute")["spec"]["rules"][0]["backendRefs"]
        assert backend["group"] == "inference.networking.x-k8s.io"


def test_upstream_flags_in_extra_args_reach_the_config(render_chart, tmp_path):
    values = {
        "extraArgs": ["--zap-encoder=json", "-v=4", "--tracing=false", "--grpc-health-port=9003"]
    }
    rendered = render_with(render_chart, values)
    config = effective_config(rendered, tmp_path, "default")
    assert config.log_format == "json"
    assert config.log_level == "debug"
