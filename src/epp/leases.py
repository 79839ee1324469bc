"""The Lease API an elector needs: get, create and replace of namespaced
coordination.k8s.io/v1 Leases (`LeaseApi`), on the `kubernetes` client
(`KubernetesLeases`), with MicroTime stamps as the API server parses them."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any, Protocol

Obj = dict[str, Any]
LEASE_API_VERSION = "coordination.k8s.io/v1"


class LeaseConflict(Exception):
    """409: the Lease exists (create) or changed since it was read (update)."""


def micro_time(now: datetime) -> str:
    """A MicroTime as the API server parses it (RFC 3339, exactly six fraction digits)."""
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaseApi(Protocol):
    """get: the Lease or None (404); create/replace: the stored Lease, or LeaseConflict."""

    def get(self, namespace: str, name: str, timeout_s: float) -> Obj | None: ...

    def create(self, namespace: str, body: Obj, timeout_s: float) -> Obj: ...

    def replace(self, namespace: str, name: str, body: Obj, timeout_s: float) -> Obj: ...


class KubernetesLeases:
    """LeaseApi on a `kubernetes` ApiClient: get, create and update of namespaced
    coordination.k8s.io/v1 Leases (the verbs the Role grants). Raw JSON both ways, through
    the client's request layer (its auth, TLS and timeouts): the generated methods turn a
    body into their models, which write a MicroTime as `+00:00` and drop its fraction at a
    whole second, which the API server refuses."""

    def __init__(self, api_client: Any) -> None:
        self._client = api_client

    def _request(
        self, method: str, namespace: str, name: str | None, body: Obj | None, timeout_s: float
    ) -> Obj | None:
        from kubernetes.client.exceptions import ApiException  # loaded only when used

        path = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        params = {"namespace": namespace}
        if name is not None:
            path += "/{name}"
            params["name"] = name
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        serialized = self._client.param_serialize(
            method=method,
            resource_path=path,
            path_params=params,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        resp = self._client.call_api(*serialized, _request_timeout=timeout_s)
        data = resp.read()
        if resp.status == 404:
            return None
        if resp.status == 409:
            raise LeaseConflict(f"{method} lease {namespace}/{name or ''}: 409")
        if not 200 <= resp.status < 300:
            raise ApiException(status=resp.status, reason=resp.reason)
        lease: Obj = json.loads(data)
        return lease

    def get(self, namespace: str, name: str, timeout_s: float) -> Obj | None:
        return self._request("GET", namespace, name, None, timeout_s)

    def create(self, namespace: str, body: Obj, timeout_s: float) -> Obj:
        stored = self._request("POST", namespace, None, body, timeout_s)
        if stored is None:
            raise RuntimeError(f"lease create in {namespace}: 404 (namespace missing?)")
        return stored

    def replace(self, namespace: str, name: str, body: Obj, timeout_s: float) -> Obj:
        stored = self._request("PUT", namespace, name, body, timeout_s)
        if stored is None:
            raise LeaseConflict("the lease was deleted since it was read")
        return stored
