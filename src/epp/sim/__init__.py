"""A simulated vLLM pod, for tests, demos and benchmarks without GPUs.

- `engine`: the pure model (queue, running slots, KV blocks with prefix reuse and LRU
  eviction, LoRA slots, latency in engine seconds); no I/O, no clock.
- `server`: the aiohttp app around one engine (`create_app`, `start_pod`).
- `metrics_page`: /metrics in vLLM 0.33's format.
- `cli`: `epp sim`.
"""
