"""The Kubernetes resources the EPP reads, in one list.

Discovery reads exactly these, and nothing else; the RBAC in `deploy/kubernetes/` and in
the Helm chart grants exactly these (a test compares them). Optional resources are read
only when their CRD is installed (found through API discovery, which needs no RBAC).
"""

from __future__ import annotations

from dataclasses import dataclass

# Read-only: the EPP never writes to the API server.
VERBS: tuple[str, ...] = ("get", "list", "watch")


@dataclass(frozen=True, slots=True)
class WatchedResource:
    group: str  # "" is the core API group
    version: str
    resource: str  # the plural, as in RBAC rules and API paths
    kind: str
    optional: bool  # absent CRD: not an error, the feature is off


POD = WatchedResource("", "v1", "pods", "Pod", optional=False)
INFERENCE_POOL = WatchedResource(
    "inference.networking.k8s.io", "v1", "inferencepools", "InferencePool", optional=False
)
INFERENCE_MODEL = WatchedResource(
    "inference.networking.x-k8s.io", "v1alpha2", "inferencemodels", "InferenceModel", True
)
INFERENCE_OBJECTIVE = WatchedResource(
    "inference.networking.x-k8s.io",
    "v1alpha2",
    "inferenceobjectives",
    "InferenceObjective",
    optional=True,
)

WATCHED_RESOURCES: tuple[WatchedResource, ...] = (
    POD,
    INFERENCE_POOL,
    INFERENCE_MODEL,
    INFERENCE_OBJECTIVE,
)
