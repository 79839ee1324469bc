"""`epp serve` takes the upstream EPP's flags (epp/upstream_flags/).

The flag names come from the upstream sources and the arguments from the upstream
manifests and charts, all under tests/fixtures/upstream: the flag definitions of the
llm-d router v0.10.0 and GIE v1.5.0 (pkg/epp/server/options.go, the logging options) and
GIE v0.5.0 (cmd/epp/runner/runner.go); the `args:` of GIE's conformance base manifest,
GIE v0.5.0's manifest and chart, and the llm-d router's chart, rendered by tools/helm_render
(tests/upstream_args.py). Every flag parses, none is an error, the mapped ones land in the
configuration, and the ignored ones are named in one warning.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import structlog
import yaml
from deploy.conftest import RenderError, helm_render_binary, render_chart  # noqa: F401
from upstream_args import (
    GIE_V05_CHART,
    GIE_V15_OPERATOR_VALUES,
    GIE_V15_VALUES,
    LLM_D_OPERATOR_VALUES,
    LLM_D_STANDALONE_VALUES,
    LLM_D_VALUES,
    UPSTREAM,
    conformance_objects,
    epp_containers,
    gie_v05_manifest_objects,
    gie_v15_chart,
    llm_d_chart,
    plugins_files,
)

from epp import upstream_flags
from epp.app import build_parser, config_from_args, main, our_flag_names, parse_serve_args
from epp.config import EppConfig
from epp.observability.logs import configure_logging
from epp.upstream_flags import FlagError, kebab, translate

# Where each upstream EPP defines its flags.
FLAG_SOURCES = [
    UPSTREAM / "llm-d-router-v0.10.0" / "pkg" / "epp" / "server" / "options.go",
    UPSTREAM
    / "llm-d-router-v0.10.0"
    / "pkg"
    / "common"
    / "observability"
    / "logging"
    / "options.go",
    UPSTREAM / "gie-v1.5.0" / "pkg" / "epp" / "server" / "options.go",
    UPSTREAM / "gie-v0.5.0" / "cmd" / "epp" / "runner" / "runner.go",
]
# pflag's fs.XxxVar(&opts.F, "name", ...) / fs.IntVarP(&v, "v", "v", ...) and Go's
# flag.Xxx(\n "name", ...).
DEFINITION = re.compile(
    r"\b(?:fs|flag)\.(?:Int|String|Bool|Duration|IntSlice|StringSlice|Float64)(?:Var)?P?\(\s*"
    r'(?:&[\w.]+,\s*)?"([^"]+)"'
)
# Both upstream EPPs bind controller-runtime's zap flags (zap.Options.BindFlags, which is
# not among the fixtures: its five names, from controller-runtime's pkg/log/zap).
ZAP_FLAGS = [
    "zap-devel",
    "zap-encoder",
    "zap-log-level",
    "zap-stacktrace-level",
    "zap-time-encoding",
]

OURS = our_flag_names(build_parser())
BOOLEANS = upstream_flags.BOOLEANS


def upstream_flag_names() -> list[str]:
    names = {m for path in FLAG_SOURCES for m in DEFINITION.findall(path.read_text())}
    return sorted(names | set(ZAP_FLAGS))


def test_the_sources_define_the_flags_the_charts_use():
    # The extraction itself: a regex that found nothing would make the next test vacuous.
    names = upstream_flag_names()
    for expected in ("pool-name", "poolName", "grpcHealthPort", "secure-serving", "v"):
        assert expected in names
    assert len(names) > 60


# A value each flag takes (booleans take none): the rest take "1".
SAMPLE_VALUES = {
    "drain-timeout": "30s",
    "pool-group": "inference.networking.k8s.io",
    "zap-encoder": "console",
    "zap-log-level": "debug",
    "v": "3",
    "pool-name": "p",
    "pool-namespace": "ns",
    "cert-path": "/etc/epp/certs",
    "config-text": "scheduling: {max_queue: 3}",
    "endpoint-selector": "app=vllm",
    "total-queued-requests-metric": "sglang:num_queue_reqs",
    "total-running-requests-metric": 'nv_trt_llm_request_metrics{request_type="scheduled"}',
    "kv-cache-usage-percentage-metric": '"sglang:token_usage"',
    "lora-info-metric": "",
    "cache-info-metric": "sglang:cache_config_info",
    "model-server-metrics-path": "/prometheus/metrics",
    "model-server-metrics-scheme": "https",
}
# Flags that are valid only together (as upstream's Validate has it).
COMPANIONS = {
    "endpoint-selector": ["--endpoint-target-ports", "8000"],
    "endpoint-target-ports": ["--endpoint-selector", "app=vllm"],
    "ha-enable-leader-election": ["--pool-name", "p"],  # a Lease needs Kubernetes discovery
}


@pytest.mark.parametrize("name", upstream_flag_names())
def test_every_upstream_flag_is_accepted(name, tmp_path):
    key = kebab(name)
    assert key in upstream_flags.FLAGS or key in OURS, f"--{name} is not handled"
    if key == "config-file":
        path = tmp_path / "ours.yaml"
        path.write_text("scheduling: {max_queue: 3}\n")
        value = [str(path)]
    elif key == "kubeconfig":
        value = [str(tmp_path / "kubeconfig")]
    else:
        value = [] if key in BOOLEANS else [SAMPLE_VALUES.get(key, "1")]
    for dashes in ("-", "--"):
        for argv in (
            [f"{dashes}{name}", *value],
            [f"{dashes}{name}={v}" for v in value or ["true"]],
        ):
            parsed, upstream = parse_serve_args([*argv, *COMPANIONS.get(key, [])])
            config_from_args(parsed, upstream)  # mapped values validate
            known = key in upstream_flags.MAPPED or key in upstream_flags.HONOURED
            assert known or key in OURS or upstream.ignored == [argv[0].split("=")[0]]


# --- the upstream manifests' and charts' arguments ----------------------------------------


def value_of(args: list[str], *names: str) -> str | None:
    """The last value given to any of `names` (`-x v` or `-x=v`), read plainly."""
    found = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                found = args[i + 1]
            elif arg.startswith(name + "="):
                found = arg.split("=", 1)[1]
    return found


def with_local_config(args: list[str], files: dict[str, str], tmp_path: Path) -> list[str]:
    """The args with `--config-file` pointing at a local copy of the file the manifest
    mounts there (its ConfigMap's content): the one change a test must make."""
    out = list(args)
    for i, arg in enumerate(out[:-1]):
        if arg in ("--config-file", "-configFile", "--configFile", "-config-file"):
            name = Path(out[i + 1]).name
            local = tmp_path / name
            local.write_text(files[name])
            out[i + 1] = str(local)
    return out


def check_mapped(args: list[str], config: EppConfig) -> None:
    assert config.discovery.pool_name == value_of(args, "--pool-name", "-poolName")
    namespace = value_of(args, "--pool-namespace", "-poolNamespace")
    assert config.discovery.pool_namespace == namespace
    grpc = value_of(args, "--grpc-port", "-grpcPort")
    assert config.server.grpc_port == int(grpc or 9002)
    health = value_of(args, "--grpc-health-port", "-grpcHealthPort")
    assert config.server.grpc_health_port == int(health or 9003)
    metrics = value_of(args, "--metrics-port", "-metricsPort")
    assert config.server.metrics_port == int(metrics or 9090)
    encoder = value_of(args, "--zap-encoder")
    assert config.log_format == (encoder or "json")
    group = value_of(args, "--pool-group")
    assert config.discovery.pool_group == (group or "inference.networking.k8s.io")
    verbosity = value_of(args, "-v", "--v")
    expected = {None: "info", "1": "info", "2": "info", "3": "debug", "4": "debug"}
    assert config.log_level == expected[verbosity]
    # The model server's series and page: as given, without the quotes the charts render.
    datalayer = config.datalayer
    defaults = EppConfig().datalayer
    for flags, key in METRIC_FLAGS.items():
        given = value_of(args, *flags)
        expected_spec = getattr(defaults, key) if given is None else given.strip('"')
        assert getattr(datalayer, key) == expected_spec, (flags, key)
    path = value_of(args, "--model-server-metrics-path", "-modelServerMetricsPath")
    assert datalayer.metrics_path == (path.strip('"') if path else "/metrics")
    port = value_of(args, "--model-server-metrics-port", "-modelServerMetricsPort")
    assert datalayer.metrics_port == int(port or 0)


# Upstream's metric spec flags (both spellings) -> the DataLayerConfig key they set.
METRIC_FLAGS = {
    ("--total-queued-requests-metric", "-totalQueuedRequestsMetric"): "waiting_metric",
    ("--total-running-requests-metric", "-totalRunningRequestsMetric"): "running_metric",
    ("--kv-cache-usage-percentage-metric", "-kvCacheUsagePercentageMetric"): "kv_usage_metric",
    ("--lora-info-metric", "-loraInfoMetric"): "lora_info_metric",
    ("--cache-info-metric", "-cacheInfoMetric"): "cache_info_metric",
}


def upstream_ignored(args: list[str]) -> set[str]:
    """The flags of `args` that change nothing here, by the table's classification."""
    flags = {a.split("=", 1)[0] for a in args if a.startswith("-") and not a[1:2].isdigit()}
    return {f for f in flags if kebab(f.lstrip("-")) in upstream_flags.IGNORED}


def parse(args: list[str]):
    parsed, upstream = parse_serve_args(args)
    return config_from_args(parsed, upstream), upstream


def check_all(args: list[str], files: dict[str, str], tmp_path: Path) -> None:
    local = with_local_config(args, files, tmp_path)
    config, upstream = parse(local)
    check_mapped(local, config)
    assert set(upstream.ignored) == upstream_ignored(local)
    if value_of(local, "--config-file", "-configFile") is not None:
        # Every upstream chart's file is a plugins file (EndpointPickerConfig).
        assert upstream.unapplied_config is not None
        assert "EndpointPickerConfig" in upstream.unapplied_config


def test_conformance_manifest_args(tmp_path):
    objects = conformance_objects()
    containers = epp_containers(objects)
    assert len(containers) >= 3  # one EPP per conformance pool
    for container in containers:
        args = container["args"]
        assert "--grpc-health-port" in args and "--zap-encoder" in args
        check_all(args, plugins_files(objects), tmp_path)
        config, upstream = parse(args)
        assert upstream.ignored == []  # every flag it passes is honoured
        assert config.server.secure_serving is True  # TLS, as the upstream EPP serves


def test_gie_v05_manifest_args_in_go_flag_syntax(tmp_path):
    objects = gie_v05_manifest_objects()
    (container,) = epp_containers(objects)
    args = container["args"]
    assert "-poolName" in args and "-grpcHealthPort" in args and "-configFile" in args
    check_all(args, plugins_files(objects), tmp_path)


@pytest.mark.parametrize("model_server", [None, "triton-tensorrt-llm"])
def test_gie_v05_chart_args(render_chart, tmp_path, model_server):  # noqa: F811
    sets = [f"inferencePool.modelServerType={model_server}"] if model_server else []
    rendered = render_chart(
        set=["inferencePool.modelServers.matchLabels.app=vllm", *sets],
        chart=GIE_V05_CHART,
        name="vllm",
        namespace="llm",
    )
    (container,) = epp_containers(rendered.objects)
    args = container["args"]
    assert "-enablePprof=true" in args
    if model_server:
        assert "-totalQueuedRequestsMetric" in args
    files = plugins_files(rendered.objects)
    # The chart passes a relative `config/default-plugins.yaml`; the file is the ConfigMap's.
    check_all(args, files, tmp_path)


def render_llm_d(render_chart, tmp_path: Path, values: dict) -> tuple[list[str], dict[str, str]]:  # noqa: F811
    user = tmp_path / "operator-values.yaml"
    user.write_text(yaml.safe_dump(values))
    rendered = render_chart(
        LLM_D_VALUES, user, chart=llm_d_chart(tmp_path), name="qwen", namespace="llm-d"
    )
    (container,) = epp_containers(rendered.objects)
    return container["args"], plugins_files(rendered.objects)


def test_llm_d_router_chart_args(render_chart, tmp_path):  # noqa: F811
    args, files = render_llm_d(render_chart, tmp_path, LLM_D_OPERATOR_VALUES)
    for flag in ("--pool-group", "--config-file", "--ha-enable-leader-election", "--tracing=false"):
        assert flag in args
    assert "--metrics-endpoint-auth=false" in args
    check_all(args, files, tmp_path)
    config, upstream = parse(with_local_config(args, files, tmp_path))
    assert set(upstream.ignored) == {"--tracing", "--metrics-endpoint-auth"}
    assert config.log_level == "debug"  # the chart's flags map: --v=4
    # Several replicas: the chart asks for leader election and probes `readiness`.
    assert config.discovery.leader_election is True
    assert upstream.mapped["--ha-enable-leader-election"].startswith("discovery.leader_election")


def test_llm_d_router_chart_standalone_args(render_chart, tmp_path):  # noqa: F811
    try:
        args, files = render_llm_d(render_chart, tmp_path, LLM_D_STANDALONE_VALUES)
    except RenderError as exc:
        pytest.fail(f"the llm-d router chart's standalone mode does not render: {exc}")
    assert "--endpoint-selector" in args and "--pool-name" not in args
    config, upstream = parse(with_local_config(args, files, tmp_path))
    assert upstream.ignored == ["--tracing"]
    assert config.discovery.pool_name is None
    assert config.discovery.endpoint_selector == value_of(args, "--endpoint-selector")
    ports = value_of(args, "--endpoint-target-ports")
    assert ports and config.discovery.target_ports == [int(p) for p in ports.split(",")]


@pytest.mark.parametrize("operator_values", [False, True])
def test_gie_v15_chart_args(render_chart, tmp_path, operator_values):  # noqa: F811
    files_ = [GIE_V15_VALUES]
    if operator_values:
        user = tmp_path / "operator-values.yaml"
        user.write_text(yaml.safe_dump(GIE_V15_OPERATOR_VALUES))
        files_.append(user)
    else:
        user = tmp_path / "required-values.yaml"  # the chart requires the pool's selector
        user.write_text("inferencePool: {modelServers: {matchLabels: {app: vllm}}}\n")
        files_.append(user)
    rendered = render_chart(*files_, chart=gie_v15_chart(tmp_path), name="vllm", namespace="llm")
    (container,) = epp_containers(rendered.objects)
    args = container["args"]
    check_all(args, plugins_files(rendered.objects), tmp_path)
    config, upstream = parse(with_local_config(args, plugins_files(rendered.objects), tmp_path))
    if operator_values:
        # Its flags map renders `--secure-serving` `"false"`: read as the operator meant.
        assert value_of(args, "--secure-serving") == "false"
        assert config.server.secure_serving is False
        # Triton: `--lora-info-metric ""` reads no LoRA series.
        assert config.datalayer.lora_info_metric == ""
        assert config.discovery.leader_election is True
        assert "--ha-enable-leader-election" in upstream.mapped


# What GIE v1.5.0's chart passes for each `inferencePool.modelServerType` (its
# _deployment.yaml), as the EPP's configuration must then read it.
MODEL_SERVER_SERIES = {
    "sglang": (
        "sglang:num_queue_reqs",
        "sglang:num_running_reqs",
        "sglang:token_usage",
        "vllm:lora_requests_info",  # not passed: upstream's default, absent from the page
        "sglang:cache_config_info",
        "/metrics",
    ),
    "triton-tensorrt-llm": (
        "nv_trt_llm_request_metrics{request_type=waiting}",
        "nv_trt_llm_request_metrics{request_type=scheduled}",
        "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}",
        "",
        "vllm:cache_config_info",
        "/metrics",
    ),
    "trtllm-serve": (
        "trtllm_num_requests_waiting",
        "trtllm_num_requests_running",
        "trtllm_kv_cache_utilization",
        "",
        "trtllm_cache_config_info",
        "/prometheus/metrics",
    ),
}


@pytest.mark.parametrize("model_server", sorted(MODEL_SERVER_SERIES))
def test_gie_v15_chart_model_server_types(render_chart, tmp_path, model_server):  # noqa: F811
    user = tmp_path / "values.yaml"
    user.write_text(
        yaml.safe_dump(
            {
                "inferencePool": {
                    "modelServers": {"matchLabels": {"app": model_server}},
                    "modelServerType": model_server,
                }
            }
        )
    )
    rendered = render_chart(
        GIE_V15_VALUES, user, chart=gie_v15_chart(tmp_path), name="pool", namespace="llm"
    )
    (container,) = epp_containers(rendered.objects)
    files = plugins_files(rendered.objects)
    check_all(container["args"], files, tmp_path)
    config, upstream = parse(with_local_config(container["args"], files, tmp_path))
    d = config.datalayer
    read = (
        d.waiting_metric,
        d.running_metric,
        d.kv_usage_metric,
        d.lora_info_metric,
        d.cache_info_metric,
        d.metrics_path,
    )
    assert read == MODEL_SERVER_SERIES[model_server]
    assert not {f for f in upstream.ignored if "metric" in f}


def test_endpoint_target_ports_is_a_comma_list_and_adds_up():
    config, _ = parse(
        ["--endpoint-selector", "app=vllm", "--endpoint-target-ports", "8000,8001",
         "-endpointTargetPorts=8002"]
    )  # fmt: skip
    assert config.discovery.endpoint_selector == "app=vllm"
    assert config.discovery.target_ports == [8000, 8001, 8002]
    with pytest.raises(FlagError, match="invalid integer"):
        parse(["--endpoint-selector", "app=vllm", "--endpoint-target-ports", "http"])


# --- Go's flag syntax ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["--pool-name", "p", "--grpc-health-port", "9103"],
        ["-pool-name", "p", "-grpc-health-port=9103"],
        ["-poolName", "p", "-grpcHealthPort", "9103"],
        ["--poolName=p", "--grpcHealthPort=9103"],
    ],
)
def test_one_or_two_dashes_camel_or_kebab_space_or_equals(args):
    config, _ = parse(args)
    assert config.discovery.pool_name == "p"
    assert config.server.grpc_health_port == 9103


