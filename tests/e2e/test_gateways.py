"""What each gateway setting needs from the EPP, through a real Envoy, the real `epp serve`
and simulated pods: ORIGINAL_DST (the GIE guides' config), override_host with fallbacks,
hung pods, and body modes the EPP does not support."""

from __future__ import annotations

import json
import signal
import time

import pytest
import yaml
from e2e.harness import chat_body, http, rig, wait_for

from epp.envoy_config import render
from epp_harness.stack import free_ports

pytestmark = pytest.mark.e2e
HANG = ["--failure-rate", "1", "--failure-kinds", "hang"]


def envoy_for(r, **kwargs) -> tuple[str, int]:
    listen, admin = free_ports(2)
    config = render(
        mode="epp", listen_port=listen, admin_port=admin, epp_port=r.epp_grpc_port,
        pods=r.pods, **kwargs,
    )  # fmt: skip
    return config, listen


def test_gie_original_dst_config_with_default_epp_settings_serves_every_request(tmp_path):
    """`epp envoy-config --pod-cluster original_dst`: one address per request. With the
    old default of 3 fallbacks every request got 503 (the cluster cannot read a list)."""
    with rig(tmp_path) as r:
        r.start_pods(3)
        r.start_epp()  # default settings
        r.start_envoy(*envoy_for(r, pod_cluster="original_dst"))
        statuses = [
            http(f"{r.envoy_url}/v1/chat/completions", chat_body(f"topic {i % 10}"))[0]
            for i in range(40)
        ]
        assert statuses == [200] * 40


def test_original_dst_with_a_fallback_list_is_503_which_is_why_the_default_is_0(tmp_path):
    with rig(tmp_path) as r:
        r.start_pods(2)
        r.start_epp({"scheduling": {"fallbacks": 1}})
        r.start_envoy(*envoy_for(r, pod_cluster="original_dst"))
        status, _, body = http(f"{r.envoy_url}/v1/chat/completions", chat_body("lists"))
        assert status == 503, body


def with_access_log(config: str, path) -> str:
    """The rendered config plus a JSON access log of what Envoy received from the EPP (the
    destination list, header and envoy.lb metadata) and the host that answered."""
    tree = yaml.safe_load(config)
    hcm = tree["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    hcm["typed_config"]["access_log"] = [
        {
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": str(path),
                "log_format": {
                    "json_format": {
                        "header": "%REQ(x-gateway-destination-endpoint)%",
                        "metadata": "%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)%",
                        "upstream": "%UPSTREAM_HOST%",
                        "attempts": "%UPSTREAM_REQUEST_ATTEMPT_COUNT%",
                        "status": "%RESPONSE_CODE%",
                        "path": "%REQ(:PATH)%",
                    }
                },
            },
        }
    ]
    return yaml.safe_dump(tree)


def chat_lines(path) -> list[dict]:
    """The access-log lines of chat requests (Envoy's readiness probes left out)."""
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [line for line in lines if line["path"] == "/v1/chat/completions"]


def access_lines(path, count: int) -> list[dict]:
    """The first `count` chat lines, waiting for Envoy to flush them."""
    wait_for(lambda: len(chat_lines(path)) >= count, what=f"{count} access-log lines")
    return chat_lines(path)[:count]


