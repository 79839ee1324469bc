from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, ValidationError

import epp.app
from epp.config import EppConfig, load_config, load_endpoints_file

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def test_example_config_loads_and_documents_the_defaults():
    example = load_config(DEPLOY / "epp.example.yaml")
    assert example.endpoints_file == DEPLOY / "endpoints.example.yaml"  # resolved, watched
    pods = load_endpoints_file(example.endpoints_file)
    assert [e.name for e in pods] == ["pod-0", "pod-1", "pod-2"]
    assert example.endpoints == [] and example.log_level == "info"
    assert pods[0].resolved_metrics_url() == "http://127.0.0.1:8001/metrics"
    defaults = EppConfig()
    sections = ("scheduling", "prefix", "datalayer", "server", "flow_control", "discovery")
    for section in (*sections, "replicas", "kv_events", "tokenizers", "adapters"):
        assert getattr(example, section) == getattr(defaults, section), section


def setting_keys(model: type[BaseModel], prefix: str = "") -> set[str]:
    """Every setting of a config model as a dotted key; nested models are walked, and any
    other field (dicts, lists, optional models such as server.tls) is one setting."""
    keys = set()
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            keys |= setting_keys(annotation, f"{prefix}{name}.")
        else:
            keys.add(prefix + name)
    return keys


def yaml_keys(data: dict, model: type[BaseModel], prefix: str = "") -> set[str]:
    """The example's dotted keys, descending only where the model has a nested section (a
    dict-valued setting such as scheduling.weights is one key)."""
    keys = set()
    for name, value in data.items():
        field = model.model_fields.get(name)
        annotation = field.annotation if field is not None else None
        nested = isinstance(annotation, type) and issubclass(annotation, BaseModel)
        if nested and isinstance(value, dict):
            keys |= yaml_keys(value, annotation, f"{prefix}{name}.")
        else:
            keys.add(prefix + name)
    return keys


def test_example_config_lists_every_setting():
    """README: deploy/epp.example.yaml lists every setting. Values are checked above; here
    the key sets, so a setting added to the model and not to the example fails."""
    documented = yaml_keys(yaml.safe_load((DEPLOY / "epp.example.yaml").read_text()), EppConfig)
    settings = setting_keys(EppConfig)
    missing, extra = sorted(settings - documented), sorted(documented - settings)
    assert not missing and not extra, f"missing from the example: {missing}; extra: {extra}"


def test_the_key_walk_sees_nested_sections_and_stops_at_leaves():
    keys = setting_keys(EppConfig)
    assert {"scheduling.balance.enabled", "scheduling.prefill_estimate.per_token_s"} <= keys
    assert {"scheduling.weights", "server.tls", "tokenizers", "endpoints"} <= keys
    assert "scheduling" not in keys and "kv_events.mode" in keys


def test_epp_serve_refuses_an_unknown_scorer_in_one_line(tmp_path, capsys):
    (tmp_path / "epp.yaml").write_text(
        "scheduling:\n  weights: {cache: 0.9, lattency: 0.1}\n"
        "endpoints: [{name: a, address: '127.0.0.1:9'}]\n"
    )
    assert epp.app.main(["--config", str(tmp_path / "epp.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert "lattency" in err and "known: adapter, cache, cost, health, load, prefill, queue" in err


@pytest.mark.parametrize(
    "data",
    [
        {"scheduling": {"max_queu": 20}},
        {"typo": 1},
        {"scheduling": {"max_queue": 0}},
        {"scheduling": {"health_threshold": 1.5}},
        {"endpoints": [{"name": "a", "address": "nohost"}]},
        {"endpoints": [{"name": "a", "address": "1.2.3.4:99999"}]},
        {
            "endpoints": [
                {"name": "a", "address": "1.2.3.4:1"},
                {"name": "a", "address": "1.2.3.4:2"},
            ]
        },
        {
            "endpoints": [
                {"name": "a", "address": "1.2.3.4:1"},
                {"name": "b", "address": "1.2.3.4:1"},
            ]
        },
        {"server": {"stream_chunk_bytes": 100_000}},
        {"scheduling": {"prefill_estimate": {"overhead_s": -0.01}}},
        {"scheduling": {"prefill_estimate": {"per_token_s": float("nan")}}},
        {"scheduling": {"prefill_estimate": {"per_token_s": float("inf")}}},
        {"scheduling": {"prefill_estimate": {"per_tokens_s": 0.0002}}},
        # A cached token dearer than a computed one would make the scorer shun cache hits.
        {"scheduling": {"prefill_estimate": {"per_token_s": 1e-6, "per_cached_token_s": 1e-5}}},
        {"prefill_estimate": {"overhead_s": 0.01}},  # it lives under scheduling
    ],
)
def test_invalid_configs_fail_with_the_path(data):
    with pytest.raises(ValidationError):
        EppConfig.model_validate(data)


def test_overrides_and_endpoints_file(tmp_path):
    (tmp_path / "pods.yaml").write_text("endpoints:\n  - {name: x, address: '127.0.0.1:9'}\n")
    (tmp_path / "epp.yaml").write_text("endpoints_file: pods.yaml\nserver: {grpc_port: 1234}\n")
    config = load_config(tmp_path / "epp.yaml", {"server": {"metrics_port": 9999}})
    assert config.server.grpc_port == 1234 and config.server.metrics_port == 9999
    assert config.endpoints_file == tmp_path / "pods.yaml"  # relative to the config file


def test_a_pool_and_static_endpoints_are_exclusive(tmp_path):
    with pytest.raises(ValidationError, match="exclusive"):
        EppConfig.model_validate(
            {"discovery": {"pool_name": "p"}, "endpoints": [{"name": "a", "address": "1.2.3.4:1"}]}
        )
    with pytest.raises(ValidationError, match="exclusive"):
        EppConfig.model_validate({"discovery": {"pool_name": "p"}, "endpoints_file": "x.yaml"})


def test_non_mapping_files_are_rejected(tmp_path):
    (tmp_path / "bad.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="mapping"):
        load_config(tmp_path / "bad.yaml")


def test_prefill_estimate_defaults_and_enabling_the_scorer(tmp_path):
    estimate = EppConfig().scheduling.prefill_estimate
    # Llama-3.1-8B on one A100: 0.9 s per cold 4,096 tokens, 45 ms fully cached.
    assert estimate.overhead_s + 4096 * estimate.per_token_s == pytest.approx(0.9, abs=0.002)
    cached = estimate.overhead_s + estimate.per_token_s + 4095 * estimate.per_cached_token_s
    assert cached == pytest.approx(0.045, abs=0.004)
    (tmp_path / "epp.yaml").write_text(
        "scheduling:\n"
        "  weights: {cache: 0.30, load: 0.10, queue: 0.05, health: 0.025, adapter: 0.025,"
        " prefill: 0.5}\n"
        "  prefill_estimate: {overhead_s: 0.005, per_token_s: 0.0001, per_cached_token_s: 0}\n"
    )
    scheduling = load_config(tmp_path / "epp.yaml").scheduling
    assert scheduling.weights["prefill"] == 0.5
    assert scheduling.prefill_estimate.per_token_s == 0.0001
    assert scheduling.prefill_estimate.per_cached_token_s == 0.0