@pytest.mark.parametrize(
    ("args", "secure"),
    [
        (["--secure-serving"], True),
        (["--secure-serving=false"], False),
        (["-secureServing=false"], False),
        (["--secure-serving=0"], False),
        (["--secure-serving=true"], True),
        (["--secure-serving", "false"], False),  # GIE v1.5's chart renders its flags so
        (["--secure-serving", "0"], False),  # any value Go's ParseBool reads
        (["--secure-serving", "F"], False),
        (["--secure-serving", "1"], True),
    ],
)
def test_booleans(args, secure):
    config, _ = parse(["--pool-name", "p", *args])
    assert config.server.secure_serving is secure


def test_a_boolean_does_not_take_the_next_flag_as_its_value():
    config, upstream = parse(["--tracing", "--pool-name", "p", "--ha-enable-leader-election"])
    assert config.discovery.pool_name == "p"
    assert upstream.ignored == ["--tracing"]
    assert config.discovery.leader_election is True


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--ha-enable-leader-election"], True),
        (["-haEnableLeaderElection"], True),
        (["--ha-enable-leader-election=false"], False),
        ([], False),
    ],
)
def test_leader_election_flag_maps_to_discovery_leader_election(args, expected):
    config, upstream = parse(["--pool-name", "p", *args])
    assert config.discovery.leader_election is expected
    assert not upstream.ignored


