"""What the routing components hand each other: a prepared request, a routed one, the
refusal that sends a request to flow control, and the hooks other parts connect to.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from epp.datalayer.endpoint import Endpoint
from epp.observability.upstream import RequestLabels
from epp.prefix.hashing import BlockHash
from epp.request import InferenceRequest, RequestRejected
from epp.scheduling.types import Decision, Dispatched

SATURATED = "rejected-saturated"

# The pods a waiting request may use (`placement`): its base model, the subset hint.
Placement = tuple[str | None, frozenset[str] | None]
# (the dispatch as the scorers saw it, uncached prompt tokens reserved on the pod)
DispatchListener = Callable[[Dispatched, int], None]
# (route token, pod name, the prompt's block hashes, leading blocks the index matched on
# the pod, prompt tokens, store time): called before the blocks are recorded in the index
RecordListener = Callable[[str, str, Sequence[BlockHash], int, int, float], object]
# (route token, store time) of a decision of this Router whose response ended
CompletionListener = Callable[[str, float], None]
# (route token, status, served address) of a decision this Router did not make
ForeignCompletion = Callable[[str, int | None, str | None], None]


class Saturated(RequestRejected):
    """Every candidate pod is saturated: admission decides (wait or refuse)."""


@dataclass(slots=True)
class PreparedRequest:
    """A parsed, hashed request ready to be scheduled (now, or after waiting)."""

    request_id: str
    request: InferenceRequest
    base_model: str | None
    adapter: str | None
    hashes: list[BlockHash]
    prompt_tokens: int
    subset: frozenset[str] | None
    priority: int
    size: int
    started: float = field(default_factory=time.perf_counter)
    # The model the pod serves it as (a target of the model table), and the body naming it.
    served_model: str | None = None
    body: bytes | None = None
    log_level: int = logging.INFO  # decided once per request, in prepare
    upstream: RequestLabels | None = None  # the upstream series' labels (observability)


@dataclass(slots=True)
class RoutedRequest:
    """A decision made and reserved, handed to the caller. Accounting keeps none of it
    past the dispatch but what the completion needs (accounting.OpenRequest)."""

    request_id: str
    decision: Decision
    request: InferenceRequest
    prompt_tokens: int
    token: str = ""  # names this request in `complete`; unguessable
    dispatch: int = 0  # the endpoint's dispatch number, to release its reservation
    priority: int = 0
    waited_s: float = 0.0
    # The body to forward instead of the client's: set when the model table (an
    # InferenceModel's targetModels) serves the request as another model.
    body: bytes | None = None
    upstream: RequestLabels | None = None  # the upstream series' labels (observability)

    @property
    def endpoint(self) -> Endpoint:
        return self.decision.primary


def placement(prepared: PreparedRequest) -> Placement:
    """The pods a request may use, as a key: what the scheduler's filters read of the
    request (model filter: base model; subset filter: the proxy's hint). The other
    filters (health, saturation) read only the pods."""
    return (prepared.base_model, prepared.subset)


@dataclass(slots=True)
class DecisionHooks:
    """What other parts hear of this router's decisions, connected once by the wiring
    (epp/wiring.py; replicas by epp/replicas). A hook runs on the routing path: it does no
    I/O, and its failure is logged and never fails a request.

    - `shared`: each decision, to share with peer replicas (and to wake the chosen pod's
      scrape loop: epp/wiring.py);
    - `before_record`: a decision on a pod, before its blocks are recorded in the index
      (precise mode opens a stale-routing claim);
    - `completed`: a decision of this router whose response ended (precise mode checks
      the claim; a precise pod's predicted entries live while the request is in flight);
    - `foreign_completion`: a response end seen here for a decision another replica made
      (its route token does not start with `token_prefix`);
    - `peer_dispatched`: the pod of a peer replica's fresh decision, applied here by the
      replicas' inbox (the scraper wakes the pod's loop)."""

    token_prefix: str = ""
    shared: list[DispatchListener] = field(default_factory=list)
    before_record: list[RecordListener] = field(default_factory=list)
    completed: list[CompletionListener] = field(default_factory=list)
    foreign_completion: ForeignCompletion | None = None
    peer_dispatched: list[Callable[[str], None]] = field(default_factory=list)
