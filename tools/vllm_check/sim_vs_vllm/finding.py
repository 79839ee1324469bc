"""The record each comparison topic produces."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Finding:
    """One topic of the report: whether the sim matches vLLM there, the numbers behind the
    verdict, what it means for a router, and the simulator change that would close a gap
    (printed only while the verdict is "differs")."""

    topic: str
    verdict: str  # "match" | "differs" | "note"
    evidence: str
    router: str = ""
    sim_change: str = ""


def verdict(matches: bool) -> str:
    return "match" if matches else "differs"