def test_leader_election_needs_kubernetes_discovery(tmp_path):
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text("endpoints: [{name: a, address: '127.0.0.1:8000'}]\n")
    with pytest.raises(ValueError, match="leader_election needs Kubernetes discovery"):
        parse(["--endpoints", str(endpoints), "--ha-enable-leader-election"])


def test_a_value_flag_takes_the_next_argument_whatever_it_is():
    # GIE v1.5's chart: `--lora-info-metric ""` (Triton has no LoRA metric).
    config, upstream = parse(["--lora-info-metric", "", "--pool-name", "p"])
    assert config.discovery.pool_name == "p" and config.datalayer.lora_info_metric == ""
    assert upstream.mapped["--lora-info-metric"] == "datalayer.lora_info_metric"


@pytest.mark.parametrize(
    ("args", "level"),
    [
        (["-v", "1"], "info"),
        (["-v", "2"], "info"),
        (["-v=3"], "debug"),
        (["--v=4"], "debug"),
        (["-v4"], "debug"),
        (["-v", "5"], "trace"),
        (["--zap-log-level", "debug"], "debug"),
        (["--zap-log-level=error"], "error"),
        (["--zap-log-level", "5"], "trace"),
        (["-v", "5", "--zap-log-level", "info"], "info"),  # as upstream: zap-log-level wins
        (["-v", "5", "--log-level", "warning"], "warning"),  # ours wins over both
    ],
)
def test_verbosity(args, level):
    config, _ = parse(args)
    assert config.log_level == level


