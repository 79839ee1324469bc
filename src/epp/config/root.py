"""`EppConfig`: the whole tree, its sections and the rules that span sections."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from epp.config.base import Strict
from epp.config.datalayer import DataLayerConfig, KvEventsConfig, TokenizerConfig
from epp.config.discovery import DiscoveryConfig, EndpointConfig
from epp.config.scheduling import FlowControlConfig, PrefixConfig, SchedulingConfig
from epp.config.server import ReplicasConfig, ServerConfig


class EppConfig(Strict):
    scheduling: SchedulingConfig = Field(default_factory=SchedulingConfig)
    prefix: PrefixConfig = Field(default_factory=PrefixConfig)
    datalayer: DataLayerConfig = Field(default_factory=DataLayerConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    flow_control: FlowControlConfig = Field(default_factory=FlowControlConfig)
    discovery: DiscoveryConfig = Field(default_factory=DiscoveryConfig)
    replicas: ReplicasConfig = Field(default_factory=ReplicasConfig)
    kv_events: KvEventsConfig = Field(default_factory=KvEventsConfig)
    # A model name clients send that is a LoRA adapter of a base model: adapter -> base.
    adapters: dict[str, str] = Field(default_factory=dict)
    # A base model name (as the pods serve it) -> its tokenizer files; adapters use their
    # base model's; other models: the byte estimate.
    tokenizers: dict[str, TokenizerConfig] = Field(default_factory=dict)
    endpoints: list[EndpointConfig] = Field(default_factory=list)
    endpoints_file: Path | None = None
    log_level: Literal["trace", "debug", "info", "warning", "error"] = "info"
    # Log lines as JSON (default) or as zap's `console` text (--zap-encoder console).
    log_format: Literal["json", "console"] = "json"

    @model_validator(mode="after")
    def _keepalive_covers_the_wait(self) -> EppConfig:
        if self.server.keepalive_extension_s < self.flow_control.ttl_s:
            raise ValueError(
                f"server.keepalive_extension_s ({self.server.keepalive_extension_s}) must be at "
                f"least flow_control.ttl_s ({self.flow_control.ttl_s}): a waiting request "
                "would hit Envoy's message timeout first"
            )
        return self

    @model_validator(mode="after")
    def _one_source_of_endpoints(self) -> EppConfig:
        kubernetes = self.discovery.pool_name or self.discovery.endpoint_selector
        if kubernetes and (self.endpoints or self.endpoints_file):
            raise ValueError(
                "discovery.pool_name or endpoint_selector (Kubernetes) and "
                "endpoints/endpoints_file (static) are "
                "exclusive: choose one source of endpoints"
            )
        return self

    @model_validator(mode="after")
    def _unique_endpoints(self) -> EppConfig:
        names = [e.name for e in self.endpoints]
        addresses = [e.address for e in self.endpoints]
        for what, values in (("name", names), ("address", addresses)):
            dupes = sorted({v for v in values if values.count(v) > 1})
            if dupes:
                raise ValueError(f"duplicate endpoint {what}: {', '.join(dupes)}")
        return self
