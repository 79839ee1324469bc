"""The router tokenizes each request with its model's tokenizer (`tokenizers:`), and
with the byte estimate for models without one."""

from __future__ import annotations

import json

from tokenizer_fixtures import FIXTURES

from epp.config import EndpointConfig, EppConfig
from epp.datalayer.metrics_parser import PodMetrics
from epp.datalayer.store import EndpointStore
from epp.observability.metrics import EppMetrics
from epp.prefix.hashing import block_hashes, chain_seed
from epp.prefix.index import PrefixIndex
from epp.request import IncomingRequest, parse_request
from epp.routing import Router
from epp.scheduling.scheduler import Scheduler
from epp.tokenization import TokenizerRegistry
from epp.tokenization.estimate import ByteEstimateTokenizer
from epp.wiring import connect


def router() -> tuple[Router, TokenizerRegistry]:
    config = EppConfig.model_validate(
        {
            "tokenizers": {"llama": {"path": str(FIXTURES / "llama3")}},
            "adapters": {"sql-lora": "llama"},
            "endpoints": [{"name": "pod-0", "address": "10.0.0.1:8000"}],
        }
    )
    store = EndpointStore.for_config(config)
    store.sync([EndpointConfig.model_validate(e.model_dump()) for e in config.endpoints])
    for endpoint in store.all():
        store.scraped(endpoint, PodMetrics(model="llama"))
    index = PrefixIndex.from_config(config.prefix)
    registry = TokenizerRegistry.from_config(config.tokenizers)
    routing = Router(config, store, index, Scheduler(config.scheduling), registry, EppMetrics())
    connect(store, index, routing, config)
    return routing, registry


def test_each_model_is_tokenized_with_its_own_tokenizer() -> None:
    routing, registry = router()
    messages = [
        {"role": "system", "content": "You route."},
        {"role": "user", "content": "hi " * 50},
    ]
    for model, adapter in (("llama", None), ("sql-lora", "sql-lora")):
        body = json.dumps({"model": model, "messages": messages}).encode()
        prepared = routing.prepare(
            IncomingRequest(path="/v1/chat/completions", body=body, request_id="r")
        )
        prompt = parse_request("/v1/chat/completions", body, {}).prompt
        assert prompt.messages is not None
        ids = registry.for_model("llama").encode_chat(prompt.messages, prompt.chat)
        assert prepared.prompt_tokens == len(ids)
        assert prepared.hashes == block_hashes(ids, 16, chain_seed(model, adapter, None))
    other = json.dumps({"model": "other", "messages": messages}).encode()
    prepared = routing.prepare(
        IncomingRequest(path="/v1/chat/completions", body=other, request_id="r")
    )
    prompt = parse_request("/v1/chat/completions", other, {}).prompt
    assert prompt.messages is not None
    assert prepared.prompt_tokens == len(ByteEstimateTokenizer().encode_chat(prompt.messages))


def test_anthropic_bodies_route_on_the_same_chat_tokens() -> None:
    routing, _ = router()
    body = json.dumps(
        {"model": "llama", "max_tokens": 64, "system": "You route.",
         "messages": [{"role": "user", "content": [{"type": "text", "text": "hi " * 50}]}]}
    ).encode()  # fmt: skip
    prepared = routing.prepare(IncomingRequest(path="/v1/messages", body=body, request_id="r"))
    chat = json.dumps(
        {"model": "llama", "messages": [{"role": "system", "content": "You route."},
                                        {"role": "user", "content": "hi " * 50}]}
    ).encode()  # fmt: skip
    assert (
        prepared.hashes
        == routing.prepare(
            IncomingRequest(path="/v1/chat/completions", body=chat, request_id="r")
        ).hashes
    )
    assert prepared.hashes
