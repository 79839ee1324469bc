"""The routers a live run compares, and how to start each in front of fresh pods.

Every router gets its own brand-new pods (same count, same simulator arguments), so all of
them start with cold KV caches and the only difference between two runs is the router.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from epp.envoy_config import BodyMode
from epp_bench.live.bench_dir import BenchDir
from epp_bench.live.peers import PeerSpec, PeerStack
from epp_harness.stack import DEFAULT_MODEL, LocalStack, PodInfo, StackMode


@dataclass(frozen=True, slots=True)
class RouterSpec:
    name: str
    description: str
    stack_mode: StackMode | None = None  # a LocalStack front (Envoy, with or without EPP)
    peer: PeerSpec | None = None  # a peer router process instead of Envoy
    body_mode: BodyMode = "FULL_DUPLEX_STREAMED"  # how Envoy sends the body to the EPP
    in_default_set: bool = True  # variants for investigations run only when named
    # Merged over the `--epp-config` file: what makes this EPP variant what it is.
    epp_config: Mapping[str, Any] = field(default_factory=dict)
    # The pods must publish KV events (and the EPP be told where): precise mode needs them.
    needs_kv_events: bool = False
    # "info" makes the EPP log each decision (request id, prompt tokens, cache match), from
    # which the runner tells engine-side stale routing; it costs the EPP a JSON line each.
    epp_log_level: str = "warning"


ROUTERS: dict[str, RouterSpec] = {
    spec.name: spec
    for spec in (
        RouterSpec(
            "epp",
            "Envoy 1.40 + this EPP over ext_proc (prefix-cache and load aware)",
            stack_mode="epp",
        ),
        RouterSpec(
            "epp_precise",
            "Envoy 1.40 + this EPP in precise mode (kv_events.mode precise: the index follows"
            " the pods' KV events over ZMQ); decisions logged",
            stack_mode="epp",
            in_default_set=False,
            epp_config={"kv_events": {"mode": "precise"}},
            needs_kv_events=True,
            epp_log_level="info",
        ),
        RouterSpec(
            "epp_approx",
            "Envoy 1.40 + this EPP in approximate mode (kv_events.mode approximate: the index"
            " remembers where it routed); decisions logged",
            stack_mode="epp",
            in_default_set=False,
            epp_config={"kv_events": {"mode": "approximate"}},
            epp_log_level="info",
        ),
        RouterSpec("envoy_round_robin", "Envoy 1.40, ROUND_ROBIN cluster, no EPP", "round_robin"),
        RouterSpec(
            "envoy_least_request", "Envoy 1.40, LEAST_REQUEST cluster, no EPP", "least_request"
        ),
        RouterSpec(
            "sglang_cache_aware",
            "sglang-router 0.3.2 (SGLang Model Gateway, Rust) --policy cache_aware",
            peer=PeerSpec("sglang", "cache_aware", "sglang-router"),
        ),
        RouterSpec(
            "vllm_router_cache_aware",
            "vllm-router 0.1.17 (Rust) --policy cache_aware",
            peer=PeerSpec("vllm_router", "cache_aware", "vllm-router"),
        ),
    )
}


def unavailable_reason(spec: RouterSpec, bench: BenchDir) -> str | None:
    """Why this router cannot run here (its tool is not installed), or None."""
    if spec.peer is not None and not bench.installed(spec.peer.tool):
        return f"{spec.peer.tool} not installed in {bench.venv(spec.peer.tool)}"
    return None


def _merged(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` merged into `base`, mappings key by key (neither is changed)."""
    out = dict(base)
    for key, value in over.items():
        old = out.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            out[key] = _merged(old, value)
        else:
            out[key] = value
    return out


def sim_tokenizer(sim_args: Sequence[str]) -> str | None:
    """The `--tokenizer DIR` the pods run with, if any."""
    args = list(sim_args)
    for i, arg in enumerate(args):
        if arg == "--tokenizer" and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith("--tokenizer="):
            return arg.partition("=")[2]
    return None


