"""Discovery: which endpoints (and which models) the EPP routes to.

- `KubernetesDiscovery` (kubernetes.py): an InferencePool's (or a label selector's)
  Ready pods, watched; the InferenceModel / InferenceObjective / InferenceModelRewrite
  model table when those CRDs are installed.
- `EndpointsFileWatcher` (file.py): the static endpoints file, watched and reloaded.

Both deliver the whole current `list[EndpointConfig]` to a callback on the asyncio loop
(for `EndpointStore.sync`), and expose `state()` (a `DiscoveryState`) for metrics.
The pure parts, `pool.py` (pool + pods -> endpoints) and `models.py` (objects -> model
table), do no I/O.

`kubernetes.py` and `reflector.py` are imported on their own
(`epp.datalayer.discovery.kubernetes`), so that the Kubernetes client is loaded only when a
pool is configured.
"""

from epp.datalayer.discovery.file import EndpointsFileWatcher
from epp.datalayer.discovery.models import (
    OBJECTIVE_HEADER,
    ModelRoute,
    ModelTable,
    RewriteRule,
    TargetModel,
    build_model_table,
)
from epp.datalayer.discovery.pool import InvalidPool, PoolSpec, endpoints_for_pool, parse_pool
from epp.datalayer.discovery.state import Backoff, DiscoveryState, ResourceStats

__all__ = [
    "OBJECTIVE_HEADER",
    "Backoff",
    "DiscoveryState",
    "EndpointsFileWatcher",
    "InvalidPool",
    "ModelRoute",
    "ModelTable",
    "PoolSpec",
    "ResourceStats",
    "RewriteRule",
    "TargetModel",
    "build_model_table",
    "endpoints_for_pool",
    "parse_pool",
]
