"""Routing: one decision per request, from the body Envoy forwards to the pod chosen.

`Router` (router.py) composes the components, each with one job: preparation.py (parse,
tokenize, hash), dispatch.py (filter, score, pick, reserve), flow_control.py (the
admission queue while the pool is saturated), accounting.py (reservations, completions,
in-flight; the only routing module that changes Endpoint state) and observation.py (the
metrics and logs of each decision). types.py holds what they hand each other.
"""

from epp.routing.router import Router, retry_after_header
from epp.routing.types import PreparedRequest, RoutedRequest, Saturated

__all__ = [
    "PreparedRequest",
    "RoutedRequest",
    "Router",
    "Saturated",
    "retry_after_header",
]
