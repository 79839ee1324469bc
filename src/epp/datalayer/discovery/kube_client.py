"""The Kubernetes API client discovery reads with: how it is made (in a pod or from a
kubeconfig), the list call of each watched resource, and API discovery of optional CRDs."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException

from epp.datalayer.discovery.watch_stream import ListCall, Response
from epp.datalayer.kubernetes_resources import WatchedResource

SERVICEACCOUNT_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def default_namespace(path: Path = SERVICEACCOUNT_NAMESPACE) -> str:
    """The pod's own namespace (from its service account), else "default"."""
    try:
        namespace = path.read_text().strip()
    except OSError:
        return "default"
    return namespace or "default"


def make_api_client(kubeconfig: str | None = None, context: str | None = None) -> k8s.ApiClient:
    """In a pod: its service account (the token is re-read as it rotates). Elsewhere:
    the kubeconfig (`kubeconfig`, else $KUBECONFIG, else ~/.kube/config)."""
    configuration = k8s.Configuration()
    # Both loaders are untyped in the client; typed here by assignment.
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        load_incluster: Callable[..., None] = k8s_config.load_incluster_config
        load_incluster(client_configuration=configuration)
    else:
        load_kube: Callable[..., None] = k8s_config.load_kube_config
        load_kube(config_file=kubeconfig, context=context, client_configuration=configuration)
    configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize or 0, 8)
    return k8s.ApiClient(configuration)


def list_call(api_client: k8s.ApiClient, resource: WatchedResource, namespace: str) -> ListCall:
    if resource.group == "" and resource.resource == "pods":
        core = k8s.CoreV1Api(api_client)

        def list_pods(**query: Any) -> Response:
            # With _preload_content=False the generated methods return the raw response.
            return cast(Response, core.list_namespaced_pod(namespace, **query))

        return list_pods
    if resource.group == "":
        raise ValueError(f"no list call for core resource {resource.resource!r}")
    custom = k8s.CustomObjectsApi(api_client)

    def list_custom(**query: Any) -> Response:
        return cast(
            Response,
            custom.list_namespaced_custom_object(
                resource.group, resource.version, namespace, resource.resource, **query
            ),
        )

    return list_custom


def crd_installed(
    api_client: k8s.ApiClient, resource: WatchedResource, timeout_s: float = 30.0
) -> bool:
    """API discovery: does `GET /apis/<group>/<version>` list the resource? 404: no."""
    api = k8s.CustomObjectsApi(api_client)
    try:
        resp = cast(
            Response,
            api.get_api_resources(
                resource.group,
                resource.version,
                _preload_content=False,
                _request_timeout=(timeout_s, timeout_s),
            ),
        )
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise
    try:
        doc = json.loads(resp.read())
    finally:
        resp.release_conn()
    resources = doc.get("resources") if isinstance(doc, Mapping) else None
    return any(
        isinstance(r, Mapping) and r.get("name") == resource.resource for r in resources or ()
    )
