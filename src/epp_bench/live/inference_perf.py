"""Drive a live router with Kubernetes SIG `inference-perf`, the field's benchmark client.

inference-perf generates its own prompts (data type `shared_prefix`: random token ids of
the local tokenizer, decoded to text) and its own Poisson arrivals, so its run is the
same *shape* as our `shared-prefix` workload, not the same bytes. It is driven as a
subprocess with a generated YAML config, offline (HF_HUB_OFFLINE=1, local tokenizer).

Its per-request report gives, for every request: start and end time, TTFT (first output
token minus start), latency, server usage (prompt, cached and output tokens), the error if
any. It cannot give the serving pod (it records no response headers: `pod` stays None,
and the per-pod spread comes from the pods' own counters instead), nor an HTTP status
(a success is recorded as 200, a failure as 0 with its error type and message).

Token lengths are in the local BPE's tokens (about 4.8 bytes each on its generated text),
while the simulator counts 4 bytes per token: the pods see ~20% more tokens than asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from epp_bench.live.bench_dir import BenchDir
from epp_bench.workloads.types import RequestOutcome, Workload

PER_REQUEST_FILE = "per_request_lifecycle_metrics.json"
SUMMARY_FILE = "summary_lifecycle_metrics.json"
_LOG_TAIL_CHARS = 3000


class InferencePerfError(RuntimeError):
    """inference-perf is missing, failed, or wrote no report."""


@dataclass(frozen=True, slots=True)
class InferencePerfLoad:
    """What inference-perf sends: a `shared_prefix` data set at one Poisson rate."""

    groups: int
    prompts_per_group: int
    system_tokens: int
    question_tokens: int
    output_tokens: int
    rate: float
    duration_s: int
    model: str
    seed: int = 0
    max_concurrency: int = 256
    request_timeout_s: float = 60.0
    teardown_grace_s: float = 30.0


def load_from_workload(
    workload: Workload, rate: float, duration_s: float, max_concurrency: int
) -> InferencePerfLoad:
    """The inference-perf load matching one of our shared-prefix workloads.

    Only shared-prefix workloads have an inference-perf twin; anything else raises
    ValueError. The duration is the one our own client would need for the same number of
    requests at that rate, capped by `duration_s`.
    """
    shape = workload.params.get("shape")
    if not isinstance(shape, dict):
        raise ValueError(f"inference-perf runs only shared-prefix workloads, not {workload.name!r}")
    requests = len(workload.requests)
    duration = max(1, min(math.ceil(duration_s), math.ceil(requests / rate)))
    return InferencePerfLoad(
        groups=int(shape["groups"]),
        prompts_per_group=int(shape["prompts_per_group"]),
        system_tokens=int(shape["system_tokens"]),
        question_tokens=int(shape["question_tokens"]),
        output_tokens=int(shape["output_tokens"]),
        rate=rate,
        duration_s=duration,
        model=str(workload.params.get("model", "sim-llama-8b")),
        seed=int(workload.params.get("seed", 0)),
        max_concurrency=max_concurrency,
    )


def config_for(
    load: InferencePerfLoad, base_url: str, tokenizer_dir: Path, report_dir: Path
) -> dict[str, Any]:
    """inference-perf's YAML config as a dict."""
    return {
        "api": {"type": "completion", "streaming": True},
        "server": {
            "type": "vllm",
            "model_name": load.model,
            "base_url": base_url,
            # Every request then generates exactly `output_len` tokens, as in our workload.
            "ignore_eos": True,
        },
        "tokenizer": {"pretrained_model_name_or_path": str(tokenizer_dir)},
        "data": {
            "type": "shared_prefix",
            "shared_prefix": {
                "num_groups": load.groups,
                "num_prompts_per_group": load.prompts_per_group,
                "system_prompt_len": load.system_tokens,
                "question_len": load.question_tokens,
                "output_len": load.output_tokens,
                "seed": load.seed,
            },
        },
        "load": {
            "type": "poisson",
            "stages": [{"rate": load.rate, "duration": load.duration_s}],
            # One worker process: on a 2-core box more workers only fight the stack for CPU.
            "num_workers": 1,
            "worker_max_concurrency": load.max_concurrency,
            "request_timeout": load.request_timeout_s,
            "stage_teardown_grace_seconds": load.teardown_grace_s,
            "base_seed": load.seed,
        },
        "report": {
            "request_lifecycle": {
                "summary": True,
                "per_stage": False,
                "per_request": True,
                "per_request_fields": {
                    "request": False,
                    "response": False,
                    "info": True,
                    "response_chunks": False,
                    "computed_metrics": True,
                },
            }
        },
        "storage": {"local_storage": {"path": str(report_dir)}},
    }


@dataclass(slots=True)
class InferencePerfRun:
    outcomes: list[RequestOutcome]
    summary: dict[str, Any]  # summary_lifecycle_metrics.json as written
    wall_s: float  # the subprocess, start-up (tokenizer, data generation) included
    benchmark_s: float  # inference-perf's own `benchmark_time_seconds`


