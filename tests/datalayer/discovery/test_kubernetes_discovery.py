"""Kubernetes discovery against a stand-in API server (tests/kube_standin.py): no real API
server can run here, so a local HTTP server speaks the list/watch protocol (chunked watch
events, bookmarks, 410 Gone, dropped connections, API discovery) and the real
`kubernetes` client talks to it.

Each test drives the cluster through the stand-in's Python methods and asserts the
endpoint lists (or model tables) the callback received. After every test, the requests
the stand-in saw are checked against WATCHED_RESOURCES: the runtime half of the RBAC
check (the manifests' half compares the Role with the same list).
"""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kube_standin import KubeStandIn, Seen, admitted, pod, pool, running, upstream_objects
from kubernetes import client as k8s

from epp.config import EndpointConfig
from epp.datalayer.discovery import Backoff, ModelTable
from epp.datalayer.discovery.kubernetes import (
    KubernetesDiscovery,
    crd_installed,
    default_namespace,
)
from epp.datalayer.discovery.pool import standalone_pool
from epp.datalayer.discovery.reflector import WatchSettings
from epp.datalayer.kubernetes_resources import (
    INFERENCE_MODEL,
    INFERENCE_MODEL_REWRITE,
    INFERENCE_OBJECTIVE,
    INFERENCE_POOL,
    INFERENCE_POOL_V1ALPHA2,
    LLMD_INFERENCE_MODEL_REWRITE,
    LLMD_INFERENCE_OBJECTIVE,
    MODEL_RESOURCES,
    POD,
    VERBS,
    WATCHED_RESOURCES,
)

NS = "inference"
VLLM = {"app": "vllm"}
# Short backoff and CRD recheck so that recoveries take milliseconds; watches that would
# outlive every test, so that any restart seen is one the test caused.
FAST = WatchSettings(
    watch_timeout_s=60,
    request_timeout_s=5.0,
    read_slack_s=5.0,
    backoff_initial_s=0.01,
    backoff_max_s=0.05,
    crd_recheck_s=0.05,
)
# Generous: the discovery threads share a loaded CI machine; a pass never waits this long.
WAIT_S = 20.0


def allowed(seen: Seen, namespace: str = NS) -> bool:
    """A request that get/list/watch RBAC on WATCHED_RESOURCES (or API discovery) allows."""
    assert set(VERBS) == {"get", "list", "watch"}
    if seen.method != "GET":
        return False
    for r in WATCHED_RESOURCES:
        base = f"/api/{r.version}" if r.group == "" else f"/apis/{r.group}/{r.version}"
        if r.optional and seen.path == base and not seen.query:
            return True  # API discovery: no RBAC needed
        if seen.path == f"{base}/namespaces/{namespace}/{r.resource}":
            return True  # list, or watch with ?watch=true
    return False


@dataclass
class Recorder:
    endpoints: list[list[EndpointConfig]] = field(default_factory=list)
    models: list[ModelTable] = field(default_factory=list)
    loop_thread: set[int] = field(default_factory=set)

    def on_endpoints(self, endpoints: list[EndpointConfig]) -> None:
        self.loop_thread.add(threading.get_ident())
        self.endpoints.append(endpoints)

    def on_models(self, table: ModelTable) -> None:
        self.loop_thread.add(threading.get_ident())
        self.models.append(table)

    @property
    def last(self) -> list[tuple[str, str]]:
        return [(e.name, e.address) for e in self.endpoints[-1]] if self.endpoints else []


async def until(check: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.005)


@pytest.fixture
def standin() -> Iterator[KubeStandIn]:
    with running() as s:
        yield s
        bad = [r for r in s.requests if not allowed(r)]
        assert bad == [], "requests outside WATCHED_RESOURCES / API discovery"


def api_client(standin: KubeStandIn) -> k8s.ApiClient:
    return k8s.ApiClient(k8s.Configuration(host=standin.url))


@pytest.fixture
async def discovery_factory(
    standin: KubeStandIn,
) -> AsyncIterator[Callable[..., Any]]:
    started: list[KubernetesDiscovery] = []

    async def make(recorder: Recorder, **kwargs: Any) -> KubernetesDiscovery:
        kwargs.setdefault("settings", FAST)
        d = KubernetesDiscovery(
            api_client(standin),
            "pool",
            NS,
            recorder.on_endpoints,
            recorder.on_models,
            rng=random.Random(7),
            **kwargs,
        )
        await d.start()
        started.append(d)
        return d

    yield make
    for d in started:
        await d.stop()


