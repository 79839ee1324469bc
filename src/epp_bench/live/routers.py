"""The routers a live run compares, and how to start each in front of fresh pods.

Every router gets its own brand-new pods (same count, same simulator arguments), so all of
them start with cold KV caches and the only difference between two runs is the router.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from epp.envoy_config import BodyMode
from epp_bench.live.bench_dir import BenchDir
from epp_bench.live.peers import PeerSpec, PeerStack
from epp_harness.stack import LocalStack, PodInfo, StackMode


@dataclass(frozen=True, slots=True)
class RouterSpec:
    name: str
    description: str
    stack_mode: StackMode | None = None  # a LocalStack front (Envoy, with or without EPP)
    peer: PeerSpec | None = None  # a peer router process instead of Envoy
    body_mode: BodyMode = "FULL_DUPLEX_STREAMED"  # how Envoy sends the body to the EPP
    in_default_set: bool = True  # variants for investigations run only when named


ROUTERS: dict[str, RouterSpec] = {
    spec.name: spec
    for spec in (
        RouterSpec(
            "epp",
            "Envoy 1.40 + this EPP over ext_proc (prefix-cache and load aware)",
            stack_mode="epp",
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


@contextlib.contextmanager
def running_router(
    spec: RouterSpec,
    bench: BenchDir,
    *,
    pods: int,
    sim_args: Sequence[str],
    epp_args: Sequence[str] = (),
    work_dir: Path | None = None,
) -> Iterator[RunningRouter]:
    """Start pods + router, yield them, stop every process on exit (also on Ctrl-C)."""
    if spec.peer is not None:
        with PeerStack(
            spec.peer, bench, pods=pods, sim_args=sim_args, work_dir=work_dir
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
    with LocalStack(
        pods=pods,
        mode=spec.stack_mode,
        body_mode=spec.body_mode,
        sim_args=sim_args,
        epp_args=epp_args,
        work_dir=work_dir,
        # The EPP logs one line per request at info; that is part of its real cost, but a
        # benchmark measures routing, and the peers run at warn too.
        log_level="warning",
    ) as stack:
        yield RunningRouter(
            name=spec.name,
            url=stack.envoy_url,
            pods=list(stack.pods),
            groups=dict(stack.pids),
            decision_component="epp" if spec.stack_mode == "epp" else "envoy",
            epp_metrics_url=stack.epp_metrics_url,
            router_metrics_url=None,
        )
