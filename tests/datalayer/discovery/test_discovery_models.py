"""InferenceModel / InferenceObjective / InferenceModelRewrite objects -> the model table,
table-driven; the upstream examples admitted through their upstream CRDs."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from kube_standin import admitted, upstream_objects

from epp.datalayer.discovery.models import (
    OBJECTIVE_HEADER,
    OLD_OBJECTIVE_HEADER,
    ModelRoute,
    ModelTable,
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


# --- InferenceModelRewrite (semantics of llm-d router v0.10.0's modelrewritestore.go and
# director.go), on the upstream examples admitted through their CRDs ---------------------

POOL = "vllm-qwen3-32b"  # the pool the upstream examples name
ROLLOUT = "gie-v1.5.0/docs/adapter-rollout.md"
REWRITE_DOC = "gie-v1.5.0/docs/inferencemodelrewrite.md"
GIE_REWRITE = "inference.networking.x-k8s.io/v1alpha2"
LLMD_REWRITE = "llm-d.ai/v1alpha2"


def rewrite_example(path: str, name: str, api_version: str = GIE_REWRITE) -> dict[str, Any]:
    """An upstream InferenceModelRewrite example in `api_version`'s group, admitted (two
    of the examples in GIE's API page carry `inference.networking.k8s.io/v1alpha2`, a
    group that serves no rewrites: the group is set here)."""
    (obj,) = [
        o for o in upstream_objects(path, "InferenceModelRewrite") if o["metadata"]["name"] == name
    ][:1]
    return admitted({**obj, "apiVersion": api_version})


def aged(obj: dict[str, Any], created: str, name: str | None = None) -> dict[str, Any]:
    metadata = {**obj["metadata"], "creationTimestamp": created}
    if name is not None:
        metadata["name"] = name
    return {**obj, "metadata": metadata}


def rewrite(
    name: str, rules: list[dict[str, Any]], created: str, *, pool: str = POOL, **ref: Any
) -> dict[str, Any]:
    obj = {
        "apiVersion": LLMD_REWRITE,
        "kind": "InferenceModelRewrite",
        "metadata": {"name": name},
        "spec": {"poolRef": {"name": pool, **ref}, "rules": rules},
    }
    return aged(admitted(obj), created)


def exact(model: str, *targets: tuple[str, int | None]) -> dict[str, Any]:
    return {"matches": [{"model": {"value": model}}], "targets": _targets(targets)}


def generic(*targets: tuple[str, int | None]) -> dict[str, Any]:
    return {"targets": _targets(targets)}


def _targets(targets: tuple[tuple[str, int | None], ...]) -> list[dict[str, Any]]:
    return [{"modelRewrite": m, **({} if w is None else {"weight": w})} for m, w in targets]


def shares(table: ModelTable, model: str, n: int = 1000, **kw: Any) -> Counter[str]:
    return Counter(table.target(model, i / n, **kw) for i in range(n))


def rewrites_table(*objs: dict[str, Any], pool: str = POOL) -> ModelTable:
    return build_model_table([], [], pool, rewrites=objs)


def test_the_canary_rollout_splits_by_weight() -> None:
    # Both rollout steps of GIE's adapter-rollout guide have one name: take the second.
    (_, canary) = upstream_objects(ROLLOUT, "InferenceModelRewrite")
    table = rewrites_table(admitted(canary))
    assert shares(table, "small-segment-lora") == {
        "small-segment-lora-v1": 900,
        "small-segment-lora-v2": 100,
    }
    assert table.target("another-model", 0.5) == "another-model"  # no rule: unchanged
    assert table.rule("small-segment-lora") is not None and table.problems == ()


def test_an_alias_and_a_generic_fallback() -> None:
    alias = rewrite_example(REWRITE_DOC, "small-segment-lora-alias")
    fallback = rewrite_example(REWRITE_DOC, "generic-fallback")
    table = rewrites_table(alias, fallback)
    assert table.target("small-segment-lora", 0.3) == "small-segment-lora-v1"
    assert table.target("anything-else", 0.3) == "Qwen/Qwen3-32B"  # matches: [] is every model


@pytest.mark.parametrize(
    ("case", "objs", "model", "expected"),
    [
        (
            "an exact rule beats a generic one, even an older object's",
            [
                rewrite("old", [generic(("fallback", None))], "2026-01-01T00:00:00Z"),
                rewrite("new", [exact("m", ("exact", None))], "2026-02-01T00:00:00Z"),
            ],
            "m",
            "exact",
        ),
        (
            "two exact rules: the oldest object wins",
            [
                rewrite("new", [exact("m", ("from-new", None))], "2026-02-01T00:00:00Z"),
                rewrite("old", [exact("m", ("from-old", None))], "2026-01-01T00:00:00Z"),
            ],
            "m",
            "from-old",
        ),
        (
            "two generic rules: the oldest object wins",
            [
                rewrite("new", [generic(("from-new", None))], "2026-02-01T00:00:00Z"),
                rewrite("old", [generic(("from-old", None))], "2026-01-01T00:00:00Z"),
            ],
            "m",
            "from-old",
        ),
        (
            "within one object: the first rule in list order",
            [
                rewrite(
                    "one",
                    [exact("m", ("first", None)), exact("m", ("second", None))],
                    "2026-01-01T00:00:00Z",
                )
            ],
            "m",
            "first",
        ),
        (
            "a rule with several matches matches any of them (OR)",
            [
                rewrite(
                    "one",
                    [
                        {
                            "matches": [{"model": {"value": "a"}}, {"model": {"value": "m"}}],
                            "targets": [{"modelRewrite": "either"}],
                        }
                    ],
                    "2026-01-01T00:00:00Z",
                )
            ],
            "m",
            "either",
        ),
        (
            "another pool's rewrite does not count",
            [rewrite("x", [generic(("no", None))], "2026-01-01T00:00:00Z", pool="other")],
            "m",
            "m",
        ),
        (
            "a pool of the same name in another group does not count",
            [
                rewrite(
                    "x",
                    [generic(("no", None))],
                    "2026-01-01T00:00:00Z",
                    group="inference.networking.x-k8s.io",
                )
            ],
            "m",
            "m",
        ),
    ],
)
def test_rewrite_precedence(
    case: str, objs: list[dict[str, Any]], model: str, expected: str
) -> None:
    assert rewrites_table(*objs).target(model, 0.5) == expected, case


def test_rewrite_weights_as_the_reference_draws_them() -> None:
    unweighted = rewrites_table(
        rewrite("u", [exact("m", ("a", None), ("b", None))], "2026-01-01T00:00:00Z")
    )
    assert shares(unweighted, "m") == {"a": 500, "b": 500}  # none weighted: equal shares
    # Mixed (the rewrite CRD allows it): targets without a weight are never chosen.
    mixed = rewrites_table(
        rewrite("x", [exact("m", ("a", None), ("b", 3), ("c", 1))], "2026-01-01T00:00:00Z")
    )
    assert shares(mixed, "m") == {"b": 750, "c": 250}


def test_the_rewrite_header_applies_only_where_no_rule_does() -> None:
    table = rewrites_table(rewrite("r", [exact("m", ("ruled", None))], "2026-01-01T00:00:00Z"))
    header = {"x-llm-d-model-name-rewrite": "from-header"}
    assert table.target("other", 0.5, headers=header) == "from-header"
    assert table.target("other", 0.5, headers={"x-gateway-model-name-rewrite": "old"}) == "old"
    assert table.target("m", 0.5, headers=header) == "ruled"  # a rule overrides the header
    assert table.target("other", 0.5, headers={}) == "other"


def test_an_exact_rewrite_beats_an_inference_models_targets_a_generic_one_does_not() -> None:
    table = build_model_table(
        [model("im", "chat", targets=[{"name": "chat-im", "weight": 1}])],
        [],
        "p",
        rewrites=[
            rewrite("g", [generic(("generic", None))], "2026-01-01T00:00:00Z", pool="p"),
        ],
    )
    assert table.target("chat", 0.5) == "chat-im"
    assert table.target("other", 0.5) == "generic"
    with_exact = build_model_table(
        [model("im", "chat", targets=[{"name": "chat-im", "weight": 1}])],
        [],
        "p",
        rewrites=[rewrite("e", [exact("chat", ("exact", None))], "2026-01-01T00:00:00Z", pool="p")],
    )
    assert with_exact.target("chat", 0.5) == "exact"


def test_an_unusable_rule_is_skipped_and_said() -> None:
    obj = rewrite("r", [exact("m", ("ok", None))], "2026-01-01T00:00:00Z")
    obj["spec"]["rules"].insert(0, {"matches": [{"model": {"value": "m"}}]})  # no targets
    table = rewrites_table(obj)
    assert table.target("m", 0.5) == "ok"
    assert table.problems == ("InferenceModelRewrite/r#0: no targets; rule skipped",)


# --- InferenceObjective: the upstream examples in both groups -----------------------


@pytest.mark.parametrize(
    "path",
    [
        "gie-v1.5.0/manifests/inferenceobjective.yaml",
        "llm-d-router-v0.10.0/manifests/inferenceobjective.yaml",
    ],
)
def test_the_upstream_objectives(path: str) -> None:
    objs = [admitted(o) for o in upstream_objects(path, "InferenceObjective")]
    table = build_model_table([], objs, POOL)
    assert dict(table.objectives) == {"small-segment-lora": 1, "base-model": 2, "base-model-cpu": 2}
    assert table.priority(None, {"x-llm-d-inference-objective": "base-model"}) == 2
    assert table.priority(None, {"x-gateway-inference-objective": "small-segment-lora"}) == 1
    # The current header first when a request carries both.
    both = {"x-llm-d-inference-objective": "base-model", OLD_OBJECTIVE_HEADER: "small-segment-lora"}
    assert table.priority(None, both) == 2
    # A pool of that name in the older group is another pool.
    assert (
        build_model_table([], objs, POOL, pool_group="inference.networking.x-k8s.io").objectives
        == {}
    )


def test_the_upstream_inference_models() -> None:
    objs = [admitted(o) for o in upstream_objects("gie-v0.5.0/manifests/inferencemodel.yaml")]
    table = build_model_table(objs, [], "vllm-llama3-8b-instruct")
    assert table.target("food-review", 0.5) == "food-review-1"
    assert table.priorities() == {
        "food-review": 0,
        "meta-llama/Llama-3.1-8B-Instruct": 1,
        "Qwen/Qwen2.5-1.5B-Instruct": 1,
    }
