"""--config-file / --config-text: our configuration, or an upstream EndpointPickerConfig
that is reported as not applied (and refused when it is disaggregated serving)."""

from __future__ import annotations

from typing import Any

import yaml

from epp.upstream_flags.table import UPSTREAM_CONFIG_GROUPS, UPSTREAM_CONFIG_KIND
from epp.upstream_flags.translate import UpstreamArgs


def read_config_source(upstream: UpstreamArgs) -> tuple[dict[str, Any] | None, str | None]:
    """The --config-file / --config-text content: (our config as a mapping, None), or
    (None, a description of the upstream EndpointPickerConfig that is not applied), or
    (None, None) when neither flag was given."""
    if upstream.config_file is not None:
        where = str(upstream.config_file)
        text = upstream.config_file.read_text()
    elif upstream.config_text is not None:
        where, text = "--config-text", upstream.config_text
    else:
        return None, None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{where}: not YAML: {exc}".splitlines()[0]) from None
    if not isinstance(data, dict):
        raise ValueError(f"{where}: the configuration must be a YAML mapping")
    if is_upstream_config(data):
        refuse_disaggregation(data, where)
        return None, f"{where} ({data.get('apiVersion')} {UPSTREAM_CONFIG_KIND})"
    return data, None


# Plugin types of the upstream EPP's disaggregated serving (prefill/decode, encode): the
# pods of one pool play different roles and one request is scheduled on two or three of
# them. This EPP treats every pod of a pool as a full server, so under such a config it
# would send prompts to prefill-only pods; starting would be worse than refusing.
_DISAGGREGATION_MARKERS = ("prefill", "encode-filter", "disagg", "pd-decider")


def refuse_disaggregation(data: dict[str, Any], where: str) -> None:
    """A ValueError (exit 2, one line) for an EndpointPickerConfig this EPP cannot stand in
    for: more than one scheduling profile, or a disaggregation plugin."""
    plugins = data.get("plugins")
    types = sorted(
        {
            str(p.get("type"))
            for p in (plugins if isinstance(plugins, list) else ())
            if isinstance(p, dict)
            and any(marker in str(p.get("type", "")) for marker in _DISAGGREGATION_MARKERS)
        }
    )
    profiles = data.get("schedulingProfiles")
    several = isinstance(profiles, list) and len(profiles) > 1
    if types or several:
        what = ", ".join(types) if types else f"{len(profiles or ())} scheduling profiles"
        raise ValueError(
            f"{where}: a disaggregated-serving EndpointPickerConfig ({what}): this EPP "
            "schedules every pod of the pool as a full server and cannot stand in for it"
        )


def is_upstream_config(data: dict[str, Any]) -> bool:
    """An upstream plugins file (EndpointPickerConfig), not our configuration."""
    if data.get("kind") != UPSTREAM_CONFIG_KIND:
        return False
    group = str(data.get("apiVersion", "")).split("/", 1)[0]
    return group in UPSTREAM_CONFIG_GROUPS or not group
