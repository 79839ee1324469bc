"""Where the pods come from: static endpoints or Kubernetes discovery."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from epp.addresses import AddressError, parse_host_port
from epp.config.base import Strict


class EndpointConfig(Strict):
    name: str = Field(min_length=1)
    address: str = Field(description="ip:port Envoy connects to ([fd00::1]:8000 for IPv6)")
    metrics_url: str | None = None
    model: str | None = Field(None, description="base model served; learned from metrics if unset")
    labels: dict[str, str] = Field(default_factory=dict)

    @field_validator("address")
    @classmethod
    def _ip_port(cls, address: str) -> str:
        try:
            parse_host_port(address)
        except AddressError as exc:
            raise ValueError(f"address must be host:port ({exc})") from None
        return address

    def resolved_metrics_url(self) -> str:
        return self.metrics_url or f"http://{self.address}/metrics"


class DiscoveryConfig(Strict):
    """Where the endpoints come from: an InferencePool (`pool_name`), or the pods of a
    label selector (`endpoint_selector` + `target_ports`, no InferencePool), or else the
    static `endpoints` / `endpoints_file` (watched and reloaded)."""

    pool_name: str | None = Field(None, min_length=1)
    # Default: the EPP pod's own namespace (its service account's), else "default".
    pool_namespace: str | None = Field(None, min_length=1)
    # The pool's API group (--pool-group): v1 `inference.networking.k8s.io`, or the older
    # v1alpha2 `inference.networking.x-k8s.io`.
    pool_group: Literal["inference.networking.k8s.io", "inference.networking.x-k8s.io"] = (
        "inference.networking.k8s.io"
    )
    # Outside a cluster: the kubeconfig to use (default: $KUBECONFIG or ~/.kube/config).
    kubeconfig: Path | None = None
    # Read InferenceModel / InferenceObjective / InferenceModelRewrite objects of the pool
    # when their CRDs exist.
    read_models: bool = True
    file_poll_s: float = Field(1.0, gt=0.0)
    # Standalone, without an InferencePool (upstream's --endpoint-selector and
    # --endpoint-target-ports): the Ready pods matching this label selector (`k=v,k2=v2`,
    # equality terms only) in pool_namespace, one endpoint per target port (1 to 8). No
    # model CRD is read then, as upstream.
    endpoint_selector: str | None = Field(None, min_length=1)
    target_ports: list[int] = Field(default_factory=list)
    # One active replica among several (upstream's --ha-enable-leader-election): the
    # replica holding a coordination.k8s.io/v1 Lease in pool_namespace answers the health
    # names readiness, "" and the ext_proc service's; the others stand by (epp/leader.py).
    # Needs Kubernetes discovery and a Role granting get/create/update on leases.
    leader_election: bool = False
    # The Lease; default upstream's `epp-<pool_namespace>-<pool_name>.llm-d.ai` (standalone:
    # the EPP Deployment's name, from $POD_NAME, in place of the pool's).
    leader_election_lease: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _leader_election_needs_kubernetes(self) -> DiscoveryConfig:
        if self.leader_election and not (self.pool_name or self.endpoint_selector):
            raise ValueError(
                "discovery.leader_election needs Kubernetes discovery (discovery.pool_name "
                "or endpoint_selector): its Lease lives in the API server"
            )
        return self

    @model_validator(mode="after")
    def _standalone(self) -> DiscoveryConfig:
        if self.endpoint_selector is None:
            if self.target_ports:
                raise ValueError("discovery.target_ports needs discovery.endpoint_selector")
            return self
        if self.pool_name:
            raise ValueError(
                "discovery.pool_name and discovery.endpoint_selector are exclusive: an "
                "InferencePool, or the pods of a label selector"
            )
        # Imported here: the discovery package imports this module.
        from epp.datalayer.discovery.pool import InvalidPool, standalone_pool

        try:
            standalone_pool("standalone", self.endpoint_selector, self.target_ports)
        except InvalidPool as exc:
            raise ValueError(f"discovery.endpoint_selector/target_ports: {exc}") from None
        return self
