"""tools/vllm_check: the comparison logic on the recorded captures and on a small synthetic
pair, and (opt-in) a live run.

The recorded captures in docs/benchmarks/sim-vs-vllm/ come from a real vLLM 0.32 (CPU) and
the simulator; the tests below need neither. The synthetic pair (built below, block size 4)
makes the sim differ from vLLM in known places, so that the report's verdicts, tables and
numbers can be asserted one by one. The live test starts a real vLLM: it needs
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
REPORT = ROOT / "docs" / "benchmarks" / "sim-vs-vllm.md"


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


def test_committed_report_is_what_compare_renders(recorded: tuple[dict, dict]) -> None:
    # docs/benchmarks/sim-vs-vllm.md is generated: it must be what the committed captures
    # give today (regenerate with tools/vllm_check/compare.py when this fails).
    vllm, sim = recorded
    assert compare.render(vllm, sim) == REPORT.read_text()
    verdicts = {f.topic: f.verdict for f in compare.findings(vllm, sim)}
    assert verdicts.pop("tokenization and chat template") == "differs"
    assert set(verdicts.values()) == {"match"} and len(verdicts) == 10


# -- the report, rendered from a small synthetic pair of captures --------------------------
#
# Block size 4. The sim differs from vLLM on purpose in some places (marked "sim:"), so
# that every verdict below is forced by a number in the captures.

BS = 4
IDS_A = list(range(10, 20))  # 10 tokens: 2 full blocks
IDS_B = list(range(30, 38))  # 8 tokens: exactly 2 blocks
IDS_C = list(range(50, 56))  # 6 tokens: 1 full block, the 2nd completed by the output
OUT_C = [60, 61, 62, 63]
IDS_D = list(range(70, 82))  # 12 tokens: evicts IDS_A's blocks
CHAT_IDS = list(range(100, 112))  # vLLM's rendering of the chat: 12 tokens

VLLM_PAGE = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 0.0
# TYPE vllm:prefix_cache_hits_created gauge
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e+09
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="4",engine="0",hash_block_size="None",num_gpu_blocks="10"} 1.0
# TYPE process_open_fds gauge
process_open_fds 12.0
"""
SIM_PAGE = """\
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="m"} 0.0
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 0.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="4",engine="0",num_gpu_blocks="12"} 1.0
# TYPE sim_extra_total counter
sim_extra_total{pod="p"} 0.0
"""


class _CaptureBuilder:
    """Steps in workload order; each step's events go out as one batch."""

    def __init__(self, server: str, page: str, layout: str, spec_kind: bool) -> None:
        families, _ = capture.parse_metrics(page)
        self.spec_kind = spec_kind
        self.cap: dict = {
            "meta": {"server": server, "block_size": BS, "num_gpu_blocks": 10},
            "metrics_families": families,
            "metrics_page_first": page,
            "steps": [],
            "kv_events": {"enabled": True, "messages": [], "replay": {"frame_layouts": [layout]}},
        }

    def stored(self, hashes: list[str], parent: str | None, tokens: list[int]) -> dict:
        event = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": BS,
            "medium": "GPU",
            "extra_keys": [None] * len(hashes),
        }
        if self.spec_kind:
            event["kv_cache_spec_kind"] = "full_attention"
        return event

    def add(self, name: str, kind: str = "completion", *, events: tuple = (), **rec) -> None:
        msgs = self.cap["kv_events"]["messages"]
        start = len(msgs)
        if events:
            msgs.append({"seq": start, "topic": "kv@m", "dp_rank": 0, "events": list(events)})
        self.cap["steps"].append(
            {"name": name, "note": rec.pop("note", name), "kind": kind, "status": 200}
            | rec
            | {"event_messages": [start, len(msgs)]}
        )

    def generate(self, name: str, ids: list[int] | None, prompt: int, cached: int, **rec) -> None:
        """A completion (token ids) or chat: usage, and counters (queries=prompt and
        hits=cached unless given)."""
        queries, hits = rec.pop("queries", prompt), rec.pop("hits", cached)
        counters = {
            "vllm:prefix_cache_queries_total{engine=0,model_name=m}": float(queries),
            "vllm:prefix_cache_hits_total{engine=0,model_name=m}": float(hits),
        }
        request = {"prompt_ids": ids} if ids else {"messages": [{"role": "user"}]}
        usage = {"prompt_tokens": prompt, "cached_tokens": cached}
        kind = "completion" if ids else "chat"
        self.add(name, kind, request=request, usage=usage, counter_deltas=counters, **rec)

    def done(self, end_marker: bool) -> dict:
        seqs = [m["seq"] for m in self.cap["kv_events"]["messages"]]
        replay = self.cap["kv_events"]["replay"]
        replay |= {"batches": [{"seq": s} for s in seqs], "end_marker": end_marker}
        return self.cap


