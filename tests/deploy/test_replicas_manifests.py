"""EPP replicas find each other through a headless Service: with replicaCount > 1 the
chart's Service lists every EPP pod (ready or not) on the peers port (9010), and the
EPP's configuration names it as its peers and listens on that port. One replica (the
chart's default, and deploy/kubernetes/) has no peers port and no peers configuration.
No RBAC: DNS needs none (tests/deploy/test_rbac.py keeps the grants to the watched
resources).

With several replicas they share a secret by default (issue 15, finding 4): an existing
Secret, or one the chart creates from `replicas.secret.value` or generates (random, and
kept across upgrades: Helm's `lookup`, which tools/helm_render answers from `--lookup`
files), mounted as a directory and named in `replicas.secret_file`. Only with
`replicas.secret.generate: false` and no secret is the peers port unauthenticated, and the
notes say so. A NetworkPolicy (`replicas.networkPolicy.enabled`, on by default) lets only
the EPP pods reach the peers port and leaves every other port as open as without it."""

from __future__ import annotations

import base64
import json

import jsonschema
import pytest
import yaml

from deploy.conftest import CHART, KUBE_VERSION, VALUES_ALL, RenderError, static_objects
from deploy.k8s_checks import epp_config_text, epp_container, validate_objects
from epp.config import EppConfig


