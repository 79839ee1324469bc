"""Prometheus metrics and structured logs."""
