"""Benchmarks: the field's workloads, virtual-time and live runners, baselines, reports."""
