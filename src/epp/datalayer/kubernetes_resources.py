"""The Kubernetes resources the EPP reads, in one list.

Discovery reads exactly these, and nothing else; the RBAC in `deploy/kubernetes/` and in
the Helm chart grants exactly these (a test compares them). Optional resources are read
only when their CRD is installed (found through API discovery, which needs no RBAC).

Which pool CRD is read follows `discovery.pool_group` (`--pool-group`): the GA
`inference.networking.k8s.io/v1` InferencePool (default), or the older
`inference.networking.x-k8s.io/v1alpha2` one. InferenceObjective and
InferenceModelRewrite exist in two groups: `llm-d.ai` (the llm-d router since v0.9) and
`inference.networking.x-k8s.io` (GIE); when both are served, only `llm-d.ai` is used, as
the reference EPP does.

With leader election (`discovery.leader_election`, epp/leader.py) the EPP also writes one
object: its Lease (LEADER_ELECTION_RESOURCES x LEASE_VERBS), granted only then.
"""

from __future__ import annotations

from dataclasses import dataclass

# Read-only: the EPP never writes what it watches.
VERBS: tuple[str, ...] = ("get", "list", "watch")

POOL_GROUP = "inference.networking.k8s.io"  # the GA InferencePool's group (default)
ALPHA_POOL_GROUP = "inference.networking.x-k8s.io"  # GIE before v1.0 (v1alpha2 pool)
GIE_GROUP = "inference.networking.x-k8s.io"
LLMD_GROUP = "llm-d.ai"


@dataclass(frozen=True, slots=True)
class WatchedResource:
    group: str  # "" is the core API group
    version: str
    resource: str  # the plural, as in RBAC rules and API paths
    kind: str
    optional: bool  # absent CRD: not an error, the feature is off

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def key(self) -> str:
        """`<plural>.<group>`: unique among these (the plural alone is not)."""
        return f"{self.resource}.{self.group}" if self.group else self.resource


POD = WatchedResource("", "v1", "pods", "Pod", optional=False)
INFERENCE_POOL = WatchedResource(POOL_GROUP, "v1", "inferencepools", "InferencePool", False)
INFERENCE_POOL_V1ALPHA2 = WatchedResource(
    ALPHA_POOL_GROUP, "v1alpha2", "inferencepools", "InferencePool", optional=False
)
INFERENCE_MODEL = WatchedResource(GIE_GROUP, "v1alpha2", "inferencemodels", "InferenceModel", True)
INFERENCE_OBJECTIVE = WatchedResource(
    GIE_GROUP, "v1alpha2", "inferenceobjectives", "InferenceObjective", optional=True
)
LLMD_INFERENCE_OBJECTIVE = WatchedResource(
    LLMD_GROUP, "v1alpha2", "inferenceobjectives", "InferenceObjective", optional=True
)
INFERENCE_MODEL_REWRITE = WatchedResource(
    GIE_GROUP, "v1alpha2", "inferencemodelrewrites", "InferenceModelRewrite", optional=True
)
LLMD_INFERENCE_MODEL_REWRITE = WatchedResource(
    LLMD_GROUP, "v1alpha2", "inferencemodelrewrites", "InferenceModelRewrite", optional=True
)

POOLS: dict[str, WatchedResource] = {
    POOL_GROUP: INFERENCE_POOL,
    ALPHA_POOL_GROUP: INFERENCE_POOL_V1ALPHA2,
}

# The model CRDs, each kind in order of preference: the first one served is read.
OBJECTIVES: tuple[WatchedResource, ...] = (LLMD_INFERENCE_OBJECTIVE, INFERENCE_OBJECTIVE)
REWRITES: tuple[WatchedResource, ...] = (LLMD_INFERENCE_MODEL_REWRITE, INFERENCE_MODEL_REWRITE)
MODEL_RESOURCES: tuple[WatchedResource, ...] = (INFERENCE_MODEL, *OBJECTIVES, *REWRITES)

WATCHED_RESOURCES: tuple[WatchedResource, ...] = (
    POD,
    INFERENCE_POOL,
    INFERENCE_POOL_V1ALPHA2,
    *MODEL_RESOURCES,
)


def pool_resource(group: str) -> WatchedResource:
    """The InferencePool CRD of `discovery.pool_group`; ValueError for any other group."""
    try:
        return POOLS[group]
    except KeyError:
        raise ValueError(f"pool group {group!r} is not one of {sorted(POOLS)}") from None


# Leader election: get, create and update of one coordination.k8s.io/v1 Lease in the pool's
# namespace (client-go's leaselock needs no more: no list, watch, patch or delete).
LEASE = WatchedResource("coordination.k8s.io", "v1", "leases", "Lease", optional=False)
LEADER_ELECTION_RESOURCES: tuple[WatchedResource, ...] = (LEASE,)
LEASE_VERBS: tuple[str, ...] = ("get", "create", "update")
