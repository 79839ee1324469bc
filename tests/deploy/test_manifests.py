"""The static manifests (deploy/kubernetes/) and the chart's renders: valid against the
Kubernetes schemas (built-in kinds) or the upstream CRDs' schemas (k8s_checks.py,
crd_schemas.py), wired together, and carrying a configuration the EPP accepts."""

from __future__ import annotations

import asyncio
import json

import grpc
import jsonschema
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.conftest import (
    CHART,
    KUBE_VERSION,
    VALUES_ALL,
    VALUES_STATIC,
    VALUES_UPSTREAM,
    RenderError,
    example_objects,
    standalone_envoy_objects,
    static_files,
    static_objects,
)
from deploy.k8s_checks import (
    BUILTIN_KINDS,
    check_wiring,
    epp_config_text,
    epp_container,
    validate_objects,
)
from epp import upstream_flags
from epp.app import build_parser, our_flag_names, parse_serve_args
from epp.config import EppConfig, load_endpoints_file
from epp.extproc.server import HealthState

RENDERS = {
    "defaults": (),
    "values-all": (VALUES_ALL,),
    "values-static": (VALUES_STATIC,),
    "values-upstream": (VALUES_UPSTREAM,),
}
# Kinds each render must contain: every option in the values files shows up as objects.
EXPECTED_KINDS = {
    "defaults": {
        "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "Deployment",
        "InferencePool", "HTTPRoute",
    },
    "values-all": {
        "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "Deployment",
        "PodDisruptionBudget", "InferencePool", "InferenceObjective", "InferenceModelRewrite",
        "InferenceModel", "GatewayClass", "Gateway", "HTTPRoute", "ServiceMonitor", "Secret",
        "DestinationRule", "NetworkPolicy",
    },
    # Several replicas: the peers' NetworkPolicy too (their Secret exists already).
    "values-static": {
        "ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "NetworkPolicy",
    },
    "values-upstream": {
        "ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Service", "Deployment",
        "PodDisruptionBudget", "InferencePool", "InferenceObjective", "HTTPRoute",
        "DestinationRule", "Secret", "NetworkPolicy",
    },
}  # fmt: skip
# Gateways each render's HTTPRoute attaches to without creating them (namespace "llm").
EXISTING_GATEWAYS = {
    "defaults": {"llm/inference-gateway"},
    "values-all": set(),
    "values-static": set(),
    "values-upstream": {"llm-d-infra/infra-inference-gateway"},
}


OUR_FLAGS = our_flag_names(build_parser())  # long flags of `epp serve`, no dashes


# --- the static manifests ---------------------------------------------------------------


def test_every_static_file_is_listed_in_the_kustomization():
    # examples/ is a folder of its own, not applied by default.
    on_disk = {p.name for p in (static_files()[0].parent).glob("*.yaml")} - {"kustomization.yaml"}
    assert on_disk == {p.name for p in static_files()}


@pytest.mark.parametrize("version", [KUBE_VERSION, "1.37.0"])
def test_static_manifests_validate(version):
    objects = static_objects() + standalone_envoy_objects() + example_objects()
    assert validate_objects(objects, version) == []
    # One replica: no peers port, so no peers Secret or NetworkPolicy (the chart has them).
    one_replica = {"Secret", "PodDisruptionBudget", "NetworkPolicy"}
    assert {o["kind"] for o in objects} >= BUILTIN_KINDS - one_replica
    assert {o["kind"] for o in example_objects()} == {
        "Gateway", "GatewayClass", "InferenceObjective", "InferenceModelRewrite",
    }  # fmt: skip


def test_static_manifests_are_wired():
    existing = {"default/inference-gateway"}
    assert check_wiring(static_objects(), external_gateways=existing) == []
    assert (
        check_wiring(standalone_envoy_objects() + static_objects(), external_gateways=existing)
        == []
    )
    assert check_wiring(static_objects() + example_objects()) == []


def test_static_config_is_a_valid_epp_config():
    config = yaml.safe_load(epp_config_text(static_objects()))
    EppConfig.model_validate(config)


# --- the chart --------------------------------------------------------------------------


@pytest.mark.parametrize("render_id", RENDERS)
def test_chart_renders_and_validates(render_chart, render_id):
    rendered = render_chart(*RENDERS[render_id], namespace="llm")
    kinds = {o["kind"] for o in rendered.objects}
    assert kinds == EXPECTED_KINDS[render_id]
    assert validate_objects(rendered.objects, KUBE_VERSION) == []
    external = None if render_id != "values-static" else "existing-pool"
    gateways = EXISTING_GATEWAYS[render_id]
    assert check_wiring(rendered.objects, external_pool=external, external_gateways=gateways) == []
    for obj in rendered.objects:
        if obj["kind"] != "GatewayClass":
            assert obj["metadata"]["namespace"] == "llm", obj["metadata"]["name"]


