"""The fault suite's contracts through the real stack (real Envoy, `epp serve`, simulated
pods), under a steady client load: the scenarios of `epp bench faults`
(src/epp_bench/picker/faults.py), each asserting what the README promises for its fault.

Bounds are contracts, not performance figures: generous enough for a loaded 2-core
machine (the measured figures are in docs/benchmarks/faults.md). Every wait inside a
scenario is on a positive signal (the EPP's per-pod decision counters, its scrape-failure
gauges, a process exit, the client's answers), bounded.

The scenarios share one stack per mode (approximate, precise), in order; each repairs its
fault and waits for the pod to be routed to again before the next one starts."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from epp_bench.picker import faults
from epp_bench.picker.faults import Bench, Result, Settings

pytestmark = pytest.mark.e2e
SETTINGS = Settings(rate=12.0, quiet_s=2.0, fault_max_s=15.0, return_max_s=25.0)


@pytest.fixture(scope="module")
def approximate(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    with faults.bench(False, SETTINGS, tmp_path_factory.mktemp("approximate")) as b:
        yield b


@pytest.fixture(scope="module")
def precise(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    with faults.bench(True, SETTINGS, tmp_path_factory.mktemp("precise")) as b:
        yield b


def failed_only(result: Result, statuses: set[str]) -> bool:
    return set(result.failed) <= statuses


def test_a_crashed_pod_is_left_at_once_and_rejoins_once_it_answers(approximate: Bench):
    r = faults.crash(approximate)
    print(faults.format_row(r))
    # Its scrapes fail while the others answer: out after 3 failures (150 ms).
    assert r.moved_away and r.moved_away_s is not None and r.moved_away_s < 5.0
    # Back at its first good scrape.
    assert r.returned and r.returned_s is not None and r.returned_s < 10.0
    # A refused connection moves on to the next pod (retry on connect-failure); only a
    # request being served at the SIGKILL can be lost.
    assert r.failed_total <= 1, r.failed


def test_a_hung_pod_is_left_and_rejoins(approximate: Bench):
    scenario = faults.SCENARIOS["hang"][1]
    r = scenario(approximate)
    print(faults.format_row(r))
    # What the EPP routed there and does not see complete counts as the pod's load.
    assert r.moved_away and r.moved_away_s is not None and r.moved_away_s < 10.0
    # Its hung requests end at the client's timeout (5 s); then it is idle again.
    assert r.returned and r.returned_s is not None and r.returned_s < 20.0
    # Only the requests routed there before the EPP moved away fail (no answer within the
    # client's timeout: Envoy's per-try idle timeout is 120 s).
    assert failed_only(r, {"0"}) and r.failed_total <= 6, r.failed


def test_a_5xx_spell_excludes_the_pod_and_it_comes_back(approximate: Bench):
    scenario = faults.SCENARIOS["5xx"][1]
    r = scenario(approximate)
    print(faults.format_row(r))
    assert r.moved_away and r.moved_away_s is not None and r.moved_away_s < 5.0
    # The error rate decays (datalayer.error_decay_s): retried within about 7 s.
    assert r.returned and r.returned_s is not None and r.returned_s < 20.0
    # The pod's own 500s before it was excluded; nothing else fails.
    assert failed_only(r, {"500"}) and r.failed_total <= 12, r.failed


def test_frozen_metrics_cost_no_request(approximate: Bench):
    r = faults.frozen(approximate)
    print(faults.format_row(r))
    assert r.failed_total == 0, r.failed
    assert r.extra["routed_to_faulty"] > 0  # it serves, so it keeps getting requests


def test_a_metrics_partition_excludes_nobody_and_fails_nothing(approximate: Bench):
    r = faults.partition(approximate)
    print(faults.format_row(r))
    # README "A partition between the EPP and the pods is not an outage".
    assert r.failed_total == 0, r.failed
    # Nobody excluded; the pods whose first failed scrape was charged at the onset (health
    # 0.75) may get less traffic until it heals (docs/reliability.md "Health exclusion").
    assert r.extra["excluded_after"] == 0
    assert r.extra["pods_routed_after"] >= 1


def test_an_epp_drain_answers_every_request_until_it_exits(approximate: Bench):
    r = faults.epp_drain(approximate)
    print(faults.format_row(r))
    assert r.extra["exit_code"] == 0
    # README "SIGTERM drains": new and open streams answered until the stop.
    assert r.extra["drain_sent"] > 0 and r.extra["drain_failed"] == 0
    assert r.returned and r.returned_s is not None and r.returned_s < 10.0


def test_an_epp_killed_and_restarted_routes_again(approximate: Bench):
    r = faults.epp_kill(approximate)
    print(faults.format_row(r))
    # With the EPP down Envoy answers 500 at once (FULL_DUPLEX_STREAMED, fail-closed).
    assert failed_only(r, {"500", "0"}), r.failed
    assert r.returned and r.returned_s is not None and r.returned_s < 10.0


def test_lost_kv_events_are_replayed_and_the_index_agrees_with_the_engine(precise: Bench):
    r = faults.SCENARIOS["kv-loss"][1](precise)
    print(faults.format_row(r))
    assert r.extra.get("gaps", 0) >= 1  # the loss was seen ...
    assert r.divergence == 0, (r.missing, r.phantom)  # ... and repaired from the replay
    assert r.failed_total == 0, r.failed


@pytest.mark.parametrize("scenario", ["kv-duplicates", "kv-reorder"])
def test_duplicated_or_reordered_kv_events_are_copies_not_restarts(precise: Bench, scenario):
    r = faults.SCENARIOS[scenario][1](precise)
    print(faults.format_row(r))
    assert r.divergence == 0, (r.missing, r.phantom)
    # A batch seen twice (sent twice, or late after a replay filled its gap) is ignored:
    # taken for a publisher restart, each copy dropped the pod's entries and replayed
    # the whole buffer.
    assert r.extra.get("restarts", 0) == 0 and r.extra.get("resyncs", 0) == 0, r.extra
    assert r.failed_total == 0, r.failed


def test_a_publisher_restart_is_detected_and_the_index_claims_nothing_the_engine_lacks(
    precise: Bench,
):
    r = faults.SCENARIOS["kv-restart"][1](precise)
    print(faults.format_row(r))
    # Seen: as a reconnect (the sockets closed) or as the sequence going back.
    assert r.extra.get("resyncs", 0) + r.extra.get("restarts", 0) >= 1, r.extra
    # Blocks from before the restart may stay unknown (the new buffer is empty: README
    # "Precise mode"), but the index never holds a block the engine does not.
    assert r.phantom == 0
    assert r.failed_total == 0, r.failed
