"""tools/vllm_check: the comparison logic on the recorded captures, and (opt-in) a live run.

The recorded captures in docs/benchmarks/sim-vs-vllm/ come from a real vLLM 0.32 (CPU) and
`epp sim`; the tests below need neither. The live test starts a real vLLM: it needs
`.bench/vllm-venv` (tools/vllm_check/setup_venv.sh, which CI does not run) and
EPP_VLLM_CHECK=1, because it takes about two minutes and 2-3 GB of memory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools" / "vllm_check"
CAPTURES = ROOT / "docs" / "benchmarks" / "sim-vs-vllm"
FIXTURE = ROOT / "tests" / "fixtures" / "vllm-kv-events.md"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"vllm_check_{name}", TOOLS / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building
    spec.loader.exec_module(module)
    return module


sys.path.insert(0, str(TOOLS))
import sim_vs_vllm as compare  # noqa: E402  (tools/vllm_check is not installed)

capture = _load("capture")


@pytest.fixture(scope="module")
def recorded() -> tuple[dict, dict]:
    # The captures are committed: their absence is a defect, not a reason to skip.
    for name in ("vllm.json", "sim.json"):
        assert (CAPTURES / name).exists(), f"missing recorded capture {CAPTURES / name}"
    return compare.load(CAPTURES)


# -- the recorded real-vLLM capture: what the rules say vLLM does -------------------------


def test_recorded_captures_stay_small() -> None:
    total = sum(p.stat().st_size for p in CAPTURES.glob("*.json"))
    assert total < 500_000


def test_real_vllm_obeys_the_accounting_rules(recorded: tuple[dict, dict]) -> None:
    vllm, _ = recorded
    assert compare.accounting_violations(vllm) == []
    bs = compare.block_size(vllm)
    rows = {r["name"]: r for r in compare.accounting_rows(vllm)}
    # Exactly whole blocks, sent twice: the last block is recomputed, never a hit.
    assert rows["ids_64_repeat"]["cached_tokens"] == rows["ids_64_repeat"]["prompt_tokens"] - bs
    assert rows["ids_repeat"]["cached_tokens"] == (100 - 1) // bs * bs
    assert rows["text_salted"]["cached_tokens"] == 0
    assert rows["ids_after_reset"]["cached_tokens"] == 0


def test_real_vllm_event_stream(recorded: tuple[dict, dict]) -> None:
    vllm, _ = recorded
    summary = compare.stream_summary(vllm)
    assert summary["first_seq"] == 0 and summary["contiguous"]
    assert summary["parents"]["unknown"] == 0
    assert summary["unknown_removals"] == []
    assert summary["replay_end_marker"] and summary["replay_seqs_match"]
    assert summary["max_removed_per_event"] == 1
    assert set(summary["types"]) == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    # vLLM re-announces a recomputed block under a hash it already holds.
    assert summary["duplicate_stores"]
    # ... and caches full blocks holding generated tokens.
    assert any(o["holds_output"] for o in compare.block_origins(vllm))
    # The event tokens of a chat are /tokenize's rendering of it (template included).
    assert compare.chat_tokens_match_tokenize(vllm) is True


def test_findings_and_report_render(recorded: tuple[dict, dict]) -> None:
    vllm, sim = recorded
    found = compare.findings(vllm, sim)
    assert {f.verdict for f in found} <= {"match", "differs", "note"}
    topics = [f.topic for f in found]
    assert len(topics) == len(set(topics)) >= 10
    text = compare.render(vllm, sim)
    for topic in topics:
        assert topic in text
    assert "| `ids_64_repeat` |" in text


# -- pure functions on small inputs -------------------------------------------------------


def _cap(steps: list[dict], messages: list[dict], bs: int = 16) -> dict:
    return {"meta": {"block_size": bs}, "steps": steps, "kv_events": {"messages": messages}}


def _stored(hashes: list[str], parent: str | None, tokens: int) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": list(range(tokens)),
        "extra_keys": [None] * len(hashes),
    }


def test_stream_summary_counts_copies_of_a_hash() -> None:
    msgs = [
        {"seq": 0, "events": [_stored(["a", "b"], None, 32)]},
        {"seq": 1, "events": [_stored(["b"], "a", 16)]},
        {"seq": 2, "events": [{"type": "BlockRemoved", "block_hashes": ["b"]}]},
        {"seq": 3, "events": [{"type": "BlockRemoved", "block_hashes": ["b"]}]},
        {"seq": 5, "events": [{"type": "BlockRemoved", "block_hashes": ["b"]}]},
    ]
    summary = compare.stream_summary(_cap([], msgs))
    assert summary["duplicate_stores"] == ["b"]
    assert summary["unknown_removals"] == ["b"]  # the third removal: no copy left
    assert summary["parents"] == {"root": 1, "known": 1, "unknown": 0}
    assert not summary["contiguous"]  # seq 4 is missing
    assert summary["cached_after"] == 1


def test_accounting_violations_catch_each_rule() -> None:
    def rec(name: str, prompt: int, cached: int, queries: float, hits: float) -> dict:
        return {
            "name": name,
            "note": "",
            "kind": "completion",
            "status": 200,
            "usage": {"prompt_tokens": prompt, "cached_tokens": cached},
            "counter_deltas": {
                "vllm:prefix_cache_queries_total{engine=0,model_name=m}": queries,
                "vllm:prefix_cache_hits_total{engine=0,model_name=m}": hits,
            },
        }

    cap = _cap(
        [
            rec("ok", 100, 96, 100, 96),
            rec("partial_block", 100, 90, 100, 90),
            rec("last_token", 64, 64, 64, 64),
            rec("bad_counters", 100, 96, 99, 95),
        ],
        [],
    )
    problems = compare.accounting_violations(cap)
    assert not any(p.startswith("ok:") for p in problems)
    assert any(p.startswith("partial_block:") and "multiple" in p for p in problems)
    assert any(p.startswith("last_token:") and "last prompt token" in p for p in problems)
    assert sum(p.startswith("bad_counters:") for p in problems) == 2


def test_block_origins_find_output_blocks() -> None:
    prompt = list(range(100, 140))  # 40 tokens
    output = list(range(500, 540))
    steps = [
        {
            "name": "gen",
            "request": {"prompt_ids": prompt},
            "output_token_ids": output,
            "event_messages": [0, 1],
        }
    ]
    full = prompt + output
    ev = [
        {**_stored(["x"], None, 16), "token_ids": full[:16]},
        {**_stored(["y", "z"], "x", 32), "token_ids": full[16:48]},
        {**_stored(["q"], None, 16), "token_ids": [7] * 16},
    ]
    origins = compare.block_origins(_cap(steps, [{"seq": 0, "events": ev}]))
    assert [(o["first_block"], o["holds_output"], o["matched"]) for o in origins] == [
        (0, False, True),
        (1, True, True),
        (None, False, False),
    ]


def test_metrics_diff_ignores_created_gauges() -> None:
    page_a = "\n".join(
        [
            "# TYPE vllm:prefix_cache_hits_total counter",
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 3.0',
            "# TYPE vllm:prefix_cache_hits_created gauge",
            'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e+09',
            "# TYPE vllm:ttft histogram",
            'vllm:ttft_bucket{engine="0",le="0.1",model_name="m"} 1.0',
            'vllm:ttft_count{engine="0",model_name="m"} 1.0',
            "# TYPE process_open_fds gauge",
            "process_open_fds 12.0",
        ]
    )
    page_b = "\n".join(
        line.replace('{engine="0",', "{") if line.startswith("vllm:ttft") else line
        for line in page_a.replace("process_open_fds", "x_other").splitlines()
    )
    fam_a, samples = capture.parse_metrics(page_a)
    fam_b, _ = capture.parse_metrics(page_b)
    assert fam_a["vllm:ttft"] == {
        "type": "histogram",
        "labels": ["engine", "model_name"],
        "suffixes": ["_bucket", "_count"],
    }
    assert samples["vllm:prefix_cache_hits_total{engine=0,model_name=m}"] == 3.0
    diff = compare.metrics_diff(fam_a, fam_b)
    assert diff["only_vllm"] == ["process_open_fds"]
    assert diff["only_sim"] == ["x_other"]
    assert diff["label_diff"] == [("vllm:ttft", ["engine"], [])]
    assert "vllm:prefix_cache_hits_created" not in diff["both"]


def test_counter_deltas_keep_only_moving_totals() -> None:
    before = {"a_total{}": 1.0, "b_total{}": 2.0, "g{}": 5.0}
    after = {"a_total{}": 4.0, "b_total{}": 2.0, "g{}": 7.0, "c_total{}": 1.0}
    assert capture.counter_deltas(before, after) == {"a_total{}": 3.0, "c_total{}": 1.0}


@pytest.mark.parametrize("layout", ["Map events", "Positional events"])
def test_decode_payload_reads_both_event_layouts(layout: str) -> None:
    text = FIXTURE.read_text()
    hexes = re.findall(r"^    ([0-9a-f]{40,})$", text, flags=re.M)
    payload = bytes.fromhex(hexes[0 if layout == "Map events" else 1])
    batch = capture.decode_payload(payload)
    assert batch["ts"] == 1757500000.25 and batch["dp_rank"] == 0
    stored, removed, cleared = batch["events"]
    assert stored["type"] == "BlockStored"
    assert stored["block_hashes"] == ["deadbeef12345678"]
    assert stored["parent_block_hash"] is None
    assert stored["token_ids"] == list(range(16))
    assert stored["medium"] == "GPU"
    assert removed["block_hashes"] == ["0000000000000007"]
    assert cleared["type"] == "AllBlocksCleared"


def test_workload_is_seeded_and_stable() -> None:
    a = capture.build_workload("m", 900)
    b = capture.build_workload("m", 900)
    assert [s.body for s in a] == [s.body for s in b]
    names = [s.name for s in a]
    assert len(names) == len(set(names))
    assert a[0].body["prompt"] == a[1].body["prompt"]  # ids_repeat repeats ids_cold


# -- live (opt-in) -------------------------------------------------------------------------

VLLM_VENV = ROOT / ".bench" / "vllm-venv"


@pytest.mark.e2e
@pytest.mark.skipif(
    not VLLM_VENV.exists(),
    reason=f"{VLLM_VENV} does not exist: run tools/vllm_check/setup_venv.sh (CI does not)",
)
@pytest.mark.skipif(
    os.environ.get("EPP_VLLM_CHECK") != "1",
    reason="starts a real vLLM (~2 min, 2-3 GB): set EPP_VLLM_CHECK=1 to run it",
)
def test_live_vllm_and_sim(tmp_path: Path) -> None:
    model = ROOT / ".bench" / "tiny-llama"
    if not (model / "config.json").exists():
        subprocess.run(
            [str(VLLM_VENV / "bin" / "python"), str(TOOLS / "build_model.py"), "--out", str(model)],
            check=True,
            timeout=300,
        )
    subprocess.run(
        [sys.executable, str(TOOLS / "run_check.py"), "--target", "both", "--out", str(tmp_path)],
        check=True,
        timeout=900,
    )
    vllm, sim = compare.load(tmp_path)
    assert compare.accounting_violations(vllm) == []
    assert compare.stream_summary(vllm)["contiguous"]
    assert json.loads(json.dumps(compare.render(vllm, sim)))
