"""An InferencePool and its pods -> the endpoints to route to. Pure: no I/O, no clock.

The InferencePool (`inference.networking.k8s.io/v1`) names its pods with
`spec.selector.matchLabels` and the ports they serve on with `spec.targetPorts` (1 to 8
entries `{number: N}`). Every pod that matches the selector, is Ready (condition
Ready=True), is not terminating (no `metadata.deletionTimestamp`) and has a
`status.podIP` gives one endpoint per target port:

    name     <pod>            with one target port
             <pod>-rank-<i>   with several (i = the port's index in targetPorts)
    address  podIP:port       ([podIP]:port for IPv6)
    metrics  <scheme>://podIP:<metrics port><path> (`MetricsLocation`: by default
             http://address/metrics; upstream's --model-server-metrics-scheme/-port/-path)
    labels   the pod's labels

`spec.appProtocol` ("http", default: HTTP/1.1; "kubernetes.io/h2c": HTTP/2 cleartext) is
what the gateway speaks to the pods; neither value is TLS, so the scheme of the pods is
`http` for both (`SCHEME`), and so is that of their metrics URL unless told otherwise. Any other value makes the pool
invalid (the CRD's enum admits only these two). `spec.endpointPickerRef` (optional in v1:
name, kind, group, port, failureMode) is the gateway's, not ours: parsed with its CRD
defaults and reported.

The older `inference.networking.x-k8s.io/v1alpha2` pool (`parse_alpha_pool`): a flat
`spec.selector` map, one `spec.targetPortNumber`, and `spec.extensionRef`
(name, portNumber, failureMode); it has no appProtocol (HTTP/1.1).

Objects are the API server's JSON (dicts), as listed or watched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from epp.addresses import format_host_port, is_ip_address
from epp.config import EndpointConfig

MAX_TARGET_PORTS = 8

Obj = Mapping[str, Any]


class InvalidPool(ValueError):
    """The pool object cannot be used (no selector, bad ports): no endpoints until fixed."""


APP_PROTOCOL_HTTP = "http"
APP_PROTOCOL_H2C = "kubernetes.io/h2c"
# appProtocol -> the URL scheme of the pods and of their metrics: both are cleartext.
SCHEME: Mapping[str, str] = {APP_PROTOCOL_HTTP: "http", APP_PROTOCOL_H2C: "http"}
FAILURE_MODES = ("FailOpen", "FailClose")


@dataclass(frozen=True, slots=True)
class MetricsLocation:
    """Where each pod's metrics page is (datalayer.metrics_scheme/_port/_path): `port` 0 is
    the endpoint's own target port, as upstream's --model-server-metrics-port."""

    scheme: str = "http"
    port: int = 0
    path: str = "/metrics"

    def url(self, ip: str, target_port: int) -> str:
        return f"{self.scheme}://{format_host_port(ip, self.port or target_port)}{self.path}"


@dataclass(frozen=True, slots=True)
class EndpointPickerRef:
    """The pool's reference to its EPP (the gateway dials it; we only report it)."""

    name: str
    kind: str = "Service"
    group: str = ""
    port: int | None = None
    failure_mode: str = "FailClose"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": self.kind,
            "group": self.group,
            "port": self.port,
            "failure_mode": self.failure_mode,
        }


@dataclass(frozen=True, slots=True)
class PoolSpec:
    name: str
    selector: tuple[tuple[str, str], ...]  # matchLabels, sorted
    target_ports: tuple[int, ...]
    endpoint_picker_ref: EndpointPickerRef | None = None  # optional in v1
    app_protocol: str = APP_PROTOCOL_HTTP

    @property
    def scheme(self) -> str:
        return SCHEME[self.app_protocol]

    @property
    def label_selector(self) -> str:
        """The selector as the API's `labelSelector` query parameter."""
        return ",".join(f"{key}={value}" for key, value in self.selector)

    def selects(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(key) == value for key, value in self.selector)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _port(name: str, entry: Any, what: str) -> int:
    number = _mapping(entry).get("number") if isinstance(entry, Mapping) else entry
    if isinstance(number, bool) or not isinstance(number, int) or not 0 < number < 65536:
        raise InvalidPool(f"pool {name!r}: bad {what} {entry!r}")
    return number


