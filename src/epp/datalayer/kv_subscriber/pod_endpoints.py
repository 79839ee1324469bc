"""Where one pod's KV events come from: the configured templates and per-pod labels resolved
to a mode, a publisher endpoint, a replay endpoint and a topic filter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from epp.addresses import split_host_port, url_host

if TYPE_CHECKING:
    from epp.config import KvEventsConfig

# Endpoint labels that override the templates for one pod (static endpoint files: several
# pods on one host need their own ports; Kubernetes pods each have their own IP and use
# the templates).
LABEL_MODE = "kv_events_mode"
LABEL_ENDPOINT = "kv_events_endpoint"
LABEL_REPLAY = "kv_events_replay"
LABEL_TOPIC = "kv_events_topic"


def format_endpoint(template: str, address: str, model: str | None, name: str) -> str | None:
    """A configured template (`tcp://{host}:5557`, `kv@{host}:{port}@{model}`) for one pod
    whose `address` is ip:port; None if it names the model and the model is unknown."""
    if model is None and "{model}" in template:
        return None
    host, port = split_address(address)
    if "[{host}]" not in template:
        host = url_host(host)  # an IPv6 address in a URL: tcp://[fd00::1]:5557
    return template.format(host=host, port=port, model=model or "", name=name)


def split_address(address: str) -> tuple[str, str]:
    """(host, port) of the pod's `ip:port` for a template: an IPv6 host without its
    brackets, and "" for the port of an address that has none (epp.addresses)."""
    host, port = split_host_port(address)
    return host, "" if port is None else str(port)


def topic_prefix(template: str, address: str, model: str | None, name: str) -> str:
    """The topic filter for a pod: the template formatted, cut where `{model}` starts when
    the model is not known yet (ZMQ filters by prefix, so this still selects the pod)."""
    if model is None and "{model}" in template:
        template = template.split("{model}", 1)[0]
    host, port = split_address(address)
    return template.format(host=host, port=port, model=model or "", name=name)


@dataclass(frozen=True, slots=True)
class PodKvEvents:
    """Where one pod's events come from, resolved from the config and its labels."""

    mode: Literal["auto", "approximate", "precise"]
    endpoint: str | None  # None: approximate (or the template needs the unknown model)
    replay_endpoint: str | None
    topic: str


def resolve_pod(
    config: KvEventsConfig,
    name: str,
    address: str,
    model: str | None,
    labels: dict[str, str] | None = None,
) -> PodKvEvents:
    """The pod's mode (label `kv_events_mode`, else `pod_modes[name]`, else `mode`) and
    endpoints (labels `kv_events_endpoint` / `kv_events_replay` ("" for none) /
    `kv_events_topic`, else the templates)."""
    labels = labels or {}
    mode = labels.get(LABEL_MODE) or config.mode_of(name)
    if mode not in ("auto", "approximate", "precise"):
        mode = config.mode_of(name)
    if mode == "approximate":
        return PodKvEvents("approximate", None, None, "")
    endpoint = labels.get(LABEL_ENDPOINT) or format_endpoint(config.endpoint, address, model, name)
    if LABEL_REPLAY in labels:
        replay = labels[LABEL_REPLAY] or None
    elif config.replay_endpoint is None:
        replay = None
    else:
        replay = format_endpoint(config.replay_endpoint, address, model, name)
    topic = labels.get(LABEL_TOPIC)
    if topic is None:
        topic = topic_prefix(config.topic, address, model, name)
    return PodKvEvents(mode, endpoint, replay, topic)  # type: ignore[arg-type]
