"""Presets reproduce the figures they are anchored on, and are usable from Python and the CLI."""

from __future__ import annotations

import pytest

from vllm_sim import presets
from vllm_sim.cli import build_parser, config_from_args
from vllm_sim.engine import EngineConfig

REAL = ("llama-8b-a100", "llama-70b-a100", "llama-8b-h100", "llama-70b-h100")
FULL_HIT_CACHED = 4096 - 16  # the last block is always recomputed


def test_every_required_preset_exists_and_tiny_is_the_old_default() -> None:
    assert set(presets.names()) == {"tiny", *REAL}
    assert presets.get("tiny") == EngineConfig()
    assert presets.preset("tiny").model == "sim-llama-8b"


def test_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="llama-8b-a100"):
        presets.get("llama-405b-tpu")


@pytest.mark.parametrize(
    ("name", "prefill_4096_s"),
    [
        ("llama-8b-a100", 0.9),  # spec
        ("llama-70b-a100", 8.2),  # spec
        ("llama-8b-h100", 0.9 / 2.5),  # spec: H100 2-3x the A100
        ("llama-70b-h100", 8.2 / 2.5),
    ],
)
def test_a_4096_token_prefill_takes_the_specs_time(name: str, prefill_4096_s: float) -> None:
    assert presets.get(name).prefill_seconds(4096) == pytest.approx(prefill_4096_s, rel=0.01)


def test_a_full_cache_hit_on_the_8b_a100_costs_45_ms() -> None:
    config = presets.get("llama-8b-a100")
    assert config.prefill_seconds(4096, FULL_HIT_CACHED) == pytest.approx(0.045)


@pytest.mark.parametrize("name", REAL)
def test_cache_hits_are_much_cheaper_than_misses_but_not_free(name: str) -> None:
    config = presets.get(name)
    hit = config.prefill_seconds(4096, FULL_HIT_CACHED)
    miss = config.prefill_seconds(4096)
    assert 0.02 < hit < miss / 5


@pytest.mark.parametrize("name", ["tiny", *REAL])
@pytest.mark.parametrize(("rank", "load_s"), [(16, 0.2), (64, 0.8), (8, 0.1), (128, 1.6)])
def test_lora_load_time_is_linear_in_rank(name: str, rank: int, load_s: float) -> None:
    assert presets.get(name).lora_load_seconds(rank) == pytest.approx(load_s)


@pytest.mark.parametrize(
    ("model", "tp", "kv_bytes_per_token", "blocks"),
    [
        # (0.9 x 80 GiB - 8.03e9 x 2 B - 5.6 GiB) / 128 KiB / 16
        (presets.LLAMA_31_8B, 1, 128 * 1024, 26_338),
        # per GPU: (0.9 x 80 GiB - 70.6e9 x 2 B / 4 - 5.6 GiB) / (320 KiB / 4) / 16
        (presets.LLAMA_31_70B, 4, 320 * 1024, 27_463),
    ],
)
def test_kv_capacity_arithmetic(
    model: presets.ModelShape, tp: int, kv_bytes_per_token: int, blocks: int
) -> None:
    assert model.kv_bytes_per_token == kv_bytes_per_token
    assert presets.kv_cache_blocks(model, tensor_parallel=tp) == blocks


def test_the_8b_capacity_matches_the_fixture_page_at_its_memory_share() -> None:
    # The fixture (a vLLM 0.33 page for Llama-3.1-8B) reports 27,153 blocks at 0.92; the
    # same arithmetic at 0.92 lands within 0.1% of it.
    extra = 0.02 * presets.GPU_MEMORY_GIB * presets.GIB / presets.LLAMA_31_8B.kv_bytes_per_token
    at_092 = presets.kv_cache_blocks(presets.LLAMA_31_8B, 1) + extra / presets.BLOCK_SIZE
    assert at_092 == pytest.approx(27_153, rel=0.001)


@pytest.mark.parametrize(
    ("a100", "h100"), [("llama-8b-a100", "llama-8b-h100"), ("llama-70b-a100", "llama-70b-h100")]
)
def test_h100_is_faster_with_the_same_memory(a100: str, h100: str) -> None:
    slow, fast = presets.get(a100), presets.get(h100)
    assert 2.0 <= slow.prefill_seconds(4096) / fast.prefill_seconds(4096) <= 3.0
    assert fast.decode_per_token_s == pytest.approx(slow.decode_per_token_s * 2.04 / 3.35)
    assert fast.num_gpu_blocks == slow.num_gpu_blocks


def test_the_70b_is_slower_than_the_8b_on_the_same_gpu() -> None:
    small, big = presets.get("llama-8b-a100"), presets.get("llama-70b-a100")
    assert big.decode_per_token_s > small.decode_per_token_s
    assert big.prefill_seconds(4096) / small.prefill_seconds(4096) == pytest.approx(
        8.2 / 0.9, rel=0.01
    )


def test_cli_preset_sets_engine_and_model_and_flags_override_it() -> None:
    args = build_parser().parse_args(["--preset", "llama-70b-h100", "--max-num-seqs", "32"])
    config = config_from_args(args)
    expected = presets.get("llama-70b-h100")
    assert config.model == "meta-llama/Llama-3.1-70B-Instruct"
    assert config.engine.max_num_seqs == 32
    assert config.engine.num_gpu_blocks == expected.num_gpu_blocks
    assert config.engine.prefill_per_token_s == expected.prefill_per_token_s
    args = build_parser().parse_args(
        ["--preset", "llama-8b-a100", "--model", "m", "--prefill-per-cached-token-ms", "0.5"]
    )
    config = config_from_args(args)
    assert config.model == "m"
    assert config.engine.prefill_per_cached_token_s == pytest.approx(0.0005)


def test_cli_without_preset_is_tiny_with_the_old_model_name() -> None:
    config = config_from_args(build_parser().parse_args([]))
    assert config.engine == EngineConfig()
    assert config.model == "sim-llama-8b"
