"""Reading the configuration: the YAML file, command-line overrides, the endpoints file."""

from __future__ import annotations

from pathlib import Path

import yaml

from epp.config.discovery import EndpointConfig
from epp.config.root import EppConfig


def load_endpoints_file(path: Path) -> list[EndpointConfig]:
    """Static discovery: a YAML file with `endpoints: [{name, address, metrics_url, labels}]`."""
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict) or not isinstance(data.get("endpoints", []), list):
        raise ValueError(f"{path}: expected a mapping with an 'endpoints' list")
    return [EndpointConfig.model_validate(item) for item in data.get("endpoints", [])]


def load_config(path: Path | None = None, overrides: dict | None = None) -> EppConfig:
    """Read the YAML file (if any), apply overrides (nested dict), resolve the endpoints file."""
    data: dict = {}
    if path is not None:
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: the configuration must be a YAML mapping")
        data = loaded
    for section, values in (overrides or {}).items():
        if isinstance(values, dict):
            data.setdefault(section, {}).update(values)
        else:
            data[section] = values
    config = EppConfig.model_validate(data)
    if config.endpoints_file is not None and not config.endpoints_file.is_absolute():
        # Relative to the configuration file: the app watches it (discovery/file.py).
        base = path.parent if path is not None else Path.cwd()
        config = EppConfig.model_validate(
            {**config.model_dump(), "endpoints_file": (base / config.endpoints_file).absolute()}
        )
    return config