async def run_inference_perf_async(
    bench: BenchDir, load: InferencePerfLoad, base_url: str, work_dir: Path
) -> InferencePerfRun:
    """Run inference-perf once against `base_url`; raise InferencePerfError on failure.

    inference-perf runs in its own session: if this coroutine is cancelled (Ctrl-C, the
    runner's own failure) or the run hangs, its whole process group (workers included)
    is killed before this returns.
    """
    executable = bench.bin("inference-perf", "inference-perf")
    if not bench.installed("inference-perf") or not bench.tokenizer_ready():
        raise InferencePerfError(
            f"inference-perf or its tokenizer is missing under {bench.root} "
            "(run: .venv/bin/python tools/bench/install_peers.py)"
        )
    report_dir = work_dir / "inference-perf-report"
    work_dir.mkdir(parents=True, exist_ok=True)
    config_path = work_dir / "inference-perf.yaml"
    config_path.write_text(
        yaml.safe_dump(config_for(load, base_url, bench.tokenizer_dir, report_dir), sort_keys=False)
    )
    run_env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    run_env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    # Start-up (imports, tokenizer, prompt generation) plus the stage, the teardown grace
    # and report writing: anything beyond is a hang.
    timeout_s = 120 + load.duration_s + load.teardown_grace_s + load.request_timeout_s
    log_path = work_dir / "inference-perf.log"
    started = time.monotonic()
    with open(log_path, "wb") as log:
        process = await asyncio.create_subprocess_exec(
            str(executable), "-c", str(config_path),
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=run_env, cwd=work_dir, start_new_session=True,
        )  # fmt: skip
        try:
            returncode = await asyncio.wait_for(process.wait(), timeout_s)
        except TimeoutError as exc:
            raise InferencePerfError(f"inference-perf did not finish in {timeout_s:.0f} s") from exc
        finally:
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
    wall_s = time.monotonic() - started
    tail = log_path.read_text(errors="replace")[-_LOG_TAIL_CHARS:]
    if returncode != 0:
        raise InferencePerfError(f"inference-perf exited {returncode} (log {log_path}):\n{tail}")
    try:
        per_request = json.loads((report_dir / PER_REQUEST_FILE).read_text())
        summary = json.loads((report_dir / SUMMARY_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise InferencePerfError(f"no readable report in {report_dir}: {exc}\n{tail}") from exc
    return InferencePerfRun(
        outcomes=outcomes_from_report(per_request),
        summary=summary,
        wall_s=wall_s,
        benchmark_s=float(summary.get("benchmark_time_seconds") or 0.0),
    )


def run_inference_perf(
    bench: BenchDir, load: InferencePerfLoad, base_url: str, work_dir: Path
) -> InferencePerfRun:
    """`run_inference_perf_async` for callers without an event loop."""
    return asyncio.run(run_inference_perf_async(bench, load, base_url, work_dir))


def outcomes_from_report(entries: list[dict[str, Any]]) -> list[RequestOutcome]:
    """Our per-request outcomes from inference-perf's per-request report, by start time."""
    if not entries:
        return []
    origin = min(float(e["start_time"]) for e in entries)
    outcomes: list[RequestOutcome] = []
    for index, entry in enumerate(sorted(entries, key=lambda e: float(e["start_time"]))):
        start = float(entry["start_time"])
        end = float(entry.get("end_time") or start)
        error = entry.get("error")
        computed = entry.get("computed_metrics") or {}
        info = entry.get("info") or {}
        response = info.get("response_metrics") or {}
        usage = response.get("server_usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        outcome = RequestOutcome(
            index=index,
            pod=None,
            status=0 if error else 200,
            start_s=start - origin,
            ttft_s=computed.get("time_to_first_token"),
            latency_s=float(computed.get("request_latency") or (end - start)),
            prompt_tokens=int(usage.get("prompt_tokens") or info.get("input_tokens") or 0),
            cached_tokens=int(details.get("cached_tokens") or 0),
            output_tokens=int(usage.get("completion_tokens") or response.get("output_tokens") or 0),
            error=None
            if not error
            else f"{error.get('error_type', 'error')}: {error.get('error_msg', '')}"[:300],
        )
        outcomes.append(outcome)
    return outcomes


def summary_fields(summary: dict[str, Any]) -> dict[str, float | None]:
    """The headline numbers of inference-perf's own summary, to cross-check ours."""
    successes = summary.get("successes") or {}
    latency = successes.get("latency") or {}
    ttft = latency.get("time_to_first_token") or {}
    request = latency.get("request_latency") or {}
    throughput = successes.get("throughput") or {}
    prompt = successes.get("prompt_tokens") or {}
    delay = (summary.get("load_summary") or {}).get("schedule_delay") or {}
    cached, total = prompt.get("cached"), prompt.get("total")
    return {
        "requests_ok": successes.get("count"),
        "requests_failed": (summary.get("failures") or {}).get("count"),
        "ttft_p50_s": ttft.get("median"),
        "ttft_p90_s": ttft.get("p90"),
        "ttft_p99_s": ttft.get("p99"),
        "latency_p50_s": request.get("median"),
        "latency_p99_s": request.get("p99"),
        "output_tokens_per_s": throughput.get("output_tokens_per_sec"),
        "requests_per_s": throughput.get("requests_per_sec"),
        "client_cached_ratio": cached / total if cached is not None and total else None,
        "schedule_delay_p99_s": delay.get("p99"),
    }
