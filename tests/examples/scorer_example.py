"""CONTRIBUTING.md, "Add a scorer": prefer the pods in the EPP's own zone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.datalayer.endpoint import EndpointView
from epp.scheduling.types import SchedulingRequest


@dataclass(slots=True)
class ZoneScorer:
    """1.0 for a pod labelled `zone=<this EPP's zone>`, 0.0 for any other pod."""

    zone: str
    name: str = "zone"

    def score(self, request: SchedulingRequest, candidates: Sequence[EndpointView]) -> list[float]:
        return [1.0 if e.labels.get("zone") == self.zone else 0.0 for e in candidates]