def _selector(name: str, match_labels: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    if not match_labels:
        # An empty selector would select every pod in the namespace.
        raise InvalidPool(f"pool {name!r}: the pod selector is empty")
    if not all(isinstance(v, str) for v in match_labels.values()):
        raise InvalidPool(f"pool {name!r}: selector label values must be strings")
    return tuple(sorted((str(k), v) for k, v in match_labels.items()))


def _picker_ref(name: str, ref: Any, port_key: str) -> EndpointPickerRef | None:
    if ref is None:
        return None
    ref = _mapping(ref)
    ref_name = ref.get("name")
    if not isinstance(ref_name, str) or not ref_name:
        raise InvalidPool(f"pool {name!r}: the endpoint picker reference has no name")
    failure_mode = ref.get("failureMode") or "FailClose"
    if failure_mode not in FAILURE_MODES:
        raise InvalidPool(f"pool {name!r}: unknown failureMode {failure_mode!r}")
    raw_port = ref.get(port_key)
    port = None if raw_port is None else _port(name, raw_port, "endpoint picker port")
    return EndpointPickerRef(
        name=ref_name,
        kind=str(ref.get("kind") or "Service"),
        group=str(ref.get("group") or ""),
        port=port,
        failure_mode=str(failure_mode),
    )


def parse_pool(obj: Obj) -> PoolSpec:
    """The v1 pool's fields (`inference.networking.k8s.io/v1`); `InvalidPool` says what
    is wrong."""
    metadata = _mapping(obj.get("metadata"))
    name = str(metadata.get("name", ""))
    spec = _mapping(obj.get("spec"))
    selector = _mapping(spec.get("selector"))
    if selector.get("matchExpressions"):
        raise InvalidPool(f"pool {name!r}: selector.matchExpressions is not supported")
    labels = _selector(name, _mapping(selector.get("matchLabels")))
    raw_ports = spec.get("targetPorts")
    if not isinstance(raw_ports, list) or not 1 <= len(raw_ports) <= MAX_TARGET_PORTS:
        raise InvalidPool(
            f"pool {name!r}: spec.targetPorts must list 1 to {MAX_TARGET_PORTS} ports, "
            f"got {raw_ports!r}"
        )
    ports: list[int] = []
    for entry in raw_ports:
        if not isinstance(entry, Mapping):
            raise InvalidPool(f"pool {name!r}: bad target port {entry!r}")
        number = _port(name, entry, "target port")
        if number in ports:
            raise InvalidPool(f"pool {name!r}: target port {number} is listed twice")
        ports.append(number)
    app_protocol = spec.get("appProtocol") or APP_PROTOCOL_HTTP
    if app_protocol not in SCHEME:
        raise InvalidPool(
            f"pool {name!r}: unknown appProtocol {app_protocol!r} (supported: {', '.join(SCHEME)})"
        )
    return PoolSpec(
        name=name,
        selector=labels,
        target_ports=tuple(ports),
        endpoint_picker_ref=_picker_ref(name, spec.get("endpointPickerRef"), "port"),
        app_protocol=app_protocol,
    )


def parse_alpha_pool(obj: Obj) -> PoolSpec:
    """The older pool (`inference.networking.x-k8s.io/v1alpha2`): `spec.selector` is the
    label map itself, one `spec.targetPortNumber`, `spec.extensionRef`."""
    metadata = _mapping(obj.get("metadata"))
    name = str(metadata.get("name", ""))
    spec = _mapping(obj.get("spec"))
    labels = _selector(name, _mapping(spec.get("selector")))
    port = _port(name, spec.get("targetPortNumber"), "spec.targetPortNumber")
    ref = spec.get("extensionRef")
    return PoolSpec(
        name=name,
        selector=labels,
        target_ports=(port,),
        endpoint_picker_ref=_picker_ref(name, ref, "portNumber"),
    )


def parse_label_selector(text: str) -> tuple[tuple[str, str], ...]:
    """`k=v,k2=v2` (`==` too: equality terms only, as Kubernetes writes them) -> sorted
    pairs; ValueError naming the term that is not one."""
    pairs: dict[str, str] = {}
    for term in (t.strip() for t in text.split(",")):
        key, sep, value = term.replace("==", "=").partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not key or "!" in key or " " in key or "=" in value or " " in value:
            raise ValueError(
                f"label selector term {term!r}: only key=value terms are supported (in {text!r})"
            )
        if pairs.get(key, value) != value:
            raise ValueError(f"label selector {text!r}: {key!r} is given two values")
        pairs[key] = value
    return tuple(sorted(pairs.items()))


def standalone_pool(name: str, selector: str, target_ports: Iterable[int]) -> PoolSpec:
    """The pods of a label selector without an InferencePool (upstream's
    `--endpoint-selector` / `--endpoint-target-ports`), as a pool spec; `InvalidPool`."""
    try:
        labels = parse_label_selector(selector)
    except ValueError as exc:
        raise InvalidPool(str(exc)) from None
    ports = list(target_ports)
    if not 1 <= len(ports) <= MAX_TARGET_PORTS or len(set(ports)) != len(ports):
        raise InvalidPool(f"target ports must be 1 to {MAX_TARGET_PORTS} distinct ports: {ports}")
    return PoolSpec(
        name=name,
        selector=_selector(name, dict(labels)),
        target_ports=tuple(_port(name, p, "target port") for p in ports),
    )


def pod_serves(pod: Obj) -> bool:
    """Ready=True, not terminating, and has an IP address (anything else in `podIP` would
    make an endpoint no one can dial, and an address the config refuses)."""
    metadata = _mapping(pod.get("metadata"))
    if metadata.get("deletionTimestamp"):
        return False
    status = _mapping(pod.get("status"))
    pod_ip = status.get("podIP")
    if not isinstance(pod_ip, str) or not is_ip_address(pod_ip):
        return False
    for condition in status.get("conditions") or ():
        condition = _mapping(condition)
        if condition.get("type") == "Ready":
            return condition.get("status") == "True"
    return False


def pod_labels(pod: Obj) -> dict[str, str]:
    labels = _mapping(_mapping(pod.get("metadata")).get("labels"))
    return {str(k): str(v) for k, v in labels.items()}


def endpoints_for_pool(
    pool: PoolSpec, pods: Iterable[Obj], metrics: MetricsLocation | None = None
) -> list[EndpointConfig]:
    """The endpoints of the pool's serving pods, sorted by pod name then rank; each one's
    metrics URL from `metrics` (default: the pool's scheme, the target port, /metrics).

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
            address = format_host_port(ip, port)
            if address in taken:
                continue
            taken.add(address)
            endpoints.append(
                EndpointConfig(
                    name=f"{name}-rank-{rank}" if several else name,
                    address=address,
                    metrics_url=(
                        metrics.url(ip, port)
                        if metrics is not None
                        else f"{pool.scheme}://{address}/metrics"
                    ),
                    labels=labels,
                )
            )
    return endpoints