def _workload(b: _CaptureBuilder, is_vllm: bool) -> None:
    removed = [{"type": "BlockRemoved", "block_hashes": [h]} for h in ("a2", "a1")]
    b.generate("ids_cold", IDS_A, 10, 0, events=(b.stored(["a1", "a2"], None, IDS_A[:8]),))
    b.generate("ids_repeat", IDS_A, 10, 8 if is_vllm else 4, note="A again")  # sim: 1 block
    b.generate("ids_64", IDS_B, 8, 0, events=(b.stored(["b1", "b2"], None, IDS_B),))
    # vLLM recomputes B's last block and stores it again under its hash; the sim does not,
    # and its queries counter is one short.
    dup = (b.stored(["b2"], "b1", IDS_B[4:]),) if is_vllm else ()
    b.generate(
        "ids_64_repeat", IDS_B, 8, 4, note="B again", queries=8 if is_vllm else 7, events=dup
    )
    gen = [b.stored(["c1"], None, IDS_C[:4])]
    if is_vllm:  # sim: no block for the output
        gen.append(b.stored(["c2"], "c1", IDS_C[4:] + OUT_C[:2]))
    b.generate(
        "ids_gen", IDS_C, 6, 0, events=tuple(gen), output_token_ids=OUT_C if is_vllm else None
    )
    b.generate("ids_gen40_continue", [*IDS_C, 60, 61, 7, 8, 9], 11, 8 if is_vllm else 4)
    b.generate(
        "ids_long", IDS_D, 12, 0, events=(*removed, b.stored(["d1", "d2", "d3"], None, IDS_D))
    )
    b.add(
        "tokenize_chat",
        "tokenize",
        tokenize={"ids": CHAT_IDS, "count": 12},
        status=200 if is_vllm else 404,
    )
    b.generate(
        "chat_sys_q1",
        None,
        12 if is_vllm else 9,
        0,
        events=(b.stored(["h1", "h2"], None, CHAT_IDS[:8] if is_vllm else [1] * 8),),
    )
    cleared = ({"type": "AllBlocksCleared"},)
    b.add("reset", "reset", events=() if is_vllm else cleared)  # vLLM: with the next request
    again = b.stored(["a1", "a2"], None, IDS_A[:8])
    b.generate("ids_after_reset", IDS_A, 10, 0, events=(*cleared, again) if is_vllm else (again,))


@pytest.fixture(scope="module")
def synthetic() -> tuple[dict, dict]:
    vllm = _CaptureBuilder("vllm 0.32.0", VLLM_PAGE, "topic,seq,payload", spec_kind=True)
    sim = _CaptureBuilder("epp sim", SIM_PAGE, "seq,payload", spec_kind=False)
    _workload(vllm, is_vllm=True)
    _workload(sim, is_vllm=False)
    return vllm.done(end_marker=True), sim.done(end_marker=False)


def _section(text: str, heading: str) -> str:
    """The text under `heading` up to the next heading of its level or above."""
    level = len(heading.split(" ", 1)[0])
    body = text.split(heading + "\n", 1)[1]
    return re.split(rf"^#{{1,{level}}} ", body, maxsplit=1, flags=re.M)[0]


def test_report_summary_gives_each_topic_its_verdict(synthetic: tuple[dict, dict]) -> None:
    summary = _section(compare.render(*synthetic), "## Summary")
    rows = dict(re.findall(r"^\| (.+?) \| (match|differs|note) \|$", summary, flags=re.M))
    assert rows == {
        "cached_tokens on identical token-id prompts": "differs",
        "cached tokens: whole blocks, never the last prompt token": "match",
        "full blocks holding generated tokens are cached and announced": "differs",
        "BlockStored for a hash already cached (recomputed last block)": "differs",
        "when AllBlocksCleared is published": "differs",
        "replay framing": "differs",
        "BlockStored fields": "differs",
        "eviction order (LRU of unused blocks, a request's tail before its head)": "match",
        "tokenization and chat template": "differs",
        "/metrics names, types and labels": "differs",
        "prefix_cache_queries / prefix_cache_hits counters": "differs",
    }