@pytest.mark.parametrize("render_id", RENDERS)
def test_rendered_config_is_a_valid_epp_config(render_chart, render_id):
    rendered = render_chart(*RENDERS[render_id])
    config = yaml.safe_load(epp_config_text(rendered.objects))
    # Every key as rendered: a key EppConfig lacks (server.tls, server.grpc_health_port,
    # server.secure_serving) fails here, it is not dropped.
    EppConfig.model_validate(config)


def test_values_reach_the_config(render_chart):
    config = yaml.safe_load(epp_config_text(render_chart(VALUES_ALL).objects))
    assert config["scheduling"]["weights"] == {
        "cache": 0.6, "load": 0.2, "queue": 0.1, "health": 0.05, "adapter": 0.05,
    }  # fmt: skip
    assert config["scheduling"]["max_queue"] == 32
    assert config["scheduling"]["tie_epsilon"] == 0.01  # from extraConfig
    assert config["flow_control"]["ttl_s"] == 30
    assert config["server"]["tls"] == {
        "cert_file": "/etc/epp/tls/tls.crt",
        "key_file": "/etc/epp/tls/tls.key",
        "client_ca_file": "/etc/epp/tls/ca.crt",
    }
    static = yaml.safe_load(epp_config_text(render_chart(VALUES_STATIC).objects))
    assert static["server"]["assumed_body_mode"] == "BUFFERED"
    # The chart's keys win over extraConfig, a 0 included (a merge would keep the 3).
    override = render_chart(set=["extraConfig.scheduling.fallbacks=3"])
    assert yaml.safe_load(epp_config_text(override.objects))["scheduling"]["fallbacks"] == 0


def test_tls_config_keys_are_epp_config_keys(render_chart):
    config = yaml.safe_load(epp_config_text(render_chart(VALUES_ALL).objects))
    parsed = EppConfig.model_validate(config)
    assert parsed.server.tls is not None and parsed.server.secure_serving is True
    plaintext = yaml.safe_load(
        epp_config_text(render_chart(set=["tls.secureServing=false"]).objects)
    )
    assert EppConfig.model_validate(plaintext).server.secure_serving is False
    default = EppConfig.model_validate(yaml.safe_load(epp_config_text(render_chart().objects)))
    assert default.server.secure_serving is True and default.server.tls is None


def test_static_discovery_file_is_an_endpoints_file(render_chart, tmp_path):
    rendered = render_chart(VALUES_STATIC)
    (endpoints,) = [
        o for o in rendered.of_kind("ConfigMap") if o["metadata"]["name"].endswith("-endpoints")
    ]
    path = tmp_path / "endpoints.yaml"
    path.write_text(endpoints["data"]["endpoints.yaml"])
    assert [e.address for e in load_endpoints_file(path)] == ["10.0.0.10:8000", "10.0.0.11:8000"]
    container = epp_container(rendered.objects)
    assert "--endpoints=/etc/epp/endpoints/endpoints.yaml" in container["args"]
    assert not any(a.startswith("--pool-name") for a in container["args"])
    # A directory mount: kubelet swaps the files of a ConfigMap volume, subPath never updates.
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "endpoints"]
    assert mount["mountPath"] == "/etc/epp/endpoints" and "subPath" not in mount


# --- what the Deployment asks of the EPP --------------------------------------------------


def _probe_services(container: dict) -> dict[str, str]:
    return {
        probe: container[probe]["grpc"]["service"] for probe in ("livenessProbe", "readinessProbe")
    }


