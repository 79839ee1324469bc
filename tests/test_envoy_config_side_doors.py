"""`epp envoy-config` removes the headers a client must not choose: the InferenceObjective
(its priority) unless --keep-objective-headers. What Envoy then forwards is checked end to
end in tests/e2e/test_side_doors_e2e.py."""

from __future__ import annotations

import yaml

from epp.datalayer.discovery.models import OBJECTIVE_HEADERS
from epp.envoy_config import main, render


def _removed(config: str) -> list[str]:
    listener = yaml.safe_load(config)["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    mutations = hcm["early_header_mutation_extensions"][0]["typed_config"]["mutations"]
    return [m["remove"] for m in mutations]


def _render(**kw) -> str:
    return render(mode="epp", listen_port=1, admin_port=2, epp_port=3, pods=["127.0.0.1:4"], **kw)


def test_objective_headers_are_removed_by_default():
    removed = _removed(_render())
    assert set(OBJECTIVE_HEADERS) <= set(removed)  # the names the EPP reads
    assert "x-gateway-destination-endpoint" in removed


def test_keep_objective_headers_keeps_them_and_only_them():
    removed = _removed(_render(keep_objective_headers=True))
    assert not set(OBJECTIVE_HEADERS) & set(removed)
    assert "x-gateway-destination-endpoint" in removed and "x-epp-route-token" in removed


def test_strip_header_adds_names_once_lower_cased():
    removed = _removed(_render(strip_headers=["X-Priority", "x-llm-d-inference-objective"]))
    assert removed.count("x-llm-d-inference-objective") == 1 and "x-priority" in removed


def test_the_cli_flag(capsys):
    argv = ["--mode", "epp", "--pod", "127.0.0.1:4"]
    main([*argv])
    assert set(OBJECTIVE_HEADERS) <= set(_removed(capsys.readouterr().out))
    main([*argv, "--keep-objective-headers"])
    assert not set(OBJECTIVE_HEADERS) & set(_removed(capsys.readouterr().out))
