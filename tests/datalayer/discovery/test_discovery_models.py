"""InferenceModel / InferenceObjective objects -> the model table, table-driven."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from epp.datalayer.discovery.models import (
    OBJECTIVE_HEADER,
    ModelRoute,
    TargetModel,
    build_model_table,
)


def model(
    name: str,
    model_name: str | None,
    *,
    pool: str = "p",
    criticality: str | None = None,
    targets: list[dict[str, Any]] | None = None,
    created: str = "2026-01-01T00:00:00Z",
) -> dict[str, Any]:
    spec: dict[str, Any] = {"poolRef": {"name": pool}}
    if model_name is not None:
        spec["modelName"] = model_name
    if criticality is not None:
        spec["criticality"] = criticality
    if targets is not None:
        spec["targetModels"] = targets
    return {"metadata": {"name": name, "creationTimestamp": created}, "spec": spec}


def objective(name: str, priority: Any = None, *, pool: str = "p", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"poolRef": {"name": pool, "kind": "InferencePool"}, **spec}
    if priority is not None:
        body["priority"] = priority
    return {"metadata": {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z"}, "spec": body}


@pytest.mark.parametrize(
    ("case", "models", "expected"),
    [
        (
            "criticality maps to priority (sheddable < 0)",
            [
                model("a", "chat", criticality="Critical"),
                model("b", "batch", criticality="Sheddable"),
                model("c", "std", criticality="Standard"),
                model("d", "plain"),
            ],
            {"chat": 1, "batch": -1, "std": 0, "plain": None},
        ),
        (
            "another pool's objects do not count",
            [model("a", "chat", criticality="Critical", pool="other")],
            {},
        ),
        (
            "two objects, one modelName: the oldest wins",
            [
                model("new", "chat", criticality="Sheddable", created="2026-02-01T00:00:00Z"),
                model("old", "chat", criticality="Critical", created="2026-01-01T00:00:00Z"),
            ],
            {"chat": 1},
        ),
        (
            "an unknown criticality falls back to the default",
            [model("a", "chat", criticality="Urgent")],
            {"chat": None},
        ),
        ("no modelName: skipped", [model("a", None)], {}),
    ],
)
def test_model_priorities(
    case: str, models: list[dict[str, Any]], expected: dict[str, int | None]
) -> None:
    table = build_model_table(models, [], "p")
    assert {m: r.priority for m, r in table.models.items()} == expected, case


def test_target_models_with_weights() -> None:
    table = build_model_table(
        [
            model(
                "a",
                "chat",
                targets=[{"name": "chat-v1", "weight": 90}, {"name": "chat-v2", "weight": 10}],
            )
        ],
        [],
        "p",
    )
    route = table.models["chat"]
    assert route.targets == (TargetModel("chat-v1", 90), TargetModel("chat-v2", 10))
    draws = Counter(table.target("chat", i / 1000) for i in range(1000))
    assert draws == {"chat-v1": 900, "chat-v2": 100}
    assert table.target("unknown", 0.5) == "unknown"  # not listed: as the client named it


@pytest.mark.parametrize(
    ("targets", "u", "expected"),
    [
        ((), 0.3, "m"),  # no targets: the model itself
        ((TargetModel("x", 1),), 0.999, "x"),
        ((TargetModel("x", 0), TargetModel("y", 0)), 0.7, "y"),  # all zero: equal
        ((TargetModel("x", 0), TargetModel("y", 5)), 0.0, "y"),  # zero weight never chosen
        ((TargetModel("x", 1), TargetModel("y", 1)), 1.5, "y"),  # out-of-range u is clamped
    ],
)
def test_pick(targets: tuple[TargetModel, ...], u: float, expected: str) -> None:
    assert ModelRoute("m", targets, None, "test").pick(u) == expected


@pytest.mark.parametrize(
    "targets",
    [
        [{"weight": 1}],  # no name
        [{"name": "x", "weight": -1}],
        [{"name": "x", "weight": "10"}],
    ],
)
def test_bad_target_models_skip_the_object_and_say_why(targets: list[dict[str, Any]]) -> None:
    table = build_model_table([model("a", "chat", targets=targets)], [], "p")
    assert table.models == {}
    assert len(table.problems) == 1 and "InferenceModel/a" in table.problems[0]


def test_objectives_give_priority_by_header_then_model() -> None:
    table = build_model_table(
        [model("a", "chat", criticality="Critical")],
        [
            objective("batch", -5),
            objective("urgent", 10),
            objective("unset"),  # priority defaults to 0
            objective("elsewhere", 3, pool="other"),
            objective("bad", "high"),
        ],
        "p",
    )
    assert dict(table.objectives) == {"batch": -5, "urgent": 10, "unset": 0}
    assert table.priority("chat", {OBJECTIVE_HEADER: "batch"}) == -5  # the header wins
    assert table.priority("chat", {OBJECTIVE_HEADER: "nope"}) == 1  # unknown: by model
    assert table.priority("chat", {}) == 1
    assert table.priority("other", {}) is None
    assert table.priority(None, {OBJECTIVE_HEADER: "urgent"}) == 10
    assert table.priorities() == {"chat": 1}
    assert any("InferenceObjective/bad" in p for p in table.problems)


def test_an_interim_objective_with_model_name_gives_that_model_a_priority() -> None:
    table = build_model_table(
        [model("a", "chat", criticality="Critical")],
        [
            objective("o1", -2, modelName="summarize"),
            objective("o2", modelName="chat", criticality="Sheddable"),  # chat: InferenceModel wins
            objective("o3", modelName="translate", criticality="Sheddable"),
        ],
        "p",
    )
    assert table.priorities() == {"chat": 1, "summarize": -2, "translate": -1}


def test_equal_tables_compare_equal() -> None:
    objects = [model("a", "chat", criticality="Critical", targets=[{"name": "x", "weight": 1}])]
    assert build_model_table(objects, [objective("o", 1)], "p") == build_model_table(
        objects, [objective("o", 1)], "p"
    )