def test_log_level_env_applies_when_no_flag_sets_one(monkeypatch):
    monkeypatch.setenv("EPP_LOG_LEVEL", "debug")
    assert parse([])[0].log_level == "debug"
    assert parse(["-v", "5"])[0].log_level == "trace"


def test_pool_group_is_one_of_the_two_inference_pool_groups():
    config, _ = parse(["--pool-group", "inference.networking.x-k8s.io"])
    assert config.discovery.pool_group == "inference.networking.x-k8s.io"
    with pytest.raises(FlagError, match="not an InferencePool group"):
        parse(["--pool-group", "example.com"])
    with pytest.raises(ValueError):
        EppConfig.model_validate({"discovery": {"pool_group": "example.com"}})


def test_cert_path_is_a_directory_of_tls_crt_and_tls_key(tmp_path):
    config, _ = parse(["--cert-path", str(tmp_path)])
    assert config.server.tls is not None
    assert config.server.tls.cert_file == tmp_path / "tls.crt"
    assert config.server.tls.key_file == tmp_path / "tls.key"
    config, upstream = parse(["--cert-path", str(tmp_path), "--secure-serving=false"])
    assert config.server.tls is None and config.server.secure_serving is False
    assert any("--cert-path" in note for note in upstream.notes)


def test_drain_timeout_is_a_go_duration():
    assert parse(["--drain-timeout", "1m30s"])[0].server.drain_timeout_s == 90.0
    assert parse(["--drain-timeout=500ms"])[0].server.drain_timeout_s == 0.5
    with pytest.raises(FlagError, match="invalid duration"):
        parse(["--drain-timeout", "soon"])


