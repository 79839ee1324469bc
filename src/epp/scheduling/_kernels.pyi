from collections.abc import Sequence
from typing import Any

def weighted_sum(
    weights: Sequence[float], columns: Sequence[Sequence[float]], /
) -> list[float]: ...
def tied(totals: list[float], eps: float, /) -> list[int]: ...
def prefill(
    candidates: list[Any],
    pods: dict[Any, Any],
    matched: dict[str, int],
    now: float,
    fresh_lane_end: float,
    overhead: float,
    per_token: float,
    per_cached: float,
    prompt_tokens: int,
    block_size: int,
    /,
) -> list[float] | None: ...
def outside_unit(scores: list[float], /) -> bool | None: ...
def queue_scores(candidates: list[Any], max_queue: float, /) -> list[float]: ...
def model_filter(candidates: list[Any], wanted: str, /) -> list[Any]: ...
def health_filter(candidates: list[Any], /) -> list[Any]: ...
