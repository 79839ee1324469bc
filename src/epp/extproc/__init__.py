"""Envoy ext_proc: the per-stream state machine (sans I/O) and the grpc.aio server."""