def step(standin: KubeStandIn, obj: dict[str, Any]) -> None:
    standin.apply(POD, obj, NS)


async def test_pods_follow_add_ready_not_ready_terminating_ip_and_delete(
    standin: KubeStandIn, discovery_factory: Callable[..., Any]
) -> None:
    standin.apply(INFERENCE_POOL, pool("pool", VLLM, [8000]), NS)
    step(standin, pod("a", VLLM, "10.0.0.1"))
    step(standin, pod("b", VLLM, "10.0.0.2", ready=False))
    step(standin, pod("c", {"app": "other"}, "10.0.0.3"))  # not selected
    standin.apply(POD, pod("x", VLLM, "10.0.0.9"), "elsewhere")  # another namespace
    rec = Recorder()
    d = await discovery_factory(rec)
    await asyncio.wait_for(d.synced.wait(), WAIT_S)
    assert rec.endpoints == [
        [
            EndpointConfig(
                name="a",
                address="10.0.0.1:8000",
                metrics_url="http://10.0.0.1:8000/metrics",
                labels=VLLM,
            )
        ]
    ]

    cases: list[tuple[str, dict[str, Any] | str, list[tuple[str, str]]]] = [
        (
            "b becomes ready",
            pod("b", VLLM, "10.0.0.2"),
            [("a", "10.0.0.1:8000"), ("b", "10.0.0.2:8000")],
        ),
        ("a becomes not ready", pod("a", VLLM, "10.0.0.1", ready=False), [("b", "10.0.0.2:8000")]),
        (
            "d added ready",
            pod("d", VLLM, "10.0.0.4"),
            [("b", "10.0.0.2:8000"), ("d", "10.0.0.4:8000")],
        ),
        ("b terminating", pod("b", VLLM, "10.0.0.2", terminating=True), [("d", "10.0.0.4:8000")]),
        (
            "a ready again",
            pod("a", VLLM, "10.0.0.1"),
            [("a", "10.0.0.1:8000"), ("d", "10.0.0.4:8000")],
        ),
        ("a loses its IP", pod("a", VLLM, None), [("d", "10.0.0.4:8000")]),
        ("d relabelled out of the pool", pod("d", {"app": "old"}, "10.0.0.4"), []),
        ("e added", pod("e", VLLM, "10.0.0.5"), [("e", "10.0.0.5:8000")]),
        ("e deleted", "e", []),
    ]
    for what, change, expected in cases:
        calls = len(rec.endpoints)
        if isinstance(change, str):
            standin.delete(POD, change, NS)
        else:
            step(standin, change)
        await until(lambda calls=calls: len(rec.endpoints) > calls, what)
        assert rec.last == expected, what
        assert len(rec.endpoints) == calls + 1, what  # one call per change

    state = d.state()
    assert state.mode == "kubernetes" and state.last_sync_ok and state.pool_found
    assert state.endpoints == 0 and state.relists == 0 and state.errors == 0
    assert rec.loop_thread == {threading.get_ident()}  # callbacks on the loop's thread
    # One list and one watch each: nothing else was needed.
    assert [s.query.get("labelSelector") for s in standin.seen(POD, watch=False)] == ["app=vllm"]


async def test_a_pod_change_the_callback_does_not_need_is_not_delivered(
    standin: KubeStandIn, discovery_factory: Callable[..., Any]
) -> None:
    standin.apply(INFERENCE_POOL, pool("pool", VLLM, [8000]), NS)
    step(standin, pod("a", VLLM, "10.0.0.1"))
    rec = Recorder()
    d = await discovery_factory(rec)
    await asyncio.wait_for(d.synced.wait(), WAIT_S)
    unready = pod("u", VLLM, "10.0.0.2", ready=False)
    step(standin, unready)  # an event, but no endpoint change
    step(standin, pod("z", VLLM, "10.0.0.3"))
    await until(lambda: len(rec.endpoints) == 2, "z")
    assert [[e.name for e in call] for call in rec.endpoints] == [["a"], ["a", "z"]]


