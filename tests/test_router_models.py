"""The Router with a model table from InferenceModel / InferenceObjective objects: target
models chosen by weight (the pod gets a body naming the target), and priorities."""

from __future__ import annotations

import json
from collections import Counter

from helpers import router_with

from epp.datalayer.discovery.models import OBJECTIVE_HEADER, build_model_table
from epp.datalayer.metrics_parser import PodMetrics
from epp.request import IncomingRequest

POOL = "pool"
PODS = [
    {"name": "base", "address": "127.0.0.1:8001"},
    {"name": "other", "address": "127.0.0.1:8002"},
]


def model_object(name: str, model: str, targets=None, criticality=None) -> dict:
    spec: dict = {"modelName": model, "poolRef": {"name": POOL}}
    if targets is not None:
        spec["targetModels"] = [{"name": n, "weight": w} for n, w in targets]
    if criticality is not None:
        spec["criticality"] = criticality
    return {"metadata": {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z"}, "spec": spec}


def objective(name: str, priority: int) -> dict:
    return {"metadata": {"name": name}, "spec": {"priority": priority, "poolRef": {"name": POOL}}}


def routers_pods(router_parts):
    router, store, _index, _metrics = router_parts
    # One pod serves "llama" with adapters v1 and v2 loaded; the other serves "mistral".
    store.scraped(
        store.get("base"),
        PodMetrics(model="llama", running_adapters=frozenset({"llama-v1", "llama-v2"})),
    )
    store.scraped(store.get("other"), PodMetrics(model="mistral"))
    return router, store


def body(model: str, text: str = "hello " * 40) -> bytes:
    return json.dumps({"model": model, "prompt": text, "max_tokens": 7, "x": [1, 2.5]}).encode()


def test_a_target_model_is_served_with_a_body_naming_it_and_other_fields_unchanged():
    router, _store = routers_pods(router_with(PODS))
    router.set_model_table(
        build_model_table([model_object("chat", "chat", [("llama-v1", 1)])], [], POOL)
    )
    routed = router.route_now(
        IncomingRequest(path="/v1/completions", body=body("chat"), request_id="r")
    )
    assert routed.endpoint.name == "base"  # where llama-v1 is
    assert routed.body is not None
    sent = json.loads(routed.body)
    assert sent == {**json.loads(body("chat")), "model": "llama-v1"}
    assert routed.request.model == "chat"  # metrics and logs keep the client's name


def test_targets_are_chosen_by_weight():
    router, _store = routers_pods(router_with(PODS))
    router.set_model_table(
        build_model_table(
            [model_object("chat", "chat", [("llama-v1", 3), ("llama-v2", 1)])], [], POOL
        )
    )
    router.preparation.rng.seed(7)
    served = Counter()
    for i in range(400):
        routed = router.route_now(
            IncomingRequest(path="/v1/completions", body=body("chat"), request_id=f"r{i}")
        )
        served[json.loads(routed.body)["model"]] += 1
        router.complete(routed.token, 200)
    assert set(served) == {"llama-v1", "llama-v2"}
    assert 0.65 < served["llama-v1"] / 400 < 0.85  # 3:1


def test_a_model_not_in_the_table_is_forwarded_untouched():
    router, _store = routers_pods(router_with(PODS))
    router.set_model_table(build_model_table([model_object("llama", "llama")], [], POOL))
    for model in ("mistral", "llama"):  # unlisted; listed without targets
        routed = router.route_now(
            IncomingRequest(path="/v1/completions", body=body(model), request_id=model)
        )
        assert routed.body is None


def _priority(router, model: str, objective: str | None = None) -> int:
    headers = {OBJECTIVE_HEADER: objective} if objective is not None else {}
    prepared = router.prepare(
        IncomingRequest(path="/v1/completions", body=body(model), request_id="r", headers=headers)
    )
    return prepared.priority


def _objectives_table():
    return build_model_table(
        [model_object("batch", "llama", criticality="Sheddable")],
        [objective("interactive", 5), objective("background", -3)],
        POOL,
    )


def test_priority_comes_from_the_objective_header_then_the_models_criticality():
    router, _store = routers_pods(router_with(PODS))
    router.set_model_table(_objectives_table())
    assert _priority(router, "llama") == -1  # Sheddable
    assert _priority(router, "llama", "background") == -3  # an objective may lower it
    assert _priority(router, "mistral", "interactive") == 5  # no priority of its own
    assert _priority(router, "mistral") == 0  # neither: the configured default


def test_a_client_named_objective_cannot_raise_a_models_own_priority():
    """The header is the client's: a Sheddable model's requests stay sheddable."""
    router, _store = routers_pods(router_with(PODS))
    router.set_model_table(_objectives_table())
    assert _priority(router, "llama", "interactive") == -1
    # flow_control.priorities is the model's own priority too.
    router, _store = routers_pods(router_with(PODS, flow_control={"priorities": {"mistral": -2}}))
    router.set_model_table(_objectives_table())
    assert _priority(router, "mistral", "interactive") == -2
    assert _priority(router, "mistral", "background") == -3


def test_objective_may_raise_trusts_the_header():
    router, _store = routers_pods(router_with(PODS, flow_control={"objective_may_raise": True}))
    router.set_model_table(_objectives_table())
    assert _priority(router, "llama", "interactive") == 5
