# syntax=docker/dockerfile:1
# The endpoint picker (epp serve) and nothing else: no [sim], [demo], [bench] or [dev]
# extra. Build: docker build -t epp:0.1.0 .
#
# Base image: an exact Python and Debian release. Pin its digest too where you build
# (the digest could not be looked up on the machine this was written on):
#   docker buildx imagetools inspect python:3.12.12-slim-bookworm
# and use FROM python:3.12.12-slim-bookworm@sha256:<digest> in both stages.
ARG PYTHON_IMAGE=python:3.12.12-slim-bookworm

# ---- builder: the project's wheel -----------------------------------------------------
FROM ${PYTHON_IMAGE} AS builder
WORKDIR /src
# .dockerignore lets only these in.
COPY pyproject.toml README.md ./
# Only the router package: the wheel holds `epp` and nothing of the harness beside it.
COPY src/epp ./src/epp
RUN python -m pip wheel --no-cache-dir --disable-pip-version-check --no-deps --wheel-dir /wheels .

# ---- runtime ---------------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="epp" \
      org.opencontainers.image.description="Endpoint picker for LLM inference (Envoy ext_proc)" \
      org.opencontainers.image.licenses="Apache-2.0"
# Byte code is compiled at install time: nothing is written at run time, so the root
# file system can be read-only.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# The wheel without extras: the router's dependencies only (pyproject.toml [project]).
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    python -m pip install --no-cache-dir --disable-pip-version-check --compile /wheels/epp-*.whl \
    && groupadd --system --gid 65532 epp \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin epp
USER 65532:65532
WORKDIR /tmp
# 9002: ext_proc and gRPC health (liveness, readiness); 9090: /metrics, /healthz, /ready.
EXPOSE 9002 9090
# No curl in the slim image: Python asks the EPP's own liveness endpoint.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:9090/healthz', timeout=2).status == 200 else 1)"]
ENTRYPOINT ["epp", "serve"]
# Kubernetes passes the flags (args:), e.g. --config /etc/epp/config.yaml --pool-name NAME.
CMD ["--config", "/etc/epp/config.yaml"]