@pytest.mark.parametrize("gone_as_status", [False, True], ids=["error-event", "http-410"])
async def test_410_gone_relists(
    standin: KubeStandIn, discovery_factory: Callable[..., Any], gone_as_status: bool
) -> None:
    standin.gone_as_status = gone_as_status
    standin.apply(INFERENCE_POOL, pool("pool", VLLM, [8000]), NS)
    step(standin, pod("a", VLLM, "10.0.0.1"))
    rec = Recorder()
    d = await discovery_factory(rec, read_models=False)
    await asyncio.wait_for(d.synced.wait(), WAIT_S)
    lists_before = len(standin.seen(POD, watch=False))

    if gone_as_status:
        # The watch is cut; by the time it resumes its version is compacted: the watch
        # request itself is answered 410.
        standin.drop_watches()
        standin.expire()
    else:
        standin.expire()  # open watches get an ERROR event with a 410 Status
    standin.delete(POD, "a", NS)
    step(standin, pod("b", VLLM, "10.0.0.2"))

    await until(lambda: rec.last == [("b", "10.0.0.2:8000")], "b alone after the relist")
    assert len(standin.seen(POD, watch=False)) == lists_before + 1  # relisted
    pods = next(r for r in d.state().resources if r.resource == "pods")
    assert pods.gone >= 1 and pods.relists >= 1
    # The relist and the watch after it carry on: later changes still arrive.
    step(standin, pod("c", VLLM, "10.0.0.3"))
    await until(lambda: len(rec.last) == 2, "c after the relist")


async def test_a_dropped_connection_resumes_from_the_last_version_without_a_relist(
    standin: KubeStandIn, discovery_factory: Callable[..., Any]
) -> None:
    standin.apply(INFERENCE_POOL, pool("pool", VLLM, [8000]), NS)
    step(standin, pod("a", VLLM, "10.0.0.1"))
    rec = Recorder()
    d = await discovery_factory(rec, read_models=False)
    await asyncio.wait_for(d.synced.wait(), WAIT_S)
    step(standin, pod("b", VLLM, "10.0.0.2"))
    await until(lambda: len(rec.last) == 2, "b")
    last_event_rv = standin.get(POD, "b", NS)["metadata"]["resourceVersion"]

    standin.drop_watches()
    standin.delete(POD, "a", NS)  # while the watch is down, or just after it resumed
    await until(lambda: rec.last == [("b", "10.0.0.2:8000")], "a's deletion after the drop")

    rewatch = standin.seen(POD, watch=True)[-1]
    assert rewatch.query["resourceVersion"] == last_event_rv
    assert len(standin.seen(POD, watch=False)) == 1  # no relist
    pods = next(r for r in d.state().resources if r.resource == "pods")
    assert pods.watch_restarts == 1 and pods.relists == 0 and pods.errors == 1


async def test_a_watch_ended_by_its_server_timeout_is_opened_again_from_its_version(
    standin: KubeStandIn, discovery_factory: Callable[..., Any]
) -> None:
    standin.apply(INFERENCE_POOL, pool("pool", VLLM, [8000]), NS)
    step(standin, pod("a", VLLM, "10.0.0.1"))
    rec = Recorder()
    settings = WatchSettings(watch_timeout_s=1, backoff_initial_s=0.01, backoff_max_s=0.05)
    d = await discovery_factory(rec, read_models=False, settings=settings)
    await asyncio.wait_for(d.synced.wait(), WAIT_S)
    await until(lambda: len(standin.seen(POD, watch=True)) >= 2, "the second watch")
    first, second = standin.seen(POD, watch=True)[:2]
    assert first.query["timeoutSeconds"] in ("1", "2")  # drawn from [t, 2t]
    assert second.query["resourceVersion"] == first.query["resourceVersion"]
    step(standin, pod("b", VLLM, "10.0.0.2"))
    await until(lambda: len(rec.last) == 2, "b through the second watch")
    pods = next(r for r in d.state().resources if r.resource == "pods")
    assert pods.watch_restarts >= 1 and pods.relists == 0 and pods.errors == 0


async def test_a_bookmark_moves_the_resume_version(
    standin: KubeStandIn, discovery_factory: Callable[..., Any]
) -> None:
    standin.apply(INFERENCE_POOL, pool("pool", VLLM, [8000]), NS)
    step(standin, pod("a", VLLM, "10.0.0.1"))
    rec = Recorder()
    d = await discovery_factory(rec, read_models=False)
    await asyncio.wait_for(d.synced.wait(), WAIT_S)
    await until(lambda: standin.open_watches(POD) == 1, "the pod watch")
    for i in range(3):  # writes the pod watch does not see: the version moves on
        standin.apply(POD, pod(f"o{i}", {"app": "other"}, f"10.0.1.{i}"), NS)
    mark = standin.bookmark()

    # The bookmark carries no object: wait until the client has read it, via its state.
    def resume_version() -> str | None:
        return next(r for r in d.state().resources if r.resource == "pods").resource_version

    await until(lambda: resume_version() == str(mark), "the bookmark read")
    standin.drop_watches()
    await until(lambda: len(standin.seen(POD, watch=True)) == 2, "the rewatch")
    assert standin.seen(POD, watch=True)[-1].query["resourceVersion"] == str(mark)
    assert standin.seen(POD, watch=True)[0].query["allowWatchBookmarks"] == "true"


