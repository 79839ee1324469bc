"""A simulated vLLM pod, for tests, demos and benchmarks without GPUs.

- `engine`: the pure model (queue, running slots, KV blocks with prefix reuse and LRU
  eviction, LoRA slots with rank-dependent loads, latency in engine seconds, KV-cache
  events queued for the driver); no I/O, no clock.
- `presets`: engine configurations for Llama-3.1 8B/70B on A100/H100, with sources.
- `kv_cache`, `lora_slots`: the block pool and the adapter slots the engine uses.
- `tokenizer`: the simulated model's tokenizer (regex pieces, hashed ids) and Llama 3's
  chat template; `hashing`: vLLM's chained block hashes (SHA-256, NONE_HASH seed, LoRA
  name and cache_salt as extra keys).
- `latency`: per-request histograms with vLLM's buckets.
- `kv_events`: vLLM's KV-event types and msgpack wire format; `kv_publisher`: ZMQ PUB
  and replay ROUTER.
- `failures`: what to inject (header, random rate, pod-wide switches).
- `openai_request`, `openai_response`, `openai_errors`: request bodies to tokens and
  block hashes (`engine_prompt`, also used by the virtual-time benchmark), response
  bodies and SSE chunks, vLLM's error shape.
- `server`: the aiohttp app around one engine (`create_app`, `start_pod`), with
  `lora_admin` (runtime LoRA endpoints) and `served_models`.
- `metrics_page`: /metrics in vLLM 0.33's format.
- `cli`: `epp sim` (or `python -m vllm_sim`).

The package imports nothing from the router (`epp`): its tokens and block hashes are its
own, so a router matches a simulated pod's cache only from what it can observe, as it
would a real vLLM pod's.
"""
