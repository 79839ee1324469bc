"""What the demo, the benchmarks and the end-to-end tests share.

- `stack`: `LocalStack` starts simulated pods, the EPP (optional) and Envoy on loopback.
- `sse`: `read_stream` reads one streamed OpenAI-style response (TTFT, reply, usage).
- `stats`: `percentile` and `prefix_hit_rate` (the pods' own hit rate between two scrapes).
"""