async def test_pool_edits_selector_and_target_ports(
    standin: KubeStandIn, discovery_factory: Callable[..., Any]
) -> None:
    standin.apply(INFERENCE_POOL, pool("pool", VLLM, [8000]), NS)
    step(standin, pod("a", VLLM, "10.0.0.1"))
    step(standin, pod("b", {"app": "vllm", "version": "2"}, "10.0.0.2"))
    step(standin, pod("c", {"app": "next"}, "10.0.0.3"))
    rec = Recorder()
    d = await discovery_factory(rec, read_models=False)
    await asyncio.wait_for(d.synced.wait(), WAIT_S)
    assert rec.last == [("a", "10.0.0.1:8000"), ("b", "10.0.0.2:8000")]

    # targetPorts 1 -> 2: every pod gives two endpoints, named by rank.
    standin.apply(INFERENCE_POOL, pool("pool", VLLM, [8000, 8001]), NS)
    await until(lambda: len(rec.last) == 4, "two ranks per pod")
    assert rec.last == [
        ("a-rank-0", "10.0.0.1:8000"),
        ("a-rank-1", "10.0.0.1:8001"),
        ("b-rank-0", "10.0.0.2:8000"),
        ("b-rank-1", "10.0.0.2:8001"),
    ]

    # Selector narrowed: a drops out at once; the pod watch restarts with the new selector.
    standin.apply(INFERENCE_POOL, pool("pool", {"app": "vllm", "version": "2"}, [8000]), NS)
    await until(lambda: rec.last == [("b", "10.0.0.2:8000")], "b alone")
    # Selector moved to other pods: they are listed afresh.
    standin.apply(INFERENCE_POOL, pool("pool", {"app": "next"}, [8000]), NS)
    await until(lambda: rec.last == [("c", "10.0.0.3:8000")], "c alone")
    selectors = [s.query.get("labelSelector") for s in standin.seen(POD, watch=False)]
    # In this order (a watch that ended on its own may list again with the same one).
    assert [k for k, _ in itertools.groupby(selectors)] == [
        "app=vllm",
        "app=vllm,version=2",
        "app=next",
    ]
    # And the new watch follows its pods.
    step(standin, pod("n", {"app": "next"}, "10.0.0.4"))
    await until(lambda: len(rec.last) == 2, "n")

    # An invalid edit is logged and the last valid spec kept.
    standin.apply(INFERENCE_POOL, pool("pool", {"app": "next"}, []), NS)
    await until(lambda: bool(d.state().problems), "the problem noted")
    assert rec.last == [("c", "10.0.0.3:8000"), ("n", "10.0.0.4:8000")]

    # The pool deleted: no endpoints.
    standin.delete(INFERENCE_POOL, "pool", NS)
    await until(lambda: rec.last == [], "no endpoints without a pool")
    assert d.state().pool_found is False


async def test_no_pool_yet_then_created(
    standin: KubeStandIn, discovery_factory: Callable[..., Any]
) -> None:
    step(standin, pod("a", VLLM, "10.0.0.1"))
    rec = Recorder()
    d = await discovery_factory(rec, read_models=False)
    await asyncio.wait_for(d.synced.wait(), WAIT_S)
    assert rec.endpoints == [[]]  # known: there is nothing to route to
    assert standin.seen(POD) == []  # no selector, no pod requests
    standin.apply(INFERENCE_POOL, pool("pool", VLLM, [8000]), NS)
    await until(lambda: rec.last == [("a", "10.0.0.1:8000")], "a once the pool exists")


async def test_api_errors_back_off_and_recover(
    standin: KubeStandIn, discovery_factory: Callable[..., Any]
) -> None:
    standin.apply(INFERENCE_POOL, pool("pool", VLLM, [8000]), NS)
    step(standin, pod("a", VLLM, "10.0.0.1"))
    standin.fail_next(3, 500, path_contains="/pods")
    standin.fail_next(2, 503, path_contains="/inferencepools")
    rec = Recorder()
    d = await discovery_factory(rec, read_models=False)
    await asyncio.wait_for(d.synced.wait(), WAIT_S)
    assert rec.last == [("a", "10.0.0.1:8000")]
    state = d.state()
    assert state.errors == 5 and state.last_sync_ok
    pods = next(r for r in state.resources if r.resource == "pods")
    assert pods.errors == 3 and "500" in (pods.last_error or "")


