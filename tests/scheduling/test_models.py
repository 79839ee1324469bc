"""Which base model and adapter a request's `model` names: the configured adapters map
first, then a base model some pod serves, then an adapter some pod reported."""

from __future__ import annotations

from helpers import endpoint

from epp.scheduling.models import resolve_model


def test_no_model_named_is_no_model():
    assert resolve_model(None, {"sql": "llama"}, [endpoint("a", model="llama")]) == (None, None)


def test_the_configured_adapters_map_comes_first():
    pods = [endpoint("a", model="sql")]  # even a pod serving a base model of that name
    assert resolve_model("sql", {"sql": "llama"}, pods) == ("llama", "sql")


def test_a_base_model_some_pod_serves_is_a_base_model_request():
    pods = [
        endpoint("a", model="other", adapters=frozenset({"llama"})),
        endpoint("b", model="llama"),
    ]
    assert resolve_model("llama", {}, pods) == ("llama", None)


def test_an_adapter_a_pod_reported_runs_on_the_first_such_pods_base_model():
    pods = [
        endpoint("unknown", model=None, adapters=frozenset({"sql"})),  # no base model known
        endpoint("a", model="llama", adapters=frozenset({"sql"})),
        endpoint("b", model="mistral", adapters=frozenset({"sql"})),
    ]
    assert resolve_model("sql", {}, pods) == ("llama", "sql")


def test_a_name_nobody_knows_stays_a_base_model_request():
    pods = [endpoint("a", model="llama", adapters=frozenset({"chat"}))]
    assert resolve_model("gpt-9", {}, pods) == ("gpt-9", None)
