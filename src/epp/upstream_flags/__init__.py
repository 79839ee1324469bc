"""The upstream EPP's command-line flags, accepted by `epp serve`.

Our image's ENTRYPOINT is `epp serve`, so the `args:` of an upstream chart or manifest
(GIE's `epplib`/`inferencepool` charts up to v1.5, GIE's conformance manifests, the llm-d
router's `routerlib` chart, the llm-d guides) reach this parser unchanged. `translate`
reads them with Go's flag syntax, which both of upstream's parsers accept:

- one or two dashes (`-poolName`, `--pool-name`); camelCase (GIE up to v0.5) or kebab
  names (GIE v1.x, the llm-d router), one table of kebab names for both;
- `-x v` and `-x=v` for a flag that takes a value: the next argument is the value
  whatever it looks like (`--lora-info-metric ""` included);
- a boolean alone is true, `-x=false` sets it; a bare `true`/`false` right after a
  boolean is taken as its value (GIE v1.5's chart renders its `flags:` map as
  `--key` `"value"`, which Go's parser would read as true plus a stray argument);
- `-v4` as `-v 4` (pflag's shorthand form).

Each upstream flag is either mapped to our configuration (`MAPPED`), already what we do
(`HONOURED`), or accepted and ignored (everything else in `FLAGS`), the ignored ones named
in one warning. Our own flags pass through to argparse under their `--kebab` name; any
other flag stays an error there.

Sources: the flag definitions of llm-d-router v0.10.0 (pkg/epp/server/options.go,
pkg/common/observability/logging), GIE v0.1.0 to v1.5.0 (cmd/epp, pkg/epp/server) and
controller-runtime's zap flags (`zap.Options.BindFlags`).

Modules: `table` (every flag and what it becomes), `values` (Go's value syntax),
`translate` (argv -> our arguments and config overrides), `config_source`
(--config-file / --config-text).
"""

from epp.upstream_flags.config_source import (
    is_upstream_config,
    read_config_source,
    refuse_disaggregation,
)
from epp.upstream_flags.table import (
    BOOLEANS,
    FLAGS,
    HONOURED,
    IGNORED,
    MAPPED,
    METRIC_SPEC_FLAGS,
    POOL_GROUPS,
    SHARED,
    UPSTREAM_CONFIG_GROUPS,
    UPSTREAM_CONFIG_KIND,
)
from epp.upstream_flags.translate import UpstreamArgs, translate
from epp.upstream_flags.values import (
    FlagError,
    kebab,
    parse_bool,
    parse_duration,
    verbosity_level,
    zap_level,
)

__all__ = [
    "BOOLEANS",
    "FLAGS",
    "HONOURED",
    "IGNORED",
    "MAPPED",
    "METRIC_SPEC_FLAGS",
    "POOL_GROUPS",
    "SHARED",
    "UPSTREAM_CONFIG_GROUPS",
    "UPSTREAM_CONFIG_KIND",
    "FlagError",
    "UpstreamArgs",
    "is_upstream_config",
    "kebab",
    "parse_bool",
    "parse_duration",
    "read_config_source",
    "refuse_disaggregation",
    "translate",
    "verbosity_level",
    "zap_level",
]