async def test_stop_ends_the_threads_while_watches_are_open(
    standin: KubeStandIn, discovery_factory: Callable[..., Any]
) -> None:
    standin.apply(INFERENCE_POOL, pool("pool", VLLM, [8000]), NS)
    rec = Recorder()
    d = await discovery_factory(rec)
    await asyncio.wait_for(d.synced.wait(), WAIT_S)
    # The pool, its pods, InferenceModel, and InferenceObjective and InferenceModelRewrite
    # in both groups.
    await until(lambda: standin.open_watches() == 7, "seven open watches")
    # The watches would run for a minute or more (FAST.watch_timeout_s): only cutting the
    # connection can end the threads within the join timeout.
    await d.stop(timeout_s=5.0)
    assert not [t for t in threading.enumerate() if t.name.startswith("epp-discovery-")]


async def test_models_from_inference_model_and_objective(
    standin: KubeStandIn, discovery_factory: Callable[..., Any]
) -> None:
    standin.apply(INFERENCE_POOL, pool("pool", VLLM, [8000]), NS)
    standin.apply(
        INFERENCE_MODEL,
        {
            "metadata": {"name": "chat"},
            "spec": {
                "modelName": "chat",
                "criticality": "Critical",
                "targetModels": [
                    {"name": "chat-v1", "weight": 80},
                    {"name": "chat-v2", "weight": 20},
                ],
                "poolRef": {"name": "pool"},
            },
        },
        NS,
    )
    standin.apply(
        INFERENCE_MODEL,
        {"metadata": {"name": "x"}, "spec": {"modelName": "x", "poolRef": {"name": "another"}}},
        NS,
    )
    standin.apply(
        LLMD_INFERENCE_OBJECTIVE,
        {"metadata": {"name": "batch"}, "spec": {"priority": -1, "poolRef": {"name": "pool"}}},
        NS,
    )
    rec = Recorder()
    d = await discovery_factory(rec)
    await until(lambda: bool(rec.models), "the model table")
    table = rec.models[-1]
    assert set(table.models) == {"chat"}
    assert [t.name for t in table.models["chat"].targets] == ["chat-v1", "chat-v2"]
    assert table.priorities() == {"chat": 1} and dict(table.objectives) == {"batch": -1}

    # An edit arrives through the watch.
    standin.apply(
        INFERENCE_MODEL,
        {
            "metadata": {"name": "summarize"},
            "spec": {
                "modelName": "summarize",
                "criticality": "Sheddable",
                "poolRef": {"name": "pool"},
            },
        },
        NS,
    )
    await until(lambda: "summarize" in rec.models[-1].models, "summarize")
    assert rec.models[-1].priorities() == {"chat": 1, "summarize": -1}
    standin.delete(LLMD_INFERENCE_OBJECTIVE, "batch", NS)
    await until(lambda: not rec.models[-1].objectives, "batch deleted")
    assert d.models == rec.models[-1]
    crds = {r.resource: r.present for r in d.state().resources}
    assert crds[INFERENCE_MODEL.key] is True and crds[LLMD_INFERENCE_OBJECTIVE.key] is True


async def test_absent_model_crds_are_not_an_error_and_are_found_once_installed(
    discovery_factory: Callable[..., Any], standin: KubeStandIn
) -> None:
    standin.uninstall(*MODEL_RESOURCES)
    standin.apply(INFERENCE_POOL, pool("pool", VLLM, [8000]), NS)
    step(standin, pod("a", VLLM, "10.0.0.1"))
    rec = Recorder()
    d = await discovery_factory(rec)
    await asyncio.wait_for(d.synced.wait(), WAIT_S)
    await until(lambda: bool(rec.models), "an empty model table")
    assert rec.models == [ModelTable()]
    assert rec.last == [("a", "10.0.0.1:8000")]  # endpoints unaffected
    state = d.state()
    assert state.errors == 0 and state.last_sync_ok
    optional = {r.key for r in MODEL_RESOURCES}
    assert {r.resource: r.present for r in state.resources if r.resource in optional} == {
        key: False for key in optional
    }
    # Only API discovery was asked, never the absent collections.
    assert [r for m in MODEL_RESOURCES for r in standin.seen(m)] == []
    assert any(r.path == "/apis/inference.networking.x-k8s.io/v1alpha2" for r in standin.requests)

    # The CRD is installed later: found on the next recheck.
    standin.install(INFERENCE_MODEL, INFERENCE_OBJECTIVE)
    standin.apply(
        INFERENCE_MODEL,
        {
            "metadata": {"name": "m"},
            "spec": {"modelName": "m", "criticality": "Critical", "poolRef": {"name": "pool"}},
        },
        NS,
    )
    await until(lambda: "m" in rec.models[-1].models, "m once the CRD is installed")

    # And removed again: the table empties, still not an error.
    standin.uninstall(*MODEL_RESOURCES)
    await until(lambda: not rec.models[-1].models, "the table empties")
    assert d.state().errors == 0