def test_report_findings_state_the_numbers(synthetic: tuple[dict, dict]) -> None:
    text = compare.render(*synthetic)
    expected = [
        "6/8 token-id steps give the same cached_tokens; differ: ids_repeat (vLLM 8, sim 4), "
        "ids_gen40_continue (vLLM 8, sim 4)",
        "a prompt of exactly 8 tokens (2 blocks of 4) sent twice: vLLM reports "
        "cached_tokens=4, the sim 4. 100 ids repeated: vLLM 8, sim 4 (= floor(99/4)*4). "
        "Rule violations: vLLM 0, sim 1.",
        "vLLM stored 1 block event(s) holding output tokens (ids_gen), the sim 0.",
        "vLLM: 1 duplicate store(s) b2 (later removed 0x); sim: 0. In ids_64_repeat vLLM "
        "emitted: Stored 1 blk/4 tok (child); the sim: -.",
        "during /reset_prefix_cache vLLM published: -; with the next request: "
        "AllBlocksCleared; Stored 2 blk/8 tok (root). The sim during the reset: "
        "AllBlocksCleared.",
        "vLLM replay frames after the empty delimiter: ['topic,seq,payload']; sim: "
        "['seq,payload']. End marker seen: vLLM True, sim False.",
        "only in vLLM: ['kv_cache_spec_kind']; only in the sim: []; vLLM kv_cache_spec_kind "
        "values: {'full_attention': 8}; medium: vLLM {'GPU': 8}, sim {'GPU': 6}",
        "vLLM removed 2 blocks, the sim 2, both with one hash per BlockRemoved (max 1 / 1). "
        "Victims by the step that stored them, in eviction order: vLLM ids_cold 2; sim "
        "ids_cold 2. Same order over the steps both evicted from: True.",
        "chat (system + user): vLLM 12 tokens (template with BOS and header tokens; "
        "/tokenize says 12), sim 9",
        "Event tokens of the chat equal /tokenize's rendering: True. The sim serves "
        "/tokenize: False.",
        "missing in the sim: none; other type or labels: ['vllm:num_requests_waiting', "
        "'vllm:cache_config_info']",
        "cache_config_info: block_size 4 / 4, num_gpu_blocks 10 / 12",
        "vLLM violations: none; sim: ['ids_64_repeat: prefix_cache_queries +7, prompt 8'].",
    ]
    for sentence in expected:
        assert sentence in text


def test_report_tables_pair_each_step(synthetic: tuple[dict, dict]) -> None:
    text = compare.render(*synthetic)
    accounting = _section(text, "## Prefix-hit accounting, request by request")
    for row in (
        "| `ids_repeat` | A again | 10 / 10 | 8 / 4 | 10 / 10 | 8 / 4 |",
        "| `ids_64_repeat` | B again | 8 / 8 | 4 / 4 | 8 / 7 | 4 / 4 |",
        "| `chat_sys_q1` | chat_sys_q1 | 12 / 9 | 0 / 0 | 12 / 9 | 0 / 0 |",
    ):
        assert row in accounting.splitlines()
    assert "`reset`" not in accounting  # generation steps only
    events = _section(text, "## KV events, request by request").splitlines()
    for row in (
        "| `ids_64_repeat` | Stored 1 blk/4 tok (child) | - |",
        "| `ids_gen` | Stored 1 blk/4 tok (root); Stored 1 blk/4 tok (child) "
        "| Stored 1 blk/4 tok (root) |",
        "| `ids_long` | Removed 2; Stored 3 blk/12 tok (root) "
        "| Removed 2; Stored 3 blk/12 tok (root) |",
        "| `reset` | - | AllBlocksCleared |",
        "| `ids_after_reset` | AllBlocksCleared; Stored 2 blk/8 tok (root) "
        "| Stored 2 blk/8 tok (root) |",
    ):
        assert row in events


