"""EPP replicas find each other through a headless Service: with replicaCount > 1 the
chart's Service lists every EPP pod (ready or not) on the peers port (9010), and the
EPP's configuration names it as its peers and listens on that port. One replica (the
chart's default, and deploy/kubernetes/) has no peers port and no peers configuration.
No RBAC: DNS needs none (tests/deploy/test_rbac.py keeps the grants to the watched
resources).

With `replicas.secret` the replicas share a secret (an existing Secret or one the chart
creates), mounted as a directory and named in `replicas.secret_file`; without it the
peers port is unauthenticated, and the notes say so."""

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


def test_without_a_secret_the_peers_port_is_unauthenticated_and_the_notes_say_so(render_chart):
    rendered = render_chart(set=["replicaCount=2"])
    _, volume, mount, secret_file = peers_secret(rendered)
    assert (volume, mount, secret_file) == (None, None, None)
    assert rendered.of_kind("Secret") == []
    assert "the peers port 9010 is unauthenticated" in rendered.notes
    assert "unauthenticated" not in render_chart().notes  # one replica: no peers port


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
    for bad in (
        with_secret(value="short"),
        with_secret(key="a/b"),
        with_secret(existing_secret="typo"),
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
