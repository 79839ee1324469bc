"""tools/helm_render behaves like `helm template` for the features the chart uses.

Each test renders a small chart written here and compares with what Helm 3 documents
(and does): include/define, nindent, tpl, required, toYaml/fromYaml/toJson, value
coalescing (-f files, --set, null deletes a default), the built-in objects, partials and
NOTES.txt not rendered as manifests, "<no value>" blanked, env functions removed, the
chart's kubeVersion constraint, YAML errors, and Helm's install order.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import yaml

from deploy.conftest import RenderError

CHART_YAML = """\
apiVersion: v2
name: demo
version: 1.2.3
appVersion: "4.5"
kubeVersion: ">=1.25.0-0"
"""

VALUES = """\
replicas: 2
ratio: 0.25
labels:
  team: a
nested:
  keep: yes-kept
  drop: to-be-dropped
  deeper: {a: 1, b: 2}
list: [1, 2]
greeting: "Hello {{ .Release.Name }} from {{ .Chart.Name }}"
raw: "a: 1\\nb: [x, z]\\n"
"""

HELPERS = """\
{{- define "demo.labels" -}}
app: {{ .Chart.Name }}
release: {{ .Release.Name }}
{{- end -}}
"""


def make_chart(root: Path, templates: dict[str, str], values: str = VALUES) -> Path:
    chart = root / "demo"
    (chart / "templates").mkdir(parents=True)
    (chart / "files").mkdir()
    (chart / "Chart.yaml").write_text(CHART_YAML)
    (chart / "values.yaml").write_text(values)
    (chart / "files" / "greeting.txt").write_text("hi from a file\n")
    (chart / "templates" / "_helpers.tpl").write_text(HELPERS)
    for name, text in templates.items():
        (chart / "templates" / name).write_text(textwrap.dedent(text))
    return chart


def config_map(body: str) -> str:
    return "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: demo\n" + textwrap.dedent(body)


@pytest.fixture
def chart(tmp_path) -> Path:
    return make_chart(
        tmp_path,
        {
            "cm.yaml": config_map(
                """\
                  labels:
                    {{- include "demo.labels" . | nindent 4 }}
                data:
                  values: |
                    {{- toYaml .Values.nested | nindent 4 }}
                  greeting: {{ tpl .Values.greeting . | quote }}
                  raw-b: {{ (fromYaml .Values.raw).b | toJson | quote }}
                  list: {{ toJson .Values.list | quote }}
                  missing: "{{ .Values.nope }}"
                  kinds: "{{ kindOf .Values.replicas }} {{ kindOf .Values.ratio }}"
                  release: "{{ .Release.Name }} {{ .Release.Namespace }} {{ .Release.Service }}"
                  chart: "{{ .Chart.Name }} {{ .Chart.Version }} {{ .Chart.AppVersion }}"
                  kube: "{{ .Capabilities.KubeVersion.Version }} {{ .Capabilities.KubeVersion.Major }}.{{ .Capabilities.KubeVersion.Minor }}"
                  has-apps: "{{ .Capabilities.APIVersions.Has "apps/v1" }}"
                  has-monitoring: "{{ .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}"
                  template: "{{ .Template.Name }}"
                  file: {{ .Files.Get "files/greeting.txt" | trim | quote }}
                  lookup: "{{ len (lookup "v1" "Secret" "default" "x") }}"
                  replicas: "{{ .Values.replicas }}"
                  team: "{{ .Values.labels.team }}"
                """
            ),
            "_partial.yaml": "apiVersion: v1\nkind: Secret\nmetadata: {name: never}\n",
            "NOTES.txt": "Installed {{ .Release.Name }} ({{ .Values.replicas }} replicas)\n",
            "multi.yaml": textwrap.dedent(
                """\
                ---
                apiVersion: apps/v1
                kind: Deployment
                metadata: {name: first}
                ---
                apiVersion: v1
                kind: ServiceAccount
                metadata: {name: second}
                """
            ),
        },
    )


def data(rendered) -> dict:
    return rendered.one("ConfigMap", "demo")["data"]


def test_functions_and_builtin_objects(render_chart, chart):
    rendered = render_chart(chart=chart, name="rel", namespace="ns")
    cm = rendered.one("ConfigMap", "demo")
    assert cm["metadata"]["labels"] == {"app": "demo", "release": "rel"}
    out = cm["data"]
    assert yaml.safe_load(out["values"]) == {
        "deeper": {"a": 1, "b": 2},
        "drop": "to-be-dropped",
        "keep": "yes-kept",
    }
    # toYaml sorts keys, as Helm's (sigs.k8s.io/yaml) does.
    assert out["values"].splitlines()[0] == "deeper:"
    assert out["greeting"] == "Hello rel from demo"
    assert out["raw-b"] == '["x","z"]'
    assert out["list"] == "[1,2]"
    assert out["missing"] == ""  # not "<no value>"
    assert out["kinds"] == "float64 float64"  # YAML numbers are float64 in Helm
    assert out["release"] == "rel ns Helm"
    assert out["chart"] == "demo 1.2.3 4.5"
    assert out["kube"] == "v1.31.0 1.31"
    assert out["has-apps"] == "true"
    assert out["has-monitoring"] == "false"
    assert out["template"] == "demo/templates/cm.yaml"
    assert out["file"] == "hi from a file"
    assert out["lookup"] == "0"


def test_partials_and_notes_are_not_manifests(render_chart, chart):
    rendered = render_chart(chart=chart, name="rel")
    assert [o["metadata"]["name"] for o in rendered.objects if o["kind"] == "Secret"] == []
    assert "Installed" not in rendered.text
    assert rendered.notes == "Installed rel (2 replicas)\n"


def test_output_is_split_sourced_and_in_helm_install_order(render_chart, chart):
    rendered = render_chart(chart=chart)
    assert [o["kind"] for o in rendered.objects] == ["ServiceAccount", "ConfigMap", "Deployment"]
    assert rendered.text.startswith("---\n# Source: demo/templates/multi.yaml\napiVersion: v1\n")
    assert rendered.text.count("---\n# Source: ") == 3


def test_values_files_and_set_coalesce_like_helm(render_chart, chart, tmp_path):
    first = tmp_path / "first.yaml"
    first.write_text("nested:\n  drop: null\n  deeper: {b: 20}\nlabels: {team: b}\nreplicas: 5\n")
    second = tmp_path / "second.yaml"
    second.write_text("labels: {team: c}\n")
    rendered = render_chart(first, second, chart=chart, set=["replicas=7", "ratio=true"])
    out = data(rendered)
    # null removes the default; maps merge key by key; later files win; --set wins last.
    assert yaml.safe_load(out["values"]) == {"deeper": {"a": 1, "b": 20}, "keep": "yes-kept"}
    assert out["team"] == "c"
    assert out["replicas"] == "7"
    assert out["kinds"] == "int64 bool"  # --set parses integers and booleans


def test_api_versions_flag(render_chart, chart):
    rendered = render_chart(chart=chart, extra_args=["--api-versions", "monitoring.coreos.com/v1"])
    assert data(rendered)["has-monitoring"] == "true"


def test_required_fails_with_its_message(render_chart, tmp_path):
    chart = make_chart(
        tmp_path, {"cm.yaml": config_map('data:\n  x: {{ required "x is needed" .Values.x }}\n')}
    )
    with pytest.raises(RenderError, match="x is needed"):
        render_chart(chart=chart)
    assert data(render_chart(chart=chart, set=["x=1"]))["x"] == 1


def test_fail_stops_rendering(render_chart, tmp_path):
    chart = make_chart(tmp_path, {"cm.yaml": '{{ fail "no way" }}\n'})
    with pytest.raises(RenderError, match="no way"):
        render_chart(chart=chart)


def test_env_functions_are_removed_as_in_helm(render_chart, tmp_path):
    chart = make_chart(tmp_path, {"cm.yaml": config_map('data:\n  home: {{ env "HOME" }}\n')})
    with pytest.raises(RenderError, match='function "env" not defined'):
        render_chart(chart=chart)


def test_kube_version_constraint(render_chart, chart):
    with pytest.raises(RenderError, match=re.escape("incompatible with Kubernetes v1.24.0")):
        render_chart(chart=chart, extra_args=["--kube-version", "1.24.0"])


def test_invalid_yaml_output_is_an_error(render_chart, tmp_path):
    chart = make_chart(tmp_path, {"bad.yaml": "apiVersion: v1\nkind: ConfigMap\ndata: [unclosed\n"})
    with pytest.raises(RenderError, match=re.escape("YAML parse error on demo/templates/bad.yaml")):
        render_chart(chart=chart)


def test_chart_yaml_is_checked(render_chart, tmp_path):
    chart = make_chart(tmp_path, {})
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: demo\nversion: not-semver\n")
    with pytest.raises(RenderError, match="version"):
        render_chart(chart=chart)


def test_define_in_a_later_file_is_visible_everywhere_and_tpl_can_include(render_chart, tmp_path):
    chart = make_chart(
        tmp_path,
        {
            "a.yaml": config_map(
                'data:\n  x: {{ include "z.value" . | quote }}\n  y: {{ tpl "{{ include \\"z.value\\" . }}" . | quote }}\n'
            ),
            "z.tpl": '{{- define "z.value" -}}from z{{- end -}}',
        },
    )
    out = data(render_chart(chart=chart))
    assert out == {"x": "from z", "y": "from z"}
