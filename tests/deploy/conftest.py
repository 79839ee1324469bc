"""Shared pieces of the deployment tests: the Helm renderer, the static manifests, and
the checks every rendered object set goes through.

The chart is rendered by tools/helm_render, a small Go program on Go's text/template and
the sprig library: Helm's own template engine, built here from Debian's Go packages
(no network). Without `go` or sprig the tests that render SKIP and say what to install.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "epp"
STATIC = ROOT / "deploy" / "kubernetes"
HERE = Path(__file__).resolve().parent
VALUES_ALL = HERE / "values-all.yaml"
VALUES_STATIC = HERE / "values-static.yaml"
VALUES_UPSTREAM = HERE / "values-upstream.yaml"

GO_PACKAGES = "golang-go golang-github-masterminds-sprig-dev golang-github-ghodss-yaml-dev"
INSTALL_HINT = f"apt-get install -y {GO_PACKAGES}"
GOPATH = Path(os.environ.get("HELM_RENDER_GOPATH", "/usr/share/gocode"))
GO_IMPORTS = (
    "github.com/Masterminds/sprig",
    "github.com/Masterminds/semver",
    "github.com/ghodss/yaml",
)

# The Kubernetes version the chart is rendered and validated for (the renderer's
# .Capabilities and kubernetes-validate's schemas).
KUBE_VERSION = "1.31.0"


@dataclass
class Rendered:
    text: str
    objects: list[dict]
    notes: str

    def of_kind(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, name: str | None = None) -> dict:
        found = [o for o in self.of_kind(kind) if name is None or o["metadata"]["name"] == name]
        assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
        return found[0]


class RenderError(Exception):
    pass


def load_documents(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def static_files() -> list[Path]:
    kustomization = yaml.safe_load((STATIC / "kustomization.yaml").read_text())
    return [STATIC / name for name in kustomization["resources"]]


def static_objects() -> list[dict]:
    """deploy/kubernetes/ as `kubectl apply -k` would send it (namespace set)."""
    kustomization = yaml.safe_load((STATIC / "kustomization.yaml").read_text())
    objects = [doc for path in static_files() for doc in load_documents(path.read_text())]
    for obj in objects:
        if obj["kind"] != "GatewayClass":
            obj["metadata"]["namespace"] = kustomization["namespace"]
    return objects


def example_objects() -> list[dict]:
    """deploy/kubernetes/examples/: a Gateway (and its class), an InferenceObjective and an
    InferenceModelRewrite, not applied by default (namespace as the kustomization's)."""
    kustomization = yaml.safe_load((STATIC / "kustomization.yaml").read_text())
    objects = [
        doc
        for path in sorted((STATIC / "examples").glob("*.yaml"))
        for doc in load_documents(path.read_text())
    ]
    for obj in objects:
        if obj["kind"] != "GatewayClass":
            obj["metadata"]["namespace"] = kustomization["namespace"]
    return objects


def standalone_envoy_objects() -> list[dict]:
    """deploy/kubernetes/standalone-envoy/ as kustomize builds it: its resources plus the
    ConfigMap its configMapGenerator makes from envoy.yaml (name suffix hash disabled)."""
    base = STATIC / "standalone-envoy"
    kustomization = yaml.safe_load((base / "kustomization.yaml").read_text())
    assert kustomization["generatorOptions"]["disableNameSuffixHash"] is True
    objects = [
        doc
        for name in kustomization["resources"]
        for doc in load_documents((base / name).read_text())
    ]
    for generator in kustomization["configMapGenerator"]:
        objects.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": generator["name"],
                    "labels": generator["options"]["labels"],
                },
                "data": {name: (base / name).read_text() for name in generator["files"]},
            }
        )
    for obj in objects:
        obj["metadata"]["namespace"] = kustomization["namespace"]
    return objects


def _go_env(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "GO111MODULE": "off", "GOPATH": str(GOPATH), "GOFLAGS": ""}
    env.setdefault("CGO_ENABLED", "0")
    if not (env.get("GOCACHE") or env.get("XDG_CACHE_HOME") or env.get("HOME")):
        env["GOCACHE"] = str(tmp / "gocache")
    return env


@pytest.fixture(scope="session")
def helm_render_binary(tmp_path_factory) -> Path:
    """tools/helm_render built with Debian's Go packages (GOPATH mode, no network)."""
    go = shutil.which("go")
    if go is None:
        pytest.skip(f"`go` is not installed, so the Helm chart cannot be rendered: {INSTALL_HINT}")
    missing = [imp for imp in GO_IMPORTS if not (GOPATH / "src" / imp).is_dir()]
    if missing:
        pytest.skip(
            f"Go packages missing under {GOPATH}: {', '.join(missing)} "
            f"(Helm's template functions): {INSTALL_HINT}"
        )
    tmp = tmp_path_factory.mktemp("helm_render")
    binary = tmp / "helm_render"
    build = subprocess.run(
        [go, "build", "-o", str(binary), "./tools/helm_render"],
        cwd=ROOT,
        env=_go_env(tmp),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, f"go build ./tools/helm_render failed:\n{build.stderr}"
    return binary


@pytest.fixture(scope="session")
def render_chart(helm_render_binary, tmp_path_factory) -> Callable[..., Rendered]:
    """render_chart(values files..., set=[...], chart=CHART, name="epp", namespace="default")
    -> Rendered; raises RenderError with the renderer's message when it fails."""
    notes_dir = tmp_path_factory.mktemp("notes")
    counter = iter(range(1_000_000))

    def render(
        *values: Path,
        set: Iterable[str] = (),
        chart: Path = CHART,
        name: str = "epp",
        namespace: str = "default",
        extra_args: Iterable[str] = (),
    ) -> Rendered:
        notes = notes_dir / f"notes-{next(counter)}.txt"
        args = [str(helm_render_binary), "--name", name, "--namespace", namespace]
        args += ["--kube-version", KUBE_VERSION, "--notes", str(notes), *extra_args]
        for path in values:
            args += ["-f", str(path)]
        for expr in set:
            args += ["--set", expr]
        proc = subprocess.run([*args, str(chart)], capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RenderError(proc.stderr.strip())
        return Rendered(
            proc.stdout,
            load_documents(proc.stdout),
            notes.read_text() if notes.exists() else "",
        )

    return render


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "image_install: runs the Dockerfile's pip steps in a fresh virtualenv (~20-40 s, "
        "pip cache reused; deselect with -m 'not image_install')",
    )
