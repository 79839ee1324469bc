"""RBAC by reading the manifests: the EPP's ServiceAccount may get, list and watch exactly
the resources the code reads (WATCHED_RESOURCES x VERBS), in its own namespace, and
nothing else; with leaderElection.enabled also get, create and update its Lease
(LEADER_ELECTION_RESOURCES x LEASE_VERBS), and only then."""

from __future__ import annotations

import pytest

from deploy.conftest import VALUES_ALL, VALUES_STATIC, static_objects
from epp.datalayer.kubernetes_resources import (
    LEADER_ELECTION_RESOURCES,
    LEASE_VERBS,
    VERBS,
    WATCHED_RESOURCES,
)

EXPECTED = {(r.group, r.resource, verb) for r in WATCHED_RESOURCES for verb in VERBS}
LEASES = {(r.group, r.resource, verb) for r in LEADER_ELECTION_RESOURCES for verb in LEASE_VERBS}
CLUSTER_WIDE = {"ClusterRole", "ClusterRoleBinding"}


def granted(role: dict) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples a Role grants; anything broader than a plain
    triple (wildcards, resourceNames, non-resource URLs) fails the test."""
    triples = set()
    for rule in role["rules"]:
        assert set(rule) <= {"apiGroups", "resources", "verbs"}, f"unexpected rule fields: {rule}"
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {field}: {rule}"
        triples |= {
            (g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
        }
    return triples


def epp_service_account(objects: list[dict]) -> str:
    (deployment,) = [
        o
        for o in objects
        if o["kind"] == "Deployment"
        and o["metadata"]["labels"]["app.kubernetes.io/component"] == "endpoint-picker"
    ]
    return deployment["spec"]["template"]["spec"]["serviceAccountName"]


def check_rbac(objects: list[dict], expected: set[tuple[str, str, str]] = EXPECTED) -> None:
    assert not [o for o in objects if o["kind"] in CLUSTER_WIDE], "no cluster-wide RBAC"
    (role,) = [o for o in objects if o["kind"] == "Role"]
    (binding,) = [o for o in objects if o["kind"] == "RoleBinding"]
    assert granted(role) == expected
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    namespace = role["metadata"]["namespace"]
    assert binding["metadata"]["namespace"] == namespace
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": epp_service_account(objects), "namespace": namespace}
    ]


def test_expected_grants_are_read_only_and_name_the_watched_resources():
    assert set(VERBS) == {"get", "list", "watch"}
    assert {r.resource for r in WATCHED_RESOURCES} >= {"pods", "inferencepools"}


def test_static_manifests_grant_exactly_the_watched_resources():
    check_rbac(static_objects())


@pytest.mark.parametrize("values", [(), (VALUES_ALL,)], ids=["defaults", "values-all"])
def test_chart_grants_exactly_the_watched_resources(render_chart, values):
    rendered = render_chart(*values, namespace="inference")
    check_rbac(rendered.objects)
    assert rendered.one("Role")["metadata"]["namespace"] == "inference"


@pytest.mark.parametrize("values", [(), (VALUES_ALL,)], ids=["defaults", "values-all"])
def test_leader_election_adds_exactly_its_lease_verbs(render_chart, values):
    assert {("coordination.k8s.io", "leases", v) for v in ("get", "create", "update")} == LEASES
    rendered = render_chart(*values, set=["leaderElection.enabled=true"], namespace="inference")
    check_rbac(rendered.objects, EXPECTED | LEASES)


def test_static_discovery_gets_no_rbac_and_no_token(render_chart):
    rendered = render_chart(VALUES_STATIC)
    assert not [o for o in rendered.objects if o["kind"] in {"Role", "RoleBinding", *CLUSTER_WIDE}]
    pod = rendered.one("Deployment", "epp")["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
