"""The ledger of what the EPP sent to each pod: the only writer of an Endpoint's `open`,
`dispatched_total`, `in_flight`, `in_flight_tokens`, `dispatched_tokens`, `peer` and
`seen_through` (the ownership table is in datalayer/endpoint.py).

The store decides when (a dispatch, a completion, a page, the clock) and calls these
functions; `Endpoint.refresh()` turns the ledger into load figures. Invariants:

- `dispatched_total` numbers every dispatch counted on the pod, this EPP's and its peer
  replicas', in order of arrival here; the numbers never go back.
- `open` holds this EPP's dispatches not yet released, oldest first; `in_flight` is its
  length and `in_flight_tokens` the sum of their tokens. Each is released exactly once:
  by its completion, by a page that shows it over (`reconcile`), or by its TTL.
- `peer` holds peers' dispatches that no page has shown yet, oldest first: a page
  fetched at least `DISPATCH_TRANSIT_S` after one arrived includes it, and after
  `peer_ttl` it is no longer counted (the EPP never hears of a peer's completion).
- `seen_through`: the dispatches up to this number may be on the last page: they were
  sent before its fetch began and at least `DISPATCH_TRANSIT_S` before it was fetched.
  Every later one is counted on top of the page.
- `at` grows with `seq` (both taken from the store's one clock, in order), so the
  dispatches too young for a page are a suffix of `open` and of `peer`.
- `dispatched_tokens` only grows: every uncached prompt token ever sent to the pod.
"""

from __future__ import annotations

from epp.datalayer.endpoint import Dispatch, Endpoint

# A request reaches the engine's counts some time after the EPP chose the pod (Envoy
# connects and forwards the body, vLLM renders and tokenizes it): only dispatches older
# than this are compared with the pod's counts.
RECONCILE_GRACE_S = 2.0

# The same transit, estimated tightly, for deciding what a page shows: a request is in
# vLLM's running/waiting gauges only after Envoy forwarded it, the API server rendered and
# tokenized it and an engine step scheduled it (a few ms idle; a decode step or two, tens
# of ms, under load). A page fetched sooner after the dispatch does not show it, and
# taking it as shown would drop the pod's load below what it carries: the EPP would then
# send it more than it can run. Erring long counts a request twice for that long (the
# pod looks busier, briefly), so this stays well under RECONCILE_GRACE_S, which errs long
# because releasing a live request is the costlier mistake there.
DISPATCH_TRANSIT_S = 0.2


def reserve(endpoint: Endpoint, tokens: int, now: float) -> int:
    """This EPP sent a request with `tokens` uncached prompt tokens: returns its number."""
    endpoint.dispatched_total += 1
    seq = endpoint.dispatched_total
    endpoint.open[seq] = Dispatch(seq, tokens, now)
    endpoint.in_flight += 1
    endpoint.in_flight_tokens += tokens
    endpoint.dispatched_tokens += tokens
    return seq


def reserve_for_peer(endpoint: Endpoint, tokens: int, now: float) -> None:
    """A peer replica sent a request: counted until a page shows it, or its TTL."""
    endpoint.dispatched_total += 1
    endpoint.peer.append(Dispatch(endpoint.dispatched_total, tokens, now))
    endpoint.dispatched_tokens += tokens


def release(endpoint: Endpoint, seq: int) -> Dispatch | None:
    """Release the open dispatch numbered `seq`; None if it is not open (released
    already, or never dispatched)."""
    dispatch = endpoint.open.pop(seq, None)
    if dispatch is not None:
        endpoint.in_flight -= 1
        endpoint.in_flight_tokens -= dispatch.tokens
    return dispatch


def page_seen(
    endpoint: Endpoint, through: int, fetched_at: float, grace: float = DISPATCH_TRANSIT_S
) -> None:
    """A page fetched at `fetched_at` whose fetch began when `dispatched_total` was
    `through`: the dispatches up to it that are older than `grace` may be on the page
    (peers' ones are, and are counted no longer); younger ones may not have reached the
    pod yet and stay counted on top of it."""
    cutoff = fetched_at - grace
    first_unseen = through + 1
    for dispatch in reversed(endpoint.open.values()):
        if dispatch.at <= cutoff:
            break
        first_unseen = min(first_unseen, dispatch.seq)
    for dispatch in reversed(endpoint.peer):
        if dispatch.at <= cutoff:
            break
        first_unseen = min(first_unseen, dispatch.seq)
    seen = first_unseen - 1
    endpoint.seen_through = seen
    peer = endpoint.peer
    while peer and peer[0].seq <= seen:
        peer.popleft()


def reconcile(endpoint: Endpoint, shown: int, now: float) -> bool:
    """Completions nobody reported: the page shows `shown` requests (running + waiting),
    fewer than this EPP sent before its fetch, so the oldest of those are over. Other
    routers' traffic only adds to the pod's count, so this never releases a live request.
    Returns whether any was released."""
    through = endpoint.seen_through
    before = [
        d for d in endpoint.open.values() if d.seq <= through and now - d.at > RECONCILE_GRACE_S
    ]
    excess = len(before) - shown
    for dispatch in before[: max(0, excess)]:
        release(endpoint, dispatch.seq)
    return excess > 0


def expire(endpoint: Endpoint, now: float, ttl: float, peer_ttl: float) -> bool:
    """Stop counting what no completion or page accounted for in time: open dispatches
    older than `ttl`, peers' older than `peer_ttl`. Returns whether any was dropped."""
    expired = [d for d in endpoint.open.values() if now - d.at > ttl]
    for dispatch in expired:
        release(endpoint, dispatch.seq)
    peer = endpoint.peer
    dropped = bool(expired)
    while peer and now - peer[0].at > peer_ttl:
        peer.popleft()
        dropped = True
    return dropped