def test_crd_installed_reads_api_discovery(standin: KubeStandIn) -> None:
    client = api_client(standin)
    assert crd_installed(client, INFERENCE_MODEL) is True
    standin.uninstall(INFERENCE_OBJECTIVE)
    assert crd_installed(client, INFERENCE_OBJECTIVE) is False  # group there, resource not
    standin.uninstall(INFERENCE_MODEL)
    assert crd_installed(client, INFERENCE_MODEL) is False  # 404: group absent


def test_the_rbac_check_rejects_what_it_should() -> None:
    assert allowed(Seen("GET", f"/api/v1/namespaces/{NS}/pods", {"watch": "true"}))
    assert not allowed(Seen("GET", f"/api/v1/namespaces/{NS}/services", {}))
    assert not allowed(Seen("GET", "/api/v1/pods", {}))  # cluster-wide
    assert not allowed(Seen("GET", "/api/v1/namespaces/other/pods", {}))
    assert not allowed(Seen("POST", f"/api/v1/namespaces/{NS}/pods", {}))
    assert not allowed(Seen("GET", "/apis/inference.networking.k8s.io/v1", {}))  # not optional


def test_default_namespace(tmp_path: Path) -> None:
    path = tmp_path / "namespace"
    assert default_namespace(path) == "default"
    path.write_text("inference\n")
    assert default_namespace(path) == "inference"


def test_backoff_grows_with_jitter_up_to_the_cap() -> None:
    backoff = Backoff(initial_s=0.5, max_s=4.0, rng=random.Random(1))
    delays = [backoff.next() for _ in range(8)]
    caps = [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0]
    assert all(cap / 2 <= d <= cap for d, cap in zip(delays, caps, strict=True))
    assert len(set(delays)) == len(delays)  # jittered
    backoff.reset()
    assert 0.25 <= backoff.next() <= 0.5


# --- the current CRDs, served as the API server admits them (validated against the
# upstream CRDs, defaults applied: kube_standin.admitted) ------------------------------


def upstream(path: str, kind: str, name: str, api_version: str | None = None) -> dict[str, Any]:
    """An upstream example object, for our pool ("pool"), admitted."""
    (obj,) = [o for o in upstream_objects(path, kind) if o["metadata"]["name"] == name][:1]
    obj = {**obj, "metadata": {"name": name}}
    if api_version is not None:
        obj["apiVersion"] = api_version
    if "poolRef" in obj.get("spec", {}):
        obj["spec"] = {**obj["spec"], "poolRef": {**obj["spec"]["poolRef"], "name": "pool"}}
    return admitted(obj)


GIE_OBJECTIVES = "gie-v1.5.0/manifests/inferenceobjective.yaml"
LLMD_OBJECTIVES = "llm-d-router-v0.10.0/manifests/inferenceobjective.yaml"
HERMETIC = "llm-d-router-v0.10.0/testdata/inferencepool-with-model-hermetic.yaml"
ROLLOUT = "gie-v1.5.0/docs/adapter-rollout.md"