async def _served_health_names(names: list[str]) -> dict[str, int]:
    """Starts the EPP's own HealthState on a gRPC server and asks it for each name."""
    state = HealthState()
    await state.set(live=True, ready=True)
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(state.servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            answers = {}
            for name in names:
                try:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                    answers[name] = reply.status
                except grpc.aio.AioRpcError as exc:
                    answers[name] = -1 if exc.code() == grpc.StatusCode.NOT_FOUND else -2
            return answers
    finally:
        await server.stop(None)


def test_probes_ask_the_health_names_the_server_registers(render_chart):
    """gRPC probes on the plaintext health port (9003, server.grpc_health_port) as the
    upstream chart probes: `inference-extension` with one replica, `readiness` with
    several; liveness asks `liveness` (see the Deployment template for why)."""
    static = _probe_services(epp_container(static_objects()))
    chart = _probe_services(epp_container(render_chart().objects))
    several = _probe_services(epp_container(render_chart(set=["replicaCount=3"]).objects))
    assert static == chart == {"livenessProbe": "liveness", "readinessProbe": "inference-extension"}
    assert several == {"livenessProbe": "liveness", "readinessProbe": "readiness"}
    for objects in (static_objects(), render_chart().objects):
        container = epp_container(objects)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports == {"grpc": 9002, "grpc-health": 9003, "metrics": 9090}
        config = EppConfig.model_validate(yaml.safe_load(epp_config_text(objects)))
        for probe in ("livenessProbe", "readinessProbe"):
            assert container[probe]["grpc"]["port"] == config.server.grpc_health_port == 9003
    names = sorted({*static.values(), *several.values()})
    answers = asyncio.run(_served_health_names(names))
    assert answers == dict.fromkeys(names, health_pb2.HealthCheckResponse.SERVING)


def test_tls_secret_is_mounted_as_a_directory(render_chart):
    container = epp_container(render_chart(VALUES_ALL).objects)
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "tls"]
    assert mount["mountPath"] == "/etc/epp/tls" and "subPath" not in mount
    # No Secret: the EPP makes its own certificate; nothing mounted.
    default = epp_container(render_chart().objects)
    assert not [m for m in default["volumeMounts"] if m["name"] == "tls"]


def test_epp_serve_knows_the_flags_the_manifests_pass(render_chart, capsys):
    containers = {
        "deploy/kubernetes": epp_container(static_objects()),
        "chart": epp_container(render_chart().objects),
        "chart, static values": epp_container(render_chart(VALUES_STATIC).objects),
        "chart, all values": epp_container(render_chart(VALUES_ALL).objects),
        "chart, upstream-style values": epp_container(render_chart(VALUES_UPSTREAM).objects),
    }
    honoured = set(OUR_FLAGS) | set(upstream_flags.MAPPED) | set(upstream_flags.HONOURED)
    for where, container in containers.items():
        args = container["args"]
        try:
            _, upstream = parse_serve_args(args)  # what `epp serve` runs on
        except SystemExit:
            pytest.fail(f"{where}: `epp serve` refuses {args}: {capsys.readouterr().err}")
        # Our own manifests pass nothing that `epp serve` would only accept and ignore.
        assert upstream.ignored == [], f"{where}: ignored flags {upstream.ignored}"
        flags = {a.split("=", 1)[0].lstrip("-") for a in args if a.startswith("-")}
        assert flags <= honoured, f"{where}: {sorted(flags - honoured)}"


def test_log_level_env_is_what_epp_serve_reads(render_chart):
    env = {e["name"]: e for e in epp_container(render_chart(VALUES_ALL).objects)["env"]}
    assert env["EPP_LOG_LEVEL"]["value"] == "debug"
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    choices = next(a.choices for a in build_parser()._actions if "--log-level" in a.option_strings)
    assert "debug" in choices


