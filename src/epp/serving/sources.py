"""Where the service's endpoints come from (an InferencePool or a selector watched in
Kubernetes, or the endpoints file, watched) and its bid for the Lease (leader election).
The Kubernetes client is imported only when a pool is configured."""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING, Any, Protocol

from epp.datalayer.discovery.file import EndpointsFileWatcher
from epp.datalayer.discovery.state import DiscoveryState
from epp.leader import LeaderElector, LeaseTimings

if TYPE_CHECKING:
    from epp.config import EppConfig
    from epp.datalayer.store import EndpointStore
    from epp.routing import Router


class Discovery(Protocol):
    """KubernetesDiscovery or EndpointsFileWatcher."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def state(self) -> DiscoveryState: ...


def make_discovery(
    config: EppConfig, store: EndpointStore, router: Router, kube_client: Any
) -> tuple[Discovery | None, Any]:
    """Discovery for the config (None: the static list in the config, fixed) and the
    Kubernetes API client it uses (made here when `kube_client` is None and a pool is
    configured; leader election uses the same)."""
    discovery = config.discovery
    if discovery.pool_name or discovery.endpoint_selector:
        from epp.datalayer.discovery.kubernetes import make_api_client

        if kube_client is None:
            path = str(discovery.kubeconfig) if discovery.kubeconfig else None
            kube_client = make_api_client(path)
        return _kubernetes(config, store, router, kube_client), kube_client
    if config.endpoints_file is not None:
        watcher = EndpointsFileWatcher(
            config.endpoints_file,
            store.sync,
            static=config.endpoints,
            interval_s=discovery.file_poll_s,
        )
        return watcher, kube_client
    return None, kube_client


def _kubernetes(config: EppConfig, store: EndpointStore, router: Router, client: Any) -> Discovery:
    from epp.datalayer.discovery.kubernetes import KubernetesDiscovery, default_namespace
    from epp.datalayer.discovery.pool import MetricsLocation, standalone_pool

    discovery, datalayer = config.discovery, config.datalayer
    standalone = None
    if discovery.endpoint_selector:
        standalone = standalone_pool(
            "standalone", discovery.endpoint_selector, discovery.target_ports
        )
    return KubernetesDiscovery(
        client,
        discovery.pool_name or "standalone",
        discovery.pool_namespace or default_namespace(),
        on_endpoints=store.sync,
        on_models=router.set_model_table,
        read_models=discovery.read_models,
        pool_group=discovery.pool_group,
        standalone=standalone,
        metrics=MetricsLocation(
            datalayer.metrics_scheme, datalayer.metrics_port, datalayer.metrics_path
        ),
    )


def make_leader_elector(
    config: EppConfig, kube_client: Any, timings: LeaseTimings | None
) -> LeaderElector | None:
    """With discovery.leader_election: a bid for the Lease in the pool's namespace,
    named as upstream names it, on discovery's API client."""
    discovery = config.discovery
    if not discovery.leader_election:
        return None
    from epp.datalayer.discovery.kubernetes import default_namespace
    from epp.leader import KubernetesLeases, holder_identity, lease_name

    namespace = discovery.pool_namespace or default_namespace()
    pod = os.environ.get("POD_NAME") or socket.gethostname()  # a Pod's host name is its name
    name = discovery.leader_election_lease or lease_name(namespace, discovery.pool_name, pod)
    return LeaderElector(
        KubernetesLeases(kube_client),
        namespace,
        name,
        holder_identity(pod),
        timings=timings,
    )
