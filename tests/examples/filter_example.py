"""CONTRIBUTING.md, "Add a filter": pods labelled `drain=true` take no new requests."""

from __future__ import annotations

from dataclasses import dataclass

from epp.datalayer.endpoint import Endpoint
from epp.scheduling.types import SchedulingRequest


@dataclass(slots=True)
class DrainFilter:
    name: str = "drain"
    reject_status: int = 503  # every candidate is draining
    reject_reason: str = "rejected-draining"

    def filter(self, request: SchedulingRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        return [e for e in candidates if e.labels.get("drain") != "true"]
