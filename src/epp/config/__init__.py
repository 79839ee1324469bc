"""The EPP's configuration: one validated tree from a YAML file and command-line flags.

Every section forbids unknown keys, so a typo fails at start-up with the offending path
instead of silently running on a default.

Sections by job: `scheduling` (weights, estimates, prefix index, flow control),
`datalayer` (scraping, KV events, tokenizers), `server` (ports, TLS, replicas),
`discovery` (static endpoints, Kubernetes), `root` (`EppConfig` and the cross-section
rules), `loader` (YAML file + overrides). Import from `epp.config`.
"""

from epp.config.base import Strict
from epp.config.datalayer import (
    METRIC_SPEC_KEYS,
    DataLayerConfig,
    KvEventsConfig,
    KvEventsMode,
    TokenizerConfig,
)
from epp.config.discovery import DiscoveryConfig, EndpointConfig
from epp.config.loader import load_config, load_endpoints_file
from epp.config.root import EppConfig
from epp.config.scheduling import (
    DEFAULT_WEIGHTS,
    SPEC_WEIGHTS,
    BalanceConfig,
    FlowControlConfig,
    PrefillEstimateConfig,
    PrefixConfig,
    SchedulingConfig,
)
from epp.config.server import ReplicasConfig, ServerConfig, TlsConfig

__all__ = [
    "DEFAULT_WEIGHTS",
    "METRIC_SPEC_KEYS",
    "SPEC_WEIGHTS",
    "BalanceConfig",
    "DataLayerConfig",
    "DiscoveryConfig",
    "EndpointConfig",
    "EppConfig",
    "FlowControlConfig",
    "KvEventsConfig",
    "KvEventsMode",
    "PrefillEstimateConfig",
    "PrefixConfig",
    "ReplicasConfig",
    "SchedulingConfig",
    "ServerConfig",
    "Strict",
    "TlsConfig",
    "TokenizerConfig",
    "load_config",
    "load_endpoints_file",
]
