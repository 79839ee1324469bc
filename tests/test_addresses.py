"""epp.addresses: the one `host:port` parser, and the callers that use it (config, replicas,
Envoy config, KV-event endpoints, InferencePool endpoints) reading addresses alike."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from epp.addresses import (
    AddressError,
    HostPort,
    format_host_port,
    is_ip_address,
    parse_host_port,
    split_host_port,
    unbracket,
    url_host,
)

GOOD = [
    ("10.0.0.7:8000", "10.0.0.7", 8000),
    ("127.0.0.1:1", "127.0.0.1", 1),
    ("127.0.0.1:65535", "127.0.0.1", 65535),
    ("epp-peers.ns.svc:9010", "epp-peers.ns.svc", 9010),
    ("epp-peers.ns.svc.cluster.local.:9010", "epp-peers.ns.svc.cluster.local.", 9010),
    ("localhost:80", "localhost", 80),
    ("pod_a:80", "pod_a", 80),
    ("[::1]:9010", "::1", 9010),
    ("[fd00::1]:8000", "fd00::1", 8000),
    ("[FD00:0:0:0:0:0:0:1]:8000", "FD00:0:0:0:0:0:0:1", 8000),
    ("[fe80::1%eth0]:8000", "fe80::1%eth0", 8000),
    ("[::ffff:10.0.0.1]:8000", "::ffff:10.0.0.1", 8000),
    ("host:08000", "host", 8000),
]

# (input, a fragment of the one-line error)
BAD = [
    ("", "empty address"),
    (":9010", "empty host"),
    ("host:", "empty port"),
    ("host:port", "not a number"),
    ("host:-1", "not a number"),
    ("host:+80", "not a number"),
    ("host:٨٠", "not a number"),  # Arabic-Indic digits: str.isdigit() says yes
    ("host:0", "out of range"),
    ("host:65536", "out of range"),
    ("host:99999999999999999999", "out of range"),
    ("no-port", "has no port"),
    ("[::1]", "has no port"),
    ("fd00::1:8000", "[fd00::1:8000]:8000"),  # unbracketed IPv6: no port to tell
    ("fd00::zz:8000", "in brackets"),
    ("[::1]8000", "after ']'"),
    ("[::1:8000", "without ']'"),
    ("[]:8000", "not an IPv6 address"),
    ("[10.0.0.1]:8000", "not an IPv6 address"),
    ("[my-host]:8000", "not an IPv6 address"),
    (" 10.0.0.1:80", "whitespace"),
    ("10.0.0.1:80\n", "whitespace"),
    ("my host:80", "whitespace"),
    ("http://10.0.0.1:80", "in brackets"),
    ("user@host:80", "bad host"),
    ("host/path:80", "bad host"),
]


@pytest.mark.parametrize(("text", "host", "port"), GOOD)
def test_good_addresses_parse_and_format_back(text: str, host: str, port: int) -> None:
    parsed = parse_host_port(text)
    assert parsed == HostPort(host, port)
    assert parse_host_port(str(parsed)) == parsed  # format is the inverse
    assert str(parsed) == format_host_port(host, port)


@pytest.mark.parametrize(("text", "fragment"), BAD)
def test_bad_addresses_fail_with_one_line_that_names_them(text: str, fragment: str) -> None:
    with pytest.raises(AddressError) as err:
        parse_host_port(text)
    message = str(err.value)
    assert fragment in message
    assert "\n" not in message
    assert repr(text) in message or text == ""


@pytest.mark.parametrize(
    ("text", "default", "expected"),
    [
        ("pod-a", 5557, HostPort("pod-a", 5557)),
        ("10.0.0.1", 5557, HostPort("10.0.0.1", 5557)),
        ("fd00::1", 5557, HostPort("fd00::1", 5557)),
        ("[fd00::1]", 5557, HostPort("fd00::1", 5557)),
        ("fd00::1:8000", 5557, HostPort("fd00::1:8000", 5557)),  # all of it is the host
        ("pod-a:8000", 5557, HostPort("pod-a", 8000)),  # a given port wins
        ("[fd00::1]:8000", 5557, HostPort("fd00::1", 8000)),
    ],
)
def test_a_default_port_stands_for_a_missing_one(
    text: str, default: int, expected: HostPort
) -> None:
    assert parse_host_port(text, default_port=default) == expected


def test_split_keeps_the_port_optional() -> None:
    assert split_host_port("10.1.2.3:8000") == ("10.1.2.3", 8000)
    assert split_host_port("[fd00::1]:8000") == ("fd00::1", 8000)
    assert split_host_port("[fd00::1]") == ("fd00::1", None)
    assert split_host_port("fd00::1") == ("fd00::1", None)
    assert split_host_port("pod-a") == ("pod-a", None)
    with pytest.raises(AddressError, match="out of range"):
        split_host_port("pod-a:0")


def test_formatting_brackets_ipv6_only() -> None:
    assert format_host_port("10.0.0.1", 80) == "10.0.0.1:80"
    assert format_host_port("pod-a", 80) == "pod-a:80"
    assert format_host_port("fd00::1", 80) == "[fd00::1]:80"
    assert format_host_port("[fd00::1]", 80) == "[fd00::1]:80"  # never bracketed twice
    assert url_host("fd00::1") == "[fd00::1]" and url_host("10.0.0.1") == "10.0.0.1"
    assert f"tcp://{url_host('fd00::1')}:5557" == "tcp://[fd00::1]:5557"
    assert unbracket("[::1]") == "::1" and unbracket("::1") == "::1" and unbracket("a") == "a"
    assert is_ip_address("10.0.0.1") and is_ip_address("::1") and is_ip_address("[::1]")
    assert not is_ip_address("epp-peers.ns.svc") and not is_ip_address("")


# -- the callers read addresses through the parser --------------------------------------


def test_the_config_refuses_what_the_parser_refuses() -> None:
    from epp.config import EndpointConfig, ReplicasConfig

    for text, _, _ in GOOD:
        assert EndpointConfig(name="a", address=text).address == text
        assert ReplicasConfig(peers=[text]).peers == [text]
    for text, fragment in BAD:
        with pytest.raises(ValidationError, match="address must be host:port") as err:
            EndpointConfig(name="a", address=text)
        assert fragment in str(err.value)
        with pytest.raises(ValidationError, match="a peer must be host:port"):
            ReplicasConfig(peers=[text])


def test_envoy_endpoints_are_unbracketed_and_a_name_makes_the_replicas_strict_dns() -> None:
    import yaml

    from epp.envoy_config import render

    config = yaml.safe_load(
        render(
            mode="epp",
            listen_port=1,
            admin_port=2,
            pods=["[fd00::1]:8000", "10.0.0.2:8000"],
            epp_addresses=["[::1]:9002", "10.0.0.1:9002"],
        )
    )
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}

    def sockets(name: str) -> list[tuple[str, int]]:
        (group,) = clusters[name]["load_assignment"]["endpoints"]
        found = [e["endpoint"]["address"]["socket_address"] for e in group["lb_endpoints"]]
        return [(s["address"], s["port_value"]) for s in found]

    assert sockets("pods") == [("fd00::1", 8000), ("10.0.0.2", 8000)]
    assert sockets("epp") == [("::1", 9002), ("10.0.0.1", 9002)]
    assert clusters["epp"]["type"] == "STATIC"
    named = yaml.safe_load(
        render(
            mode="epp",
            listen_port=1,
            admin_port=2,
            pods=["10.0.0.2:8000"],
            epp_addresses=["epp.ns.svc:9002", "10.0.0.1:9002"],
        )
    )
    (epp,) = [c for c in named["static_resources"]["clusters"] if c["name"] == "epp"]
    assert epp["type"] == "STRICT_DNS"
    single = yaml.safe_load(
        render(mode="epp", listen_port=1, admin_port=2, epp_port=3, pods=["10.0.0.2:8000"])
    )
    (epp,) = [c for c in single["static_resources"]["clusters"] if c["name"] == "epp"]
    (group,) = epp["load_assignment"]["endpoints"]
    assert group["lb_endpoints"][0]["endpoint"]["address"]["socket_address"] == {
        "address": "127.0.0.1",
        "port_value": 3,
    }
    ipv6_epp = yaml.safe_load(
        render(
            mode="epp",
            listen_port=1,
            admin_port=2,
            epp_port=3,
            epp_host="::1",
            pods=["10.0.0.2:8000"],
        )
    )
    (epp,) = [c for c in ipv6_epp["static_resources"]["clusters"] if c["name"] == "epp"]
    (group,) = epp["load_assignment"]["endpoints"]
    assert group["lb_endpoints"][0]["endpoint"]["address"]["socket_address"]["address"] == "::1"


@pytest.mark.parametrize("mode", ["epp", "round_robin"])
def test_the_real_envoy_accepts_ipv6_pods_and_replicas(mode: str, tmp_path) -> None:
    """Envoy's socket_address takes an IPv6 host without brackets ("malformed IP address:
    [::1]" otherwise): checked by the real binary, not by our reading of its schema."""
    import subprocess

    from test_envoy_config import envoy

    from epp.envoy_config import render

    path = tmp_path / "envoy.yaml"
    replicas = ["[::1]:9002", "10.0.0.1:9002"] if mode == "epp" else []
    path.write_text(
        render(
            mode=mode,  # type: ignore[arg-type]
            listen_port=1,
            admin_port=2,
            pods=["[::1]:8000", "10.0.0.2:8000"],
            epp_addresses=replicas,
        )
    )
    check = subprocess.run(
        [envoy(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_envoy_config_flags_refuse_a_bad_address_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from epp.envoy_config import main

    with pytest.raises(SystemExit) as exit_:
        main(["--mode", "round_robin", "--pod", "fd00::1:8000"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--pod" in err and "[fd00::1:8000]:8000" in err
    with pytest.raises(SystemExit):
        main(["--epp-address", "host:65536", "--pod", "10.0.0.1:80"])
    assert "out of range" in capsys.readouterr().err


def test_kv_event_endpoints_bracket_an_ipv6_host() -> None:
    from epp.datalayer.kv_subscriber import format_endpoint, topic_prefix

    assert format_endpoint("tcp://{host}:{port}", "[fd00::1]:8000", None, "p") == (
        "tcp://[fd00::1]:8000"
    )
    assert format_endpoint("tcp://[{host}]:5557", "[fd00::1]:8000", None, "p") == (
        "tcp://[fd00::1]:5557"
    )
    assert topic_prefix("kv@{host}:{port}", "10.0.0.1:8000", None, "p") == "kv@10.0.0.1:8000"
    assert topic_prefix("kv@{host}", "[fd00::1]:8000", None, "p") == "kv@fd00::1"


def test_pool_endpoints_bracket_ipv6_and_skip_a_pod_ip_that_is_no_ip() -> None:
    from epp.datalayer.discovery.pool import MetricsLocation, endpoints_for_pool, standalone_pool

    def pod(name: str, ip: str) -> dict[str, object]:
        return {
            "metadata": {"name": name, "labels": {"app": "vllm"}},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
        }

    pool = standalone_pool("p", "app=vllm", [8000])
    pods = [pod("a", "fd00::1"), pod("b", "10.0.0.2"), pod("c", "not an ip"), pod("d", "x")]
    endpoints = endpoints_for_pool(pool, pods, MetricsLocation(port=9090))
    assert [(e.name, e.address, e.metrics_url) for e in endpoints] == [
        ("a", "[fd00::1]:8000", "http://[fd00::1]:9090/metrics"),
        ("b", "10.0.0.2:8000", "http://10.0.0.2:9090/metrics"),
    ]


def test_peer_specs_are_parsed_hosts_and_ports() -> None:
    from prometheus_client import CollectorRegistry

    from epp.observability.replica_metrics import ReplicaMetrics
    from epp.replicas.peers import PeerSet
    from epp.replicas.protocol import Hello

    hello = Hello(replica="r", version=1, block_size=16)
    metrics = ReplicaMetrics(CollectorRegistry())
    specs = ["epp-peers.ns.svc:9010", "[::1]:9010", "10.0.0.7:9010"]
    peers = PeerSet(specs, hello, metrics)
    assert peers.specs == [("epp-peers.ns.svc", 9010), ("::1", 9010), ("10.0.0.7", 9010)]
    with pytest.raises(AddressError, match="in brackets"):
        PeerSet(["fd00::zz:9010"], hello, metrics)


def test_the_port_label_of_an_address() -> None:
    from epp.observability.upstream import port_label

    assert port_label("10.0.0.1:8000") == "8000"
    assert port_label("[fd00::1]:8001") == "8001"
    assert port_label("no-port") == ""
