"""Discovery: which endpoints (and which models) the EPP routes to.

- `KubernetesDiscovery` (kubernetes.py): an InferencePool's Ready pods, watched; the
  InferenceModel/InferenceObjective model table when those CRDs are installed.
- `EndpointsFileWatcher` (file.py): the static endpoints file, watched and reloaded.

Both deliver the whole current `list[EndpointConfig]` to a callback on the asyncio loop
(for `EndpointStore.sync`), and expose `state()` (a `DiscoveryState`) for metrics.
The pure parts, `pool.py` (pool + pods -> endpoints) and `models.py` (objects -> model
table), do no I/O.
"""

from epp.datalayer.discovery.file import EndpointsFileWatcher
from epp.datalayer.discovery.kubernetes import (
    KubernetesDiscovery,
    crd_installed,
    default_namespace,
    make_api_client,
)
from epp.datalayer.discovery.models import (
    OBJECTIVE_HEADER,
    ModelRoute,
    ModelTable,
    TargetModel,
    build_model_table,
)
from epp.datalayer.discovery.pool import InvalidPool, PoolSpec, endpoints_for_pool, parse_pool
from epp.datalayer.discovery.reflector import WatchSettings
from epp.datalayer.discovery.state import Backoff, DiscoveryState, ResourceStats

__all__ = [
    "OBJECTIVE_HEADER",
    "Backoff",
    "DiscoveryState",
    "EndpointsFileWatcher",
    "InvalidPool",
    "KubernetesDiscovery",
    "ModelRoute",
    "ModelTable",
    "PoolSpec",
    "ResourceStats",
    "TargetModel",
    "WatchSettings",
    "build_model_table",
    "crd_installed",
    "default_namespace",
    "endpoints_for_pool",
    "make_api_client",
    "parse_pool",
]
