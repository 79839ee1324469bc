"""Endpoint picker for LLM inference."""

__version__ = "0.1.0"