async def test_objectives_and_rewrites_from_both_groups_llm_d_ai_first(
    standin: KubeStandIn, discovery_factory: Callable[..., Any]
) -> None:
    standin.uninstall(LLMD_INFERENCE_OBJECTIVE, LLMD_INFERENCE_MODEL_REWRITE)
    standin.apply(INFERENCE_POOL, admitted(pool("pool", VLLM, [8000])), NS)
    # GIE's group only, as a GIE v1.5 cluster has it: its objects are read.
    gie_objective = upstream(GIE_OBJECTIVES, "InferenceObjective", "small-segment-lora")
    standin.apply(INFERENCE_OBJECTIVE, gie_objective, NS)
    (_, canary) = upstream_objects(ROLLOUT, "InferenceModelRewrite")
    canary["spec"]["poolRef"]["name"] = "pool"
    standin.apply(INFERENCE_MODEL_REWRITE, admitted(canary), NS)
    rec = Recorder()
    d = await discovery_factory(rec)
    await until(lambda: bool(rec.models) and rec.models[-1].objectives, "GIE's objective")
    table = rec.models[-1]
    assert dict(table.objectives) == {"small-segment-lora": 1}
    assert {table.target("small-segment-lora", u / 10) for u in range(10)} == {
        "small-segment-lora-v1",
        "small-segment-lora-v2",
    }

    # The llm-d router's CRDs installed too (its chart does): only llm-d.ai counts now,
    # GIE's objects are ignored, as the reference EPP does.
    standin.install(LLMD_INFERENCE_OBJECTIVE, LLMD_INFERENCE_MODEL_REWRITE)
    standin.apply(
        LLMD_INFERENCE_OBJECTIVE, upstream(LLMD_OBJECTIVES, "InferenceObjective", "base-model"), NS
    )
    standin.apply(
        LLMD_INFERENCE_MODEL_REWRITE,
        upstream(HERMETIC, "InferenceModelRewrite", "rewrite-test"),
        NS,
    )
    await until(
        lambda: (
            "base-model" in rec.models[-1].objectives
            and "model-to-be-rewritten" in rec.models[-1].rewrites
        ),
        "llm-d.ai's objective and rewrite",
    )
    table = rec.models[-1]
    assert dict(table.objectives) == {"base-model": 2}
    assert table.target("model-to-be-rewritten", 0.5) == "rewritten-model"
    assert table.target("small-segment-lora", 0.5) == "small-segment-lora"  # GIE's: ignored
    # Listed, then watched: the table can change on the list's answer before the watch
    # that follows it is sent, so the watch is waited for, not assumed.
    for r in (LLMD_INFERENCE_OBJECTIVE, LLMD_INFERENCE_MODEL_REWRITE):
        await until(
            lambda r=r: [s.query.get("watch") for s in standin.seen(r)][-1:] == ["true"],
            f"the watch of {r.resource}",
        )

    # llm-d.ai's CRDs removed again: back to GIE's objects.
    standin.uninstall(LLMD_INFERENCE_OBJECTIVE, LLMD_INFERENCE_MODEL_REWRITE)
    await until(
        lambda: (
            "small-segment-lora" in rec.models[-1].objectives
            and "small-segment-lora" in rec.models[-1].rewrites
        ),
        "back to GIE's",
    )
    assert rec.models[-1].target("small-segment-lora", 0.0) == "small-segment-lora-v1"
    assert d.state().errors == 0


async def test_a_v1alpha2_pool_with_pool_group_x_k8s_io(
    standin: KubeStandIn, discovery_factory: Callable[..., Any]
) -> None:
    (alpha,) = upstream_objects(
        "gie-v0.5.0/manifests/inferencepool-resources.yaml", "InferencePool"
    )
    alpha["metadata"]["name"] = "pool"
    standin.apply(INFERENCE_POOL_V1ALPHA2, admitted(alpha), NS)
    # A v1 pool of the same name: not the one asked for.
    standin.apply(INFERENCE_POOL, admitted(pool("pool", {"app": "other"}, [9000])), NS)
    labels = alpha["spec"]["selector"]
    step(standin, pod("a", labels, "10.0.0.1"))
    step(standin, pod("b", {"app": "other"}, "10.0.0.2"))
    rec = Recorder()
    d = await discovery_factory(rec, pool_group="inference.networking.x-k8s.io")
    await asyncio.wait_for(d.synced.wait(), WAIT_S)
    assert rec.last == [("a", "10.0.0.1:8000")]
    assert standin.seen(INFERENCE_POOL) == []  # the v1 pool is never read
    state = d.state()
    assert state.pool_api == "inference.networking.x-k8s.io/v1alpha2"
    assert state.endpoint_picker_ref == {
        "name": "vllm-llama3-8b-instruct-epp",
        "kind": "Service",
        "group": "",
        "port": None,
        "failure_mode": "FailClose",
    }
    # An edit of the alpha pool's single port follows.
    alpha["spec"]["targetPortNumber"] = 8001
    standin.apply(INFERENCE_POOL_V1ALPHA2, admitted(alpha), NS)
    await until(lambda: rec.last == [("a", "10.0.0.1:8001")], "the new port")


