# syntax=docker/dockerfile:1
# The endpoint picker (`epp serve`) and nothing else: no [sim], [demo], [bench] or [dev]
# extra, no compiler, no pip. Build: docker build -t epp:0.1.0 .
#
# Base image: Python 3.12.14 on Debian 12 (bookworm), pinned by the digest of its
# multi-platform image index (amd64, arm64, arm/v7, 386, ppc64le), the same in both stages.
# Source of the digest: docker-library/repo-info, repos/python/remote/3.12.14-slim-bookworm.md
# at commit 33a22f41ac7bf613bc03380b0317536a9a7fb5e8 (the official image as built on
# 2026-08-25 from Debian's 2026-08-24 snapshot); read on 2026-12-02, when Docker Hub itself
# could not be reached from the machine this was written on.
# Refresh (a new Python patch release or Debian security updates), then `make image-lock`:
#   docker buildx imagetools inspect python:3.12.14-slim-bookworm   # "Digest:" line
#   crane digest python:3.12.14-slim-bookworm                       # the same digest
# and put python:<version>-slim-bookworm@sha256:<digest> in BOTH FROM lines.

# ---- builder: the router and its locked dependencies in a virtualenv (/opt/venv) -------
FROM python:3.12.14-slim-bookworm@sha256:0f5b26b9518d002b6173fd61daad821fa340635ebfec5bba471013f9ca114579 AS builder
WORKDIR /src
# Exact versions with the sha256 of every file (make image-lock): pip refuses anything else.
COPY requirements/image.lock requirements/image-build.lock ./requirements/
# The virtualenv gets no pip, setuptools or wheel: the base image's pip installs into it.
RUN python -m venv --without-pip /opt/venv \
    && python -m pip --python /opt/venv/bin/python install --no-cache-dir --disable-pip-version-check --require-hashes --no-deps -r requirements/image.lock
# .dockerignore lets in only the locks, these files and src/epp (the wheel holds the
# router package and none of the harness packages beside it).
COPY pyproject.toml setup.py README.md ./
COPY src/epp ./src/epp
# gcc builds the compiled kernels (src/epp/*/_kernels.c) into the wheel: only
# this stage has it, the runtime stage gets the built module. Debian moves these versions
# with its security updates, so they are not pinned (the base image's digest is).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# The wheel is built with the locked build requirements (no build isolation, which would
# fetch unpinned setuptools) and installed without dependencies: the lock has them all.
RUN python -m pip install --no-cache-dir --disable-pip-version-check --require-hashes --no-deps -r requirements/image-build.lock \
    && python -m pip wheel --no-cache-dir --disable-pip-version-check --no-build-isolation --no-deps --wheel-dir /wheels . \
    && python -m pip --python /opt/venv/bin/python install --no-cache-dir --disable-pip-version-check --no-deps /wheels/epp-*.whl

# ---- runtime: the base image, the virtualenv, a non-root user -------------------------------
FROM python:3.12.14-slim-bookworm@sha256:0f5b26b9518d002b6173fd61daad821fa340635ebfec5bba471013f9ca114579
LABEL org.opencontainers.image.title="epp" \
      org.opencontainers.image.description="Endpoint picker for LLM inference (Envoy ext_proc)" \
      org.opencontainers.image.licenses="Apache-2.0"
# Byte code was compiled at install time: nothing is written at run time, so the root
# file system can be read-only.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=builder /opt/venv /opt/venv
# Nothing installs packages at run time: the base image's own pip goes too (its Python,
# not the virtualenv's, which has none).
RUN /usr/local/bin/python -m pip uninstall --yes --disable-pip-version-check pip \
    && groupadd --system --gid 65532 epp \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin epp
USER 65532:65532
WORKDIR /tmp
# 9002: ext_proc (TLS by default) and gRPC health; 9003: gRPC health, plaintext
# (server.grpc_health_port); 9090: /metrics, /healthz, /ready; 9010: the replicas' peers
# protocol (replicas.listen_port).
EXPOSE 9002 9003 9090 9010
# No curl in the slim image: Python asks the EPP's own liveness endpoint.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:9090/healthz', timeout=2).status == 200 else 1)"]
# The upstream charts pass only args: they reach `epp serve` unchanged.
ENTRYPOINT ["epp", "serve"]
# Kubernetes passes the flags (args:), e.g. --config /etc/epp/config.yaml --pool-name NAME.
CMD ["--config", "/etc/epp/config.yaml"]
