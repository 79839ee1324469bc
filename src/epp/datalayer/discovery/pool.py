"""An InferencePool and its pods -> the endpoints to route to. Pure: no I/O, no clock.

The InferencePool (`inference.networking.k8s.io/v1`) names its pods with
`spec.selector.matchLabels` and the ports they serve on with `spec.targetPorts` (1 to 8
entries `{number: N}`). Every pod that matches the selector, is Ready (condition
Ready=True), is not terminating (no `metadata.deletionTimestamp`) and has a
`status.podIP` gives one endpoint per target port:

    name     <pod>            with one target port
             <pod>-rank-<i>   with several (i = the port's index in targetPorts)
    address  podIP:port       ([podIP]:port for IPv6)
    metrics  http://address/metrics
    labels   the pod's labels

Objects are the API server's JSON (dicts), as listed or watched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from epp.config import EndpointConfig

MAX_TARGET_PORTS = 8

Obj = Mapping[str, Any]


class InvalidPool(ValueError):
    """The pool object cannot be used (no selector, bad ports): no endpoints until fixed."""


@dataclass(frozen=True, slots=True)
class PoolSpec:
    name: str
    selector: tuple[tuple[str, str], ...]  # matchLabels, sorted
    target_ports: tuple[int, ...]
    endpoint_picker_ref: Mapping[str, Any] | None = None  # optional in v1; logged only

    @property
    def label_selector(self) -> str:
        """The selector as the API's `labelSelector` query parameter."""
        return ",".join(f"{key}={value}" for key, value in self.selector)

    def selects(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in self.selector)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def parse_pool(obj: Obj) -> PoolSpec:
    """The parts of an InferencePool discovery uses; `InvalidPool` says what is wrong."""
    metadata = _mapping(obj.get("metadata"))
    name = str(metadata.get("name", ""))
    spec = _mapping(obj.get("spec"))
    selector = _mapping(spec.get("selector"))
    match_labels = _mapping(selector.get("matchLabels"))
    if selector.get("matchExpressions"):
        raise InvalidPool(f"pool {name!r}: selector.matchExpressions is not supported")
    if not match_labels:
        # An empty selector would select every pod in the namespace.
        raise InvalidPool(f"pool {name!r}: spec.selector.matchLabels is empty")
    if not all(isinstance(v, str) for v in match_labels.values()):
        raise InvalidPool(f"pool {name!r}: selector.matchLabels values must be strings")
    raw_ports = spec.get("targetPorts")
    if not isinstance(raw_ports, list) or not 1 <= len(raw_ports) <= MAX_TARGET_PORTS:
        raise InvalidPool(
            f"pool {name!r}: spec.targetPorts must list 1 to {MAX_TARGET_PORTS} ports, "
            f"got {raw_ports!r}"
        )
    ports: list[int] = []
    for entry in raw_ports:
        number = _mapping(entry).get("number")
        if isinstance(number, bool) or not isinstance(number, int) or not 0 < number < 65536:
            raise InvalidPool(f"pool {name!r}: bad target port {entry!r}")
        if number in ports:
            raise InvalidPool(f"pool {name!r}: target port {number} is listed twice")
        ports.append(number)
    ref = spec.get("endpointPickerRef")
    return PoolSpec(
        name=name,
        selector=tuple(sorted((str(k), v) for k, v in match_labels.items())),
        target_ports=tuple(ports),
        endpoint_picker_ref=ref if isinstance(ref, Mapping) else None,
    )


def pod_serves(pod: Obj) -> bool:
    """Ready=True, not terminating, and has an IP."""
    metadata = _mapping(pod.get("metadata"))
    if metadata.get("deletionTimestamp"):
        return False
    status = _mapping(pod.get("status"))
    if not status.get("podIP"):
        return False
    for condition in status.get("conditions") or ():
        condition = _mapping(condition)
        if condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def pod_labels(pod: Obj) -> dict[str, str]:
    labels = _mapping(_mapping(pod.get("metadata")).get("labels"))
    return {str(k): str(v) for k, v in labels.items()}


def _address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def endpoints_for_pool(pool: PoolSpec, pods: Iterable[Obj]) -> list[EndpointConfig]:
    """The endpoints of the pool's serving pods, sorted by pod name then rank.

    A pod whose IP:port another pod (earlier by name) already gives is skipped: two pods
    cannot be told apart by Envoy (host-network pods on one node)."""
    by_name: dict[str, Obj] = {}
    for pod in pods:
        name = _mapping(pod.get("metadata")).get("name")
        if isinstance(name, str) and name:
            by_name[name] = pod
    endpoints: list[EndpointConfig] = []
    taken: set[str] = set()
    several = len(pool.target_ports) > 1
    for name in sorted(by_name):
        pod = by_name[name]
        labels = pod_labels(pod)
        if not pool.selects(labels) or not pod_serves(pod):
            continue
        ip = str(_mapping(pod.get("status")).get("podIP"))
        for rank, port in enumerate(pool.target_ports):
            address = _address(ip, port)
            if address in taken:
                continue
            taken.add(address)
            endpoints.append(
                EndpointConfig(
                    name=f"{name}-rank-{rank}" if several else name,
                    address=address,
                    metrics_url=f"http://{address}/metrics",
                    labels=labels,
                )
            )
    return endpoints