def test_https_model_server_metrics_are_not_verified_unless_asked_as_upstream():
    # Upstream's --model-server-metrics-https-insecure-skip-verify defaults to true.
    config, upstream = parse(["--model-server-metrics-scheme=https", "--pool-name", "p"])
    assert config.datalayer.metrics_scheme == "https"
    assert config.datalayer.scrape_insecure_skip_verify is True
    assert any("not verified" in note for note in upstream.notes)
    config, upstream = parse(
        ["--model-server-metrics-scheme", '"https"', "--pool-name", "p",
         "--model-server-metrics-https-insecure-skip-verify=false"]
    )  # fmt: skip
    assert config.datalayer.scrape_insecure_skip_verify is False and not upstream.notes
    assert parse(["--model-server-metrics-port", "9400"])[0].datalayer.metrics_port == 9400


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--grpc-health-port"], "needs a value"),
        (["-v"], "needs a value"),
        (["-v", "lots"], "invalid integer"),
        (["--zap-encoder", "xml"], "invalid encoder"),
        (["--tracing=maybe"], "invalid boolean"),
        (["--total-queued-requests-metric", "q{a!=b}"], "only '=' label matchers"),
        (["--kv-cache-usage-percentage-metric", "kv{a=b"], "must close with '}'"),
        (["--model-server-metrics-scheme", "ftp"], "not a scheme"),
        (["--model-server-metrics-path", "metrics"], "not a URL path"),
    ],
)
def test_malformed_upstream_flags_are_one_line_errors(args, message, capsys):
    if args[0] == "--grpc-health-port":  # ours: argparse says it
        with pytest.raises(SystemExit):
            parse_serve_args(args)
        return
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flag", ["--no-such-flag", "-poolNmae", "--pool", "--grpc"])
def test_flags_neither_ours_nor_upstreams_are_errors(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_serve_args([flag, "x"])
    assert exit_.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err


def test_our_flags_keep_working(tmp_path):
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text("endpoints:\n  - {name: a, address: 127.0.0.1:8000}\n")
    ours = tmp_path / "epp.yaml"
    ours.write_text("scheduling: {max_queue: 7}\n")
    config, upstream = parse(
        [
            "--config", str(ours), "--endpoints", str(endpoints),
            "--grpc-host", "127.0.0.1", "--grpc-port", "0", "--metrics-host", "127.0.0.1",
            "--metrics-port", "0", "--log-level", "warning", "--grpc-health-port", "0",
        ]
    )  # fmt: skip
    assert config.scheduling.max_queue == 7 and config.endpoints_file == endpoints
    assert (config.server.grpc_host, config.server.grpc_port) == ("127.0.0.1", 0)
    assert config.server.grpc_health_port == 0 and config.log_level == "warning"
    assert upstream.ignored == [] and upstream.mapped == {}


def test_help_in_either_spelling(capsys):
    for flag in ("-h", "--help", "-help"):
        with pytest.raises(SystemExit) as exit_:
            parse_serve_args([flag])
        assert exit_.value.code == 0
        assert "upstream EPP's flags" in capsys.readouterr().out


# --- configuration files -------------------------------------------------------------------


def test_config_file_in_our_format_is_loaded(tmp_path):
    ours = tmp_path / "ours.yaml"
    ours.write_text("scheduling: {max_queue: 9}\nendpoints_file: eps.yaml\n")
    (tmp_path / "eps.yaml").write_text("endpoints: []\n")
    config, upstream = parse(["--configFile", str(ours), "--grpc-port", "7"])
    assert config.scheduling.max_queue == 9 and config.server.grpc_port == 7
    assert config.endpoints_file == tmp_path / "eps.yaml"  # relative to the file, as --config
    assert upstream.unapplied_config is None
    config, _ = parse(["--config-text", "scheduling: {max_queue: 11}", "--grpc-port", "8"])
    assert config.scheduling.max_queue == 11 and config.server.grpc_port == 8
    with pytest.raises(ValueError, match="keep one"):
        parse(["--config", str(ours), "--config-file", str(ours)])


def test_an_upstream_plugins_file_is_not_applied_and_said_so(tmp_path):
    plugins = tmp_path / "default-plugins.yaml"
    plugins.write_text(plugins_files(gie_v05_manifest_objects())["default-plugins.yaml"])
    ours = tmp_path / "ours.yaml"
    ours.write_text("scheduling: {max_queue: 5}\n")
    # The upstream file beside our own --config: ours applies, the upstream one is named.
    config, upstream = parse(["--config-file", str(plugins), "--config", str(ours)])
    assert config.scheduling.max_queue == 5
    assert upstream.unapplied_config == (
        f"{plugins} (inference.networking.x-k8s.io/v1alpha1 EndpointPickerConfig)"
    )
    text = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nplugins: []\n"
    config, upstream = parse(["--config-text", text])
    assert config == EppConfig(log_level=config.log_level)
    assert upstream.unapplied_config is not None


LLMD_CONFIGS = Path(__file__).parent / "fixtures/upstream/llm-d-router-v0.10.0/deploy/config"


@pytest.mark.parametrize("name", ["pd-epp-config.yaml", "sim-e-p-d-epp-config.yaml"])
def test_a_disaggregated_serving_plugins_file_is_refused(name):
    """The llm-d router's own P/D and E/P/D configs schedule prefill, decode and encode
    pods apart; this EPP would send whole prompts to prefill-only pods: one line, exit 2."""
    with pytest.raises(ValueError, match="disaggregated-serving EndpointPickerConfig"):
        parse(["--config-file", str(LLMD_CONFIGS / name)])


@pytest.mark.parametrize(
    "name", ["epp-config.yaml", "dp-epp-config.yaml", "epp-precise-prefix-cache-config.yaml"]
)
def test_a_single_profile_plugins_file_is_accepted_and_not_applied(name):
    _, upstream = parse(["--config-file", str(LLMD_CONFIGS / name)])
    assert upstream.unapplied_config is not None


def test_one_warning_names_every_ignored_flag(tmp_path):
    plugins = tmp_path / "p.yaml"
    plugins.write_text("apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n")
    args = [
        "--pool-name", "p", "--tracing=false", "--ha-enable-leader-election",
        "--metrics-endpoint-auth=false", "-enablePprof=false", "--config-file", str(plugins),
        "--zap-encoder", "json",
    ]  # fmt: skip
    _, upstream = parse(args)
    stream = io.StringIO()
    configure_logging("info", stream)
    upstream.report(structlog.get_logger("epp.app"))
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    warnings = [line for line in lines if line["level"] == "warning"]
    ignored = [line for line in warnings if line["event"] == "upstream_flags_ignored"]
    assert len(ignored) == 1
    assert ignored[0]["flags"] == [
        "--tracing",
        "--metrics-endpoint-auth",
        "-enablePprof",
    ]
    (config_warning,) = [w for w in warnings if w["event"] == "upstream_config_not_applied"]
    assert "--config" in config_warning["detail"]
    (mapped,) = [line for line in lines if line["event"] == "upstream_flags_mapped"]
    assert "--zap-encoder" in mapped["flags"]


def test_console_encoder_sets_the_log_format():
    assert parse(["--zap-encoder", "console"])[0].log_format == "console"
    stream = io.StringIO()
    configure_logging("info", stream, fmt="console")
    structlog.get_logger("t").info("hello", pod="a")
    line = stream.getvalue()
    assert "hello" in line and "pod=a" in line and not line.startswith("{")


def test_translate_leaves_positional_arguments_to_argparse():
    assert translate(["stray"], OURS).ours == ["stray"]
    with pytest.raises(SystemExit):
        parse_serve_args(["stray"])