def test_report_stream_and_block_tables(synthetic: tuple[dict, dict]) -> None:
    streams = _section(compare.render(*synthetic), "### The event streams").splitlines()
    for row in (
        "| batches (live) | 7 | 7 |",
        "| sequence without gaps | true | true |",
        '| events by type | {"BlockStored": 8, "BlockRemoved": 2, "AllBlocksCleared": 1} '
        '| {"BlockStored": 6, "BlockRemoved": 2, "AllBlocksCleared": 1} |',
        '| parent_block_hash: root / earlier block / unknown | {"root": 6, "known": 2, '
        '"unknown": 0} | {"root": 6, "known": 0, "unknown": 0} |',
        '| hashes stored while already cached | ["b2"] | [] |',
        "| replay end marker | true | false |",
        "| `ids_gen` | from block 0, 1 blk, output no; from block 1, 1 blk, output yes "
        "| from block 0, 1 blk, output no |",
        "| `ids_64_repeat` | from block 1, 1 blk, output no | - |",
    ):
        assert row in streams
    assert (
        "BlockStored fields: vLLM `block_hashes, block_size, extra_keys, kv_cache_spec_kind, "
        "medium, parent_block_hash, token_ids`; sim `block_hashes, block_size, extra_keys, "
        "medium, parent_block_hash, token_ids`." in streams
    )


def test_report_metrics_section(synthetic: tuple[dict, dict]) -> None:
    metrics = _section(compare.render(*synthetic), "## /metrics")
    assert "Families (without the `_created` gauges): vLLM 4, sim 4, in both 3." in metrics
    assert "Only in vLLM:\n\n- `process_open_fds` (gauge; labels: -)\n" in metrics
    assert "Only in the sim:\n\n- `sim_extra_total` (counter; labels: pod)\n" in metrics
    assert (
        "- `vllm:cache_config_info`: labels only in vLLM ['hash_block_size'], only in the sim -\n"
        "- `vllm:num_requests_waiting`: labels only in vLLM ['engine'], only in the sim -\n"
    ) in metrics
    assert (
        "`vllm:cache_config_info` label values that differ (vLLM → sim): "
        "`hash_block_size` None → (absent), `num_gpu_blocks` 10 → 12."
    ) in metrics


def test_report_gives_sim_changes_only_for_differences(synthetic: tuple[dict, dict]) -> None:
    findings = _section(compare.render(*synthetic), "## Findings")
    assert (
        "*Simulator change:* kv_events.py (BlockStored): add kv_cache_spec_kind='full_attention'."
    ) in findings
    vllm, _ = synthetic
    same = compare.render(vllm, vllm)  # vLLM against itself: every topic matches
    assert "| differs |" not in same and "*Simulator change:*" not in same
    assert "| `ids_repeat` | A again | 10 / 10 | 8 / 8 | 10 / 10 | 8 / 8 |" in same


def test_compare_command_writes_the_report(synthetic: tuple[dict, dict], tmp_path: Path) -> None:
    vllm, sim = synthetic
    (tmp_path / "vllm.json").write_text(json.dumps(vllm))
    (tmp_path / "sim.json").write_text(json.dumps(sim))
    out = tmp_path / "report.md"
    done = subprocess.run(
        [sys.executable, str(TOOLS / "compare.py"), "--captures", str(tmp_path), "--out", str(out)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert out.read_text() == compare.render(vllm, sim)
    assert f"wrote {out}" in done.stdout
    assert "  differs  replay framing" in done.stdout.splitlines()
    assert "  match    BlockStored fields" not in done.stdout


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


def test_describe_counts_removed_hashes_and_marks_salt() -> None:
    salted = {**_stored(["s"], "p", 16), "extra_keys": ["salt"]}
    events = [
        {"type": "BlockRemoved", "block_hashes": ["a", "b"]},
        {"type": "BlockRemoved", "block_hashes": ["c"]},
        _stored(["x", "y"], None, 32),
        salted,
        {"type": "BlockRemoved", "block_hashes": ["d"]},
        {"type": "AllBlocksCleared"},
    ]
    assert compare.describe(events) == (
        "Removed 3; Stored 2 blk/32 tok (root); Stored 1 blk/16 tok (child, salted); "
        "Removed 1; AllBlocksCleared"
    )
    assert compare.describe([]) == "-"


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
    report = compare.render(vllm, sim)
    for f in compare.findings(vllm, sim):
        assert f"| {f.topic} | {f.verdict} |" in report
    # The accounting row of a fully cached prompt of whole blocks: vLLM recomputes the
    # last block, so its cached tokens are one block short of the prompt.
    row = next(line for line in report.splitlines() if line.startswith("| `ids_64_repeat` |"))
    prompt, cached = (int(cell.split(" / ")[0]) for cell in row.split(" | ")[2:4])
    assert cached == prompt - compare.block_size(vllm)