def check_peers(objects: list[dict], fullname: str) -> None:
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    peers = services[f"{fullname}-peers"]["spec"]
    assert peers["clusterIP"] == "None"
    assert peers["publishNotReadyAddresses"] is True
    (deployment,) = [
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == fullname
    ]
    pod = deployment["spec"]["template"]
    assert peers["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "epp"]
    container_ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    ports = {p["name"]: p for p in peers["ports"]}
    assert ports["peers"]["targetPort"] == "peers"
    assert ports["grpc"]["targetPort"] == "grpc"

    (config_map,) = [
        o
        for o in objects
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == f"{fullname}-config"
    ]
    config = EppConfig.model_validate(yaml.safe_load(config_map["data"]["config.yaml"]))
    assert config.replicas.peers == [f"{fullname}-peers:{ports['peers']['port']}"]
    assert config.replicas.listen_port == container_ports["peers"] == ports["peers"]["port"]
    assert config.server.grpc_port == container_ports["grpc"] == ports["grpc"]["port"]


def check_no_peers(objects: list[dict], fullname: str) -> None:
    """One replica: no peers port anywhere, no replicas section in the config; the headless
    Service stays (the standalone Envoy reaches the EPP through it) with its grpc port."""
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    assert [p["name"] for p in services[f"{fullname}-peers"]["spec"]["ports"]] == ["grpc"]
    (container,) = [
        c
        for o in objects
        if o["kind"] == "Deployment" and o["metadata"]["name"] == fullname
        for c in o["spec"]["template"]["spec"]["containers"]
    ]
    assert "peers" not in {p["name"] for p in container["ports"]}
    config = yaml.safe_load(epp_config_text(objects))
    assert "replicas" not in config
    assert EppConfig.model_validate(config).replicas.peers == []


def test_one_replica_has_no_peers(render_chart):
    check_no_peers(static_objects(), "epp")
    check_no_peers(render_chart().objects, "epp")
    # A secret set for one replica is not mounted: there is no peers port to protect.
    rendered = render_chart(set=[f"replicas.secret.value={SECRET_VALUE}"])
    check_no_peers(rendered.objects, "epp")
    assert rendered.of_kind("Secret") == []


@pytest.mark.parametrize(
    ("values", "sets", "fullname"),
    [
        (None, ["replicaCount=2"], "epp"),
        (None, ["replicaCount=3", "ports.peers=9100", "fullnameOverride=picker"], "picker"),
        (VALUES_ALL, [], None),
    ],
    ids=["two", "scaled", "values-all"],
)
def test_chart_wires_the_peers_service(render_chart, values, sets, fullname):
    rendered = render_chart(values, set=sets) if values else render_chart(set=sets)
    if fullname is None:
        fullname = rendered.one("Deployment")["metadata"]["name"]
    check_peers(rendered.objects, fullname)
    if "ports.peers=9100" not in sets:
        assert yaml.safe_load(epp_config_text(rendered.objects))["replicas"]["listen_port"] == 9010


def test_extra_config_keeps_other_replicas_keys(render_chart):
    rendered = render_chart(set=["extraConfig.replicas.history=100", "replicaCount=2"])
    config = yaml.safe_load(rendered.one("ConfigMap", "epp-config")["data"]["config.yaml"])
    assert config["replicas"]["history"] == 100
    assert config["replicas"]["peers"] == ["epp-peers:9010"]


# -- the peers' shared secret (replicas.secret_file) ------------------------------------
SECRET_VALUE = "9c1f5a27e0b3d84f6a2c1e7b90d3f5a8"


def peers_secret(rendered) -> tuple[dict, dict | None, dict | None, str | None]:
    """The EPP's config, its peers-secret volume and mount, and the secret file's path."""
    objects = rendered.objects
    config = yaml.safe_load(epp_config_text(objects))
    pod = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    volume = next((v for v in pod["volumes"] if v["name"] == "peers-secret"), None)
    mount = next(
        (m for m in epp_container(objects)["volumeMounts"] if m["name"] == "peers-secret"), None
    )
    return config, volume, mount, config["replicas"].get("secret_file")


def check_secret_wiring(rendered, secret_name: str, key: str) -> None:
    config, volume, mount, secret_file = peers_secret(rendered)
    assert volume == {
        "name": "peers-secret",
        "secret": {"secretName": secret_name, "items": [{"key": key, "path": "secret"}]},
    }
    # A directory mount (no subPath): a changed Secret reaches the file the EPP re-reads.
    assert mount == {"name": "peers-secret", "mountPath": "/etc/epp/peers-secret", "readOnly": True}
    assert secret_file == f"{mount['mountPath']}/{volume['secret']['items'][0]['path']}"
    assert EppConfig.model_validate(config).replicas.secret_file is not None
    assert validate_objects(rendered.objects, KUBE_VERSION) == []


def test_only_without_generate_the_peers_port_is_unauthenticated_and_the_notes_say_so(
    render_chart,
):
    rendered = render_chart(set=["replicaCount=2", "replicas.secret.generate=false"])
    _, volume, mount, secret_file = peers_secret(rendered)
    assert (volume, mount, secret_file) == (None, None, None)
    assert rendered.of_kind("Secret") == []
    assert "the peers port 9010 is unauthenticated" in rendered.notes
    assert "unauthenticated" not in render_chart().notes  # one replica: no peers port
    assert "unauthenticated" not in render_chart(set=["replicaCount=2"]).notes


def generated_secret(rendered) -> str:
    secret = rendered.one("Secret", "epp-peers-secret")
    return base64.b64decode(secret["data"]["secret"]).decode()


def test_several_replicas_get_a_generated_secret_by_default(render_chart):
    rendered = render_chart(set=["replicaCount=2"])
    value = generated_secret(rendered)
    assert len(value) == 64 and value.isalnum()  # randAlphaNum 64: about 380 bits
    check_secret_wiring(rendered, "epp-peers-secret", "secret")
    assert "Secret epp-peers-secret (key secret)" in rendered.notes
    assert generated_secret(render_chart(set=["replicaCount=2"])) != value  # random


def test_the_generated_secret_is_kept_across_upgrades(render_chart, tmp_path):
    """On upgrade Helm's lookup finds the release's Secret and the chart keeps its value: a
    new one at every upgrade would split the replicas until every pod had the new file."""
    first = render_chart(set=["replicaCount=2"])
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(yaml.safe_dump_all(first.objects))
    args = ["--lookup", str(cluster)]
    again = render_chart(set=["replicaCount=3"], extra_args=args)
    assert generated_secret(again) == generated_secret(first)
    check_secret_wiring(again, "epp-peers-secret", "secret")
    # A value given later wins over the kept one; another key, or another namespace's
    # Secret of that name, is not this release's secret.
    given = render_chart(set=["replicaCount=2", f"replicas.secret.value={SECRET_VALUE}"])
    assert generated_secret(given) == SECRET_VALUE
    other_key = render_chart(set=["replicaCount=2", "replicas.secret.key=token"], extra_args=args)
    assert base64.b64decode(other_key.one("Secret")["data"]["token"]).decode() != generated_secret(
        first
    )
    elsewhere = render_chart(set=["replicaCount=2"], namespace="other", extra_args=args)
    assert generated_secret(elsewhere) != generated_secret(first)


def test_the_renderer_looks_up_as_helm_does(render_chart, tmp_path):
    """tools/helm_render's --lookup: an object by name, {} when absent, a list with name ""."""
    chart = tmp_path / "chart"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: probe\nversion: 0.1.0\n")
    (chart / "templates" / "probe.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: probe\ndata:\n"
        '  found: {{ dig "data" "k" "" (lookup "v1" "Secret" "ns" "s") | quote }}\n'
        '  absent: {{ len (lookup "v1" "Secret" "ns" "nope") | quote }}\n'
        '  listed: {{ len (dig "items" list (lookup "v1" "Secret" "" "")) | quote }}\n'
        '  kind: {{ dig "kind" "" (lookup "v1" "Secret" "ns" "") | quote }}\n'
        "  upgrade: {{ .Release.IsUpgrade | quote }}\n"
    )
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        yaml.safe_dump_all(
            [
                {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": n, "namespace": ns}}
                | ({"data": {"k": "dg=="}} if n == "s" else {})
                for n, ns in (("s", "ns"), ("t", "other"))
            ]
        )
    )
    data = render_chart(chart=chart, extra_args=["--lookup", str(cluster)]).one("ConfigMap")["data"]
    assert data == {
        "found": "dg==",
        "absent": "0",
        "listed": "2",
        "kind": "SecretList",
        "upgrade": "true",
    }
    assert render_chart(chart=chart).one("ConfigMap")["data"]["found"] == ""  # helm template


# -- the NetworkPolicy of the peers port ---------------------------------------------------
def allowed(policy: dict, port: int, name: str, from_epp: bool, protocol: str = "TCP") -> bool:
    """Whether the policy's ingress rules let a connection to the pod's `port` (named
    `name`, "" for none) in, from an EPP pod or from anything else."""
    for rule in policy["spec"]["ingress"]:
        sources = rule.get("from")
        if sources is not None:
            if not from_epp:
                continue
            selectors = [s["podSelector"]["matchLabels"] for s in sources]
            pod_labels = policy["spec"]["podSelector"]["matchLabels"]
            if not any(sel.items() <= pod_labels.items() for sel in selectors):
                continue
        for entry in rule.get("ports", [{}]):
            if entry.get("protocol", "TCP") != protocol:
                continue
            first = entry.get("port")
            if first is None or first == name:
                return True
            if isinstance(first, int) and first <= port <= entry.get("endPort", first):
                return True
    return False


@pytest.mark.parametrize(
    "sets",
    [["replicaCount=2"], ["replicaCount=3", "ports.peers=9100", "fullnameOverride=picker"]],
    ids=["default", "other-port"],
)
def test_only_the_epp_pods_reach_the_peers_port_and_every_other_port_stays_open(render_chart, sets):
    rendered = render_chart(set=sets)
    policy = rendered.one("NetworkPolicy")
    deployment = rendered.one("Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress untouched
    ports = {p["name"]: p["containerPort"] for p in epp_container(rendered.objects)["ports"]}
    peers = ports.pop("peers")
    assert not allowed(policy, peers, "peers", from_epp=False)
    assert allowed(policy, peers, "peers", from_epp=True)
    for name, port in ports.items():  # grpc, grpc-health, metrics: by name and by range
        assert allowed(policy, port, name, from_epp=False), name
        assert allowed(policy, port, "", from_epp=False), name
    for port in (1, 15006, 15090, peers - 1, peers + 1, 65535):  # a mesh's sidecar ports...
        assert allowed(policy, port, "", from_epp=False), port
    assert allowed(policy, 53, "", from_epp=False, protocol="UDP")
    assert validate_objects(rendered.objects, KUBE_VERSION) == []


def test_the_network_policy_is_optional_and_absent_with_one_replica(render_chart):
    assert render_chart().of_kind("NetworkPolicy") == []
    assert render_chart(set=["replicas.networkPolicy.enabled=true"]).of_kind("NetworkPolicy") == []
    off = render_chart(set=["replicaCount=2", "replicas.networkPolicy.enabled=false"])
    assert off.of_kind("NetworkPolicy") == []
    assert "NetworkPolicy" not in off.notes
    assert "only the EPP pods reach port 9010" in render_chart(set=["replicaCount=2"]).notes


def test_an_existing_secret_is_mounted_and_named_in_the_config(render_chart):
    rendered = render_chart(
        set=[
            "replicaCount=2",
            "replicas.secret.existingSecret=fleet-peers",
            "replicas.secret.key=token",
        ]
    )
    check_secret_wiring(rendered, "fleet-peers", "token")
    assert rendered.of_kind("Secret") == []  # the chart creates none
    assert "Secret fleet-peers (key token)" in rendered.notes
    assert "unauthenticated" not in rendered.notes


def test_a_value_becomes_a_secret_of_the_release(render_chart):
    rendered = render_chart(VALUES_ALL)
    fullname = rendered.one("Deployment")["metadata"]["name"]
    secret = rendered.one("Secret", f"{fullname}-peers-secret")
    assert base64.b64decode(secret["data"]["secret"]).decode() == SECRET_VALUE
    check_secret_wiring(rendered, f"{fullname}-peers-secret", "secret")
    for config_map in rendered.of_kind("ConfigMap"):
        assert SECRET_VALUE not in json.dumps(config_map)  # only in the Secret


def test_changing_the_secret_does_not_roll_the_pods(render_chart):
    """The EPP re-reads the file (and accepts the previous secret meanwhile); a roll would
    start new pods knowing only the new one while the others still hold the old."""
    first, second = (
        render_chart(set=["replicaCount=2", f"replicas.secret.value={value}"]).one("Deployment")
        for value in (SECRET_VALUE, "another-secret-of-32-characters!")
    )
    assert first == second


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["replicas.secret.existingSecret=x", f"replicas.secret.value={SECRET_VALUE}"], "not both"),
        (["replicas.secret.value=short-secret"], "at least 16 characters"),
        (["replicas.secret.value=  fifteen-chars  "], "at least 16 characters"),
        (["replicas.secret.existingSecret=x", "replicas.secret.key="], "key is required"),
    ],
    ids=["both", "short", "short-once-trimmed", "no-key"],
)
def test_unusable_secret_values_fail_rendering(render_chart, sets, message):
    with pytest.raises(RenderError, match=message):
        render_chart(set=sets)


def test_the_values_schema_checks_the_secret_values():
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())

    def with_secret(**secret) -> dict:
        return {**defaults, "replicas": {"secret": {**defaults["replicas"]["secret"], **secret}}}

    jsonschema.validate(defaults, schema)
    jsonschema.validate(with_secret(value=SECRET_VALUE), schema)
    jsonschema.validate(with_secret(existingSecret="fleet-peers", key="token"), schema)
    jsonschema.validate(with_secret(generate=False), schema)
    off = {**defaults, "replicas": {**defaults["replicas"], "networkPolicy": {"enabled": False}}}
    jsonschema.validate(off, schema)
    for bad in (
        with_secret(value="short"),
        with_secret(key="a/b"),
        with_secret(existing_secret="typo"),
        with_secret(generate="yes"),
        {**defaults, "replicas": {**defaults["replicas"], "networkPolicy": {"enable": True}}},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