def epp_config_for(
    spec: RouterSpec, epp_args: Sequence[str], sim_args: Sequence[str], model: str = DEFAULT_MODEL
) -> tuple[str | None, list[str]]:
    """The `epp serve --config` YAML for this router, and the other `epp serve` arguments.

    None (and `epp_args` untouched) when there is nothing to add. Otherwise the file of
    `--config` in `epp_args` (if any) with the router's own settings merged over it, and,
    when the pods run a real tokenizer (`--tokenizer DIR` in `sim_args`), that tokenizer
    for the EPP too: precise mode keys the engine's blocks by the router's hash of their
    token ids, so it needs the engine's tokens, and an approximate EPP compared with it
    gets the same tokens so that only the index differs.
    """
    args = list(epp_args)
    tokenizer = sim_tokenizer(sim_args)
    if not spec.epp_config and tokenizer is None:
        return None, args
    base: dict[str, Any] = {}
    if "--config" in args:
        at = args.index("--config")
        base = yaml.safe_load(Path(args[at + 1]).read_text()) or {}
        del args[at : at + 2]
    if tokenizer is not None and model not in base.get("tokenizers", {}):
        base = _merged(base, {"tokenizers": {model: {"path": str(Path(tokenizer).resolve())}}})
    return yaml.safe_dump(_merged(base, spec.epp_config), sort_keys=False), args


@dataclass(frozen=True, slots=True)
class RunningRouter:
    """A started router and its pods. `groups` maps component names to process-group ids
    for CPU accounting: "pod-<i>", and "envoy" + "epp" or "router"."""

    name: str
    url: str
    pods: list[PodInfo]
    groups: dict[str, int]
    decision_component: str | None  # whose CPU counts as "router CPU per request"
    epp_metrics_url: str | None
    router_metrics_url: str | None
    epp_log: Path | None = None  # the EPP's log file, kept after the run


@contextlib.contextmanager
def running_router(
    spec: RouterSpec,
    bench: BenchDir,
    *,
    pods: int,
    sim_args: Sequence[str],
    epp_args: Sequence[str] = (),
    work_dir: Path | None = None,
    kv_events: bool = False,
) -> Iterator[RunningRouter]:
    """Start pods + router, yield them, stop every process on exit (also on Ctrl-C).

    `kv_events`: the pods publish KV events (always when the router needs them), so that
    every router of a comparison runs the same pods."""
    if spec.peer is not None:
        with PeerStack(
            spec.peer, bench, pods=pods, sim_args=sim_args, work_dir=work_dir, kv_events=kv_events
        ) as peer_stack:
            yield RunningRouter(
                name=spec.name,
                url=peer_stack.router_url,
                pods=list(peer_stack.pods),
                groups=dict(peer_stack.pids),
                decision_component="router",
                epp_metrics_url=None,
                router_metrics_url=peer_stack.router_metrics_url,
            )
        return
    assert spec.stack_mode is not None
    config_yaml, other_args = (
        epp_config_for(spec, epp_args, sim_args) if spec.stack_mode == "epp" else (None, [])
    )
    with LocalStack(
        pods=pods,
        mode=spec.stack_mode,
        body_mode=spec.body_mode,
        sim_args=sim_args,
        epp_args=other_args,
        epp_config_yaml=config_yaml,
        work_dir=work_dir,
        # The EPP logs one line per request at info; that is part of its real cost, but a
        # benchmark measures routing, and the peers run at warn too (epp_log_level: the
        # variants whose decisions the runner reads).
        log_level=spec.epp_log_level,
        kv_events=kv_events or spec.needs_kv_events,
    ) as stack:
        yield RunningRouter(
            name=spec.name,
            url=stack.envoy_url,
            pods=list(stack.pods),
            groups=dict(stack.pids),
            decision_component="epp" if spec.stack_mode == "epp" else "envoy",
            epp_metrics_url=stack.epp_metrics_url,
            router_metrics_url=None,
            epp_log=stack.log_paths.get("epp") if stack.keeps_work_dir else None,
        )
