"""Decision observation: the metrics and log lines of each routing decision and refusal.

Reads the decision, writes nothing the routing reads back. The log level is decided once
per request (preparation): at INFO one line per decision and nothing per endpoint; the
per-factor breakdown (DEBUG) and the block detail (TRACE) are built only at those levels.
"""

from __future__ import annotations

import logging

import structlog

from epp.observability.logs import TRACE, trace
from epp.observability.metrics import EppMetrics
from epp.prefix.index import PrefixIndex
from epp.request import RequestRejected
from epp.routing.types import PreparedRequest
from epp.scheduling.types import Decision, SchedulingRequest

log = structlog.get_logger("epp.routing")


class DecisionObserver:
    def __init__(self, metrics: EppMetrics, index: PrefixIndex, tie_epsilon: float) -> None:
        self._metrics = metrics
        self._index = index
        self._tie = tie_epsilon

    def rejected(self, prepared: PreparedRequest, exc: RequestRejected) -> None:
        """A refusal of a prepared request (the ext_proc server counts the answer)."""
        self._metrics.decisions.labels(model_label(prepared), exc.reason).inc()
        self._metrics.upstream.tag(exc, prepared.upstream)
        if prepared.log_level > logging.DEBUG:
            return  # the ext_proc server logs every answer at INFO (request_answered)
        log.debug(
            "request_rejected",
            request_id=prepared.request_id,
            model=short(prepared.request.model),
            status=exc.status,
            reason=exc.reason,
        )

    def routed(
        self,
        prepared: PreparedRequest,
        sched: SchedulingRequest,
        decision: Decision,
        elapsed_us: float,
        seq: int = 0,
    ) -> None:
        """A decision made: its metrics, then its log lines at the request's level."""
        self._count(prepared, sched, decision, elapsed_us, seq)
        level = prepared.log_level
        if level > logging.INFO:
            return
        if level <= TRACE:
            _trace_blocks(sched, decision)
        if level <= logging.DEBUG:
            log.debug(
                "scoring_complete",
                request_id=decision.request_id,
                candidates=len(decision.candidates),
                filtered_out=decision.filtered_out,
                weights=decision.weights,
                top=top_with_chosen(decision, 3),
                latency_us=round(elapsed_us, 1),
            )
        self._log_routed(prepared, sched, decision, elapsed_us)

    def _count(
        self,
        prepared: PreparedRequest,
        sched: SchedulingRequest,
        decision: Decision,
        elapsed_us: float,
        seq: int,
    ) -> None:
        m = self._metrics
        chosen = decision.primary
        block_size = sched.block_size
        matched = sched.prefix_match.get(chosen.name, 0)
        if not self._index.is_precise(chosen.name):
            # Checked later against the pod's own hit counter (observability/stale); one
            # predicting no hit still counts in the pod's token ratio there. A precise
            # pod's decisions are checked from its KV events (prefix/precise_stale).
            m.stale.dispatched(chosen, seq, matched * block_size, sched.prompt_tokens, block_size)
        cache = decision.factor("cache")
        m.decisions.labels(model_label(prepared), "routed").inc()
        m.latency_us.observe(elapsed_us)
        m.composite.observe(decision.score)
        m.candidates.observe(len(decision.candidates))
        m.prefix_nodes.set(self._index.nodes)
        if cache is not None:
            m.cache_match.observe(cache)
        m.best_possible_match.observe(best_match(sched))
        adapter = prepared.adapter
        if adapter and not chosen.has_adapter(adapter):
            m.adapter_loads.labels(adapter).inc()

    def _log_routed(
        self,
        prepared: PreparedRequest,
        sched: SchedulingRequest,
        decision: Decision,
        elapsed_us: float,
    ) -> None:
        chosen = decision.primary
        cache = decision.factor("cache")
        reason, margin = selection_reason(decision, self._tie)
        log.info(
            "request_routed",
            request_id=decision.request_id,
            model=short(prepared.request.model),
            adapter=short(prepared.adapter),
            priority=prepared.priority,
            input_tokens=sched.prompt_tokens,
            pod=chosen.name,
            address=chosen.address,
            reason=reason,
            margin=round(margin, 4),
            score=round(decision.score, 4),
            cache_match=None if cache is None else round(cache, 4),
            candidates=len(decision.candidates),
            fallbacks=[e.name for e in decision.endpoints[1:]],
            latency_us=round(elapsed_us, 1),
        )


def best_match(sched: SchedulingRequest) -> float:
    """The longest prefix any pod holds, over the prompt's blocks."""
    if not sched.total_blocks:
        return 0.0
    return max(sched.prefix_match.values(), default=0) / sched.total_blocks


def model_label(prepared: PreparedRequest) -> str:
    # The metric bounds the label itself (observability/labels.py): clients choose it.
    return prepared.request.model or ""


def short(value: str | None, limit: int = 128) -> str | None:
    """A client-chosen string as logged: bounded, so a huge model name costs nothing."""
    if value is None or len(value) <= limit:
        return value
    return value[:limit] + f"...(+{len(value) - limit})"


def _trace_blocks(sched: SchedulingRequest, decision: Decision) -> None:
    """Block-level detail: how many leading blocks of this prompt each pod holds."""
    trace(
        log,
        "prefix_match",
        request_id=decision.request_id,
        blocks=sched.total_blocks,
        block_size=sched.block_size,
        matched_blocks=dict(sched.prefix_match),
        first_block=f"{sched.block_hashes[0]:016x}" if sched.block_hashes else None,
    )


def top_with_chosen(decision: Decision, limit: int) -> list[dict[str, object]]:
    """The per-factor breakdown of the best `limit` candidates, plus the chosen pod (marked
    `selected`) when it is not among them."""
    top = decision.breakdown(limit)
    chosen = decision.primary.name
    if any(row["pod"] == chosen for row in top):
        return top
    i = decision.chosen_index
    row: dict[str, object] = {"pod": chosen, "score": round(decision.totals[i], 4)}
    row.update({name: round(values[i], 4) for name, values in decision.factors.items()})
    row["selected"] = True
    return [*top, row]


def selection_reason(decision: Decision, tie_epsilon: float) -> tuple[str, float]:
    """Why the chosen pod won, and its score margin over the runner-up; cheap (a few
    C-level passes, no Python loop over endpoints):
    - `only-candidate`;
    - `tie`: within the tie epsilon, so fewest in flight, then least work, then chance;
    - else the factor with the largest weighted lead over the runner-up (`cache`,
      `load`, `queue`, `prefill`, ...)."""
    totals = decision.totals
    if len(totals) < 2:
        return "only-candidate", 0.0
    i = decision.chosen_index
    others = totals[:i] + totals[i + 1 :]
    second = max(others)
    margin = totals[i] - second
    if margin <= tie_epsilon:
        return "tie", margin
    j = others.index(second)
    j += j >= i  # back to an index of `totals`
    weights = decision.weights
    best_factor, best_lead = "score", 0.0
    for name, values in decision.factors.items():
        lead = weights.get(name, 0.0) * (values[i] - values[j])
        if lead > best_lead:
            best_factor, best_lead = name, lead
    return best_factor, margin