def test_security_context_non_root_read_only(render_chart):
    for objects in (static_objects(), render_chart().objects, render_chart(VALUES_STATIC).objects):
        for deployment in [o for o in objects if o["kind"] == "Deployment"]:
            pod = deployment["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True
            assert pod["securityContext"]["runAsUser"] != 0
            for container in pod["containers"]:
                assert container["securityContext"]["readOnlyRootFilesystem"] is True
                assert container["securityContext"]["allowPrivilegeEscalation"] is False
                assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
                assert container["resources"]["requests"]


# --- replicas, failure mode, pool ---------------------------------------------------------


def test_one_replica_has_no_pdb_and_no_anti_affinity(render_chart):
    rendered = render_chart()
    assert rendered.of_kind("PodDisruptionBudget") == []
    assert "affinity" not in rendered.one("Deployment")["spec"]["template"]["spec"]


def test_more_replicas_add_pdb_and_anti_affinity(render_chart):
    rendered = render_chart(set=["replicaCount=2"])
    pdb = rendered.one("PodDisruptionBudget")
    deployment = rendered.one("Deployment")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    (term,) = deployment["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert (
        term["podAffinityTerm"]["labelSelector"]["matchLabels"]
        == deployment["spec"]["selector"]["matchLabels"]
    )
    # A user-given affinity replaces the default one.
    custom = render_chart(VALUES_STATIC).one("Deployment", "epp")["spec"]["template"]["spec"][
        "affinity"
    ]
    assert set(custom) == {"nodeAffinity"}


def test_failure_mode_and_pool_values(render_chart):
    pool = render_chart(set=["failureMode=FailOpen"]).one("InferencePool")
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    all_pool = render_chart(VALUES_ALL).one("InferencePool")
    assert all_pool["spec"]["targetPorts"] == [{"number": 8000}, {"number": 8001}]
    assert all_pool["spec"]["selector"]["matchLabels"] == {"app": "vllm-qwen3-32b", "tier": "gpu"}
    assert all_pool["spec"]["endpointPickerRef"]["name"] == "llm-epp"
    assert all_pool["spec"]["appProtocol"] == "http"
    objectives = render_chart(VALUES_ALL).of_kind("InferenceObjective")
    assert [o["apiVersion"] for o in objectives] == ["inference.networking.x-k8s.io/v1alpha2"] * 3
    assert [o["spec"].get("priority") for o in objectives] == [10, -1, None]
    assert all(o["spec"]["poolRef"]["name"] == "qwen3-32b" for o in objectives)


def test_existing_pool_is_referenced_not_created(render_chart):
    rendered = render_chart(set=["pool.create=false", "pool.name=shared-pool"])
    assert rendered.of_kind("InferencePool") == []
    assert "--pool-name=shared-pool" in epp_container(rendered.objects)["args"]
    (backend,) = rendered.one("HTTPRoute")["spec"]["rules"][0]["backendRefs"]
    assert backend["name"] == "shared-pool"
    gateway = {"default/inference-gateway"}
    assert (
        check_wiring(rendered.objects, external_pool="shared-pool", external_gateways=gateway) == []
    )
    assert "endpointPickerRef must name Service epp" in rendered.notes


# --- values the chart refuses ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["scheduling.weights.cache=1", "scheduling.weights.load=0.5"], "must sum to 1.0"),
        (["bodyMode=STREAMED"], "bodyMode must be"),
        (["failureMode=Open"], "failureMode must be"),
        (["discovery.mode=dns"], "discovery.mode must be"),
        (["tls.enabled=true"], "tls.enabled is gone"),
        (["tls.secureServing=false", "tls.secretName=x"], "needs tls.secureServing: true"),
        (["tls.clientAuth=true"], "tls.clientAuth needs tls.secretName"),
        (
            ["tls.secretName=x", "tls.clientAuth=true", "standaloneEnvoy.enabled=true"],
            "standaloneEnvoy has no client certificate",
        ),
        (["models.x=1"], "models: is gone"),
        (["pool.group=inference.networking.x-k8s.io"], "pool.create renders"),
        (["pool.group=example.com"], "pool.group must be"),
        (["provider.name=nginx"], "provider.name must be"),
        (["inferenceApiGroup=example.com"], "inferenceApiGroup must be"),
        (["gateway.create=true"], "gateway.className is required"),
        (["pool.appProtocol=grpc"], "pool.appProtocol must be"),
        (["ports.grpcHealth=9002"], "ports must differ"),
        (["replicaCount=2", "ports.peers=9003"], "ports must differ"),
        (["pool.name="], "pool.name is required"),
        (["pool.targetPorts=null"], "pool.targetPorts must list 1 to 8 ports"),
    ],
)
def test_bad_values_fail_rendering(render_chart, sets, message):
    with pytest.raises(RenderError, match=message):
        render_chart(set=sets)


def _merged(defaults: dict, override: dict) -> dict:
    out = dict(defaults)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        elif value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def test_values_files_match_values_schema():
    """Helm checks the merged values against values.schema.json (helm_render does not)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())
    for values in (defaults, _merged(defaults, yaml.safe_load(VALUES_ALL.read_text()))):
        jsonschema.validate(values, schema)
    for values in (VALUES_STATIC, VALUES_UPSTREAM):
        jsonschema.validate(_merged(defaults, yaml.safe_load(values.read_text())), schema)
    for bad in (
        {"bodyMode": "STREAMED"},
        {"replicas": 2},
        {"tls": {"enabled": True}},
        {"models": []},
        {"provider": {"name": "nginx"}},
        {"gateway": {"namespace": "Not_A_Namespace"}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(_merged(defaults, bad), schema)


def test_notes_render_and_warn(render_chart):
    notes = render_chart().notes
    assert "kubectl -n default rollout status deployment/epp" in notes
    assert "WARNING" not in notes
    fail_open = render_chart(set=["failureMode=FailOpen"]).notes
    assert "FailOpen has no effect with bodyMode FULL_DUPLEX_STREAMED" in fail_open
    assert "WARNING" not in render_chart(VALUES_STATIC).notes  # FailOpen with BUFFERED