def test_an_unknown_pool_group_is_refused(standin: KubeStandIn) -> None:
    with pytest.raises(ValueError, match="pool group"):
        KubernetesDiscovery(api_client(standin), "pool", NS, lambda e: None, pool_group="x.io")


async def test_the_pools_app_protocol_and_picker_ref_are_exposed(
    standin: KubeStandIn, discovery_factory: Callable[..., Any]
) -> None:
    (h2c,) = [
        p
        for p in upstream_objects("gie-v1.6.0/conformance/base.yaml", "InferencePool")
        if p["spec"].get("appProtocol") == "kubernetes.io/h2c"
    ]
    h2c["metadata"]["name"] = "pool"
    standin.apply(INFERENCE_POOL, admitted(h2c), NS)
    step(standin, pod("a", h2c["spec"]["selector"]["matchLabels"], "10.0.0.1"))
    rec = Recorder()
    d = await discovery_factory(rec, read_models=False)
    await asyncio.wait_for(d.synced.wait(), WAIT_S)
    state = d.state()
    assert state.app_protocol == "kubernetes.io/h2c" and d.pool is not None
    assert d.pool.scheme == "http"  # h2c is cleartext
    assert state.endpoint_picker_ref == {
        "name": "appprotocol-h2c-endpoint-picker-svc",
        "kind": "Service",
        "group": "",
        "port": 9002,
        "failure_mode": "FailClose",
    }
    assert [(e.address, e.metrics_url) for e in rec.endpoints[-1]] == [
        ("10.0.0.1:3001", "http://10.0.0.1:3001/metrics")
    ]
    # appProtocol edited to HTTP/1.1: the spec follows.
    h2c["spec"]["appProtocol"] = "http"
    standin.apply(INFERENCE_POOL, admitted(h2c), NS)
    await until(lambda: d.state().app_protocol == "http", "appProtocol http")


async def test_standalone_pods_of_a_label_selector_without_a_pool(
    standin: KubeStandIn, discovery_factory: Callable[..., Any]
) -> None:
    standin.apply(INFERENCE_POOL, admitted(pool("pool", {"app": "other"}, [9000])), NS)
    step(standin, pod("a", VLLM, "10.0.0.1"))
    step(standin, pod("b", {"app": "other"}, "10.0.0.2"))
    rec = Recorder()
    d = await discovery_factory(rec, standalone=standalone_pool("standalone", "app=vllm", [8000]))
    await asyncio.wait_for(d.synced.wait(), WAIT_S)
    assert rec.last == [("a", "10.0.0.1:8000")]
    step(standin, pod("c", VLLM, "10.0.0.3"))
    await until(lambda: len(rec.last) == 2, "c")
    # Only the pods were read: no pool, no model CRD (not even API discovery), as upstream.
    assert {s.path for s in standin.requests} == {f"/api/v1/namespaces/{NS}/pods"}
    assert standin.seen(POD)[0].query["labelSelector"] == "app=vllm"
    state = d.state()
    assert state.pool_found and state.pool_api is None and state.last_sync_ok
    assert rec.models == []


async def test_a_model_resource_our_role_cannot_read_is_absent_not_a_stall(
    standin: KubeStandIn, discovery_factory: Callable[..., Any]
) -> None:
    """The llm-d router's chart grants no `inferencemodels`, GIE's none in `llm-d.ai`, and
    clusters upgraded from GIE v0.x still serve the InferenceModel CRD: a 403 on one
    optional resource is read as not installed, so the objectives that did list still
    make the table and discovery counts as synced (a stall would never apply them and
    fire EppDiscoveryNotSynced for good)."""
    standin.fail_next(400, 403, path_contains="/inferencemodels")  # every list, ~20 s
    standin.apply(INFERENCE_POOL, admitted(pool("pool", VLLM, [8000])), NS)
    step(standin, pod("a", VLLM, "10.0.0.1"))
    standin.apply(
        LLMD_INFERENCE_OBJECTIVE, upstream(LLMD_OBJECTIVES, "InferenceObjective", "base-model"), NS
    )
    rec = Recorder()
    d = await discovery_factory(rec)
    await until(lambda: bool(rec.models) and rec.models[-1].objectives, "the objective")
    assert "base-model" in dict(rec.models[-1].objectives)
    state = d.state()
    assert state.last_sync_ok
    forbidden = {r.resource: r.present for r in state.resources}
    assert forbidden[INFERENCE_MODEL.key] is False
    assert any("/inferencemodels" in r.path for r in standin.requests)  # it was asked