def test_override_host_walks_the_fallback_list_when_the_primary_is_gone(tmp_path):
    """A crashed primary: Envoy moves on to the next address of the EPP's list. Checked on
    what Envoy received (a list of primary + 2 fallbacks) and on who answered: the first
    fallback of that list, on the second attempt, not a host Envoy's own fallback policy
    chose (which would also answer 200 if the EPP sent the primary alone)."""
    access = tmp_path / "access.jsonl"
    with rig(tmp_path) as r:
        r.start_pods(3)
        r.start_epp({"scheduling": {"fallbacks": 2}})
        config, listen = envoy_for(r)
        r.start_envoy(with_access_log(config, access), listen)
        by_address = {address: f"pod-{i}" for i, address in enumerate(r.pods)}
        body = chat_body("fallbacks")
        _, headers, _ = http(f"{r.envoy_url}/v1/chat/completions", body)
        home = headers["x-sim-pod"]
        next(p for p in r.procs if p.name == home).signal(signal.SIGKILL)
        served = [http(f"{r.envoy_url}/v1/chat/completions", body) for _ in range(3)]
        assert [s for s, _, _ in served] == [200, 200, 200]
        assert home not in {h["x-sim-pod"] for _, h, _ in served}

        lines = access_lines(access, 4)
        walked = 0
        for line, (_, answer, _) in zip(lines[1:], served, strict=True):
            sent = line["metadata"] if line["metadata"] not in (None, "-") else line["header"]
            listed = sent.split(",")
            assert len(listed) == 3, f"the EPP sent {sent!r}, not primary + 2 fallbacks"
            assert len(set(listed)) == 3 and set(listed) == set(r.pods)
            if by_address[listed[0]] != home:
                continue  # the EPP already knew the pod was gone: no fallback to walk
            walked += 1
            assert line["upstream"] == listed[1], (line, listed)
            assert answer["x-sim-pod"] == by_address[listed[1]]
            assert int(line["attempts"]) == 2
        assert walked >= 1, f"no request named the dead {home} first: {lines}"


def test_hung_pod_fails_over_within_the_idle_timeout_and_the_epp_counts_it(tmp_path):
    """The observer filter reports the pod that served (upstream.address), so the EPP's
    epp_fallback_served_total counts the failover. The cost scorer alone makes the hung
    pod the EPP's first choice (cache affinity would otherwise send every request to
    whichever pod served the first, and half the time no request would fail over)."""
    with rig(tmp_path) as r:
        r.start_pods(2, lambda i: HANG if i == 0 else [])
        r.start_epp(
            {"scheduling": {"fallbacks": 1, "weights": {"cost": 1.0}}},
            labels_for=lambda i: {"cost_per_hour": "1" if i == 0 else "10"},
        )
        r.start_envoy(*envoy_for(r, upstream_idle_timeout_s=2.0))
        for i in range(4):
            started = time.monotonic()
            status, headers, _ = http(
                f"{r.envoy_url}/v1/chat/completions", chat_body(f"hang {i}"), timeout=60
            )
            assert status == 200 and headers["x-sim-pod"] == "pod-1"
            assert time.monotonic() - started < 10  # not the 600 s request timeout
        # The observer stream reports the serving pod after the answer: wait for it.
        wait_for(lambda: r.epp_metric("epp_fallback_served_total") >= 1, what="fallback counted")


def test_hung_pod_behind_original_dst_answers_504_within_the_idle_timeout(tmp_path):
    with rig(tmp_path) as r:
        r.start_pods(1, lambda i: HANG)
        r.start_epp()
        r.start_envoy(*envoy_for(r, pod_cluster="original_dst", upstream_idle_timeout_s=2.0))
        started = time.monotonic()
        status, _, _ = http(f"{r.envoy_url}/v1/chat/completions", chat_body("hang"), timeout=60)
        assert status == 504 and time.monotonic() - started < 10


@pytest.mark.parametrize("mode", ["STREAMED", "BUFFERED_PARTIAL"])
def test_unsupported_body_mode_through_envoy_is_a_clear_500(tmp_path, mode):
    """A hand-written config with a body mode the EPP cannot route on: a defined answer
    and an ERROR log naming the setting, not a pass-through to an unchosen pod."""
    with rig(tmp_path) as r:
        r.start_pods(1)
        r.start_epp()
        config, listen = envoy_for(r)
        tree = yaml.safe_load(config)
        hcm = tree["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        ext_proc = hcm["typed_config"]["http_filters"][0]["typed_config"]
        ext_proc["processing_mode"]["request_body_mode"] = mode
        ext_proc["processing_mode"]["request_trailer_mode"] = "SKIP"
        r.start_envoy(yaml.safe_dump(tree), listen)
        status, headers, body = http(f"{r.envoy_url}/v1/chat/completions", chat_body("modes"))
        assert status == 500 and headers["x-request-dropped-reason"] == "unsupported-body-mode"
        assert mode in json.loads(body)["error"]["message"]
        errors = [
            json.loads(line)
            for line in r.epp.log.read_text().splitlines()
            if '"unsupported_body_mode"' in line
        ]
        assert errors and errors[0]["level"] == "error" and errors[0]["mode"] == mode
        assert errors[0]["setting"] == "processing_mode.request_body_mode"
