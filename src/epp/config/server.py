"""Serving sections: the gRPC/HTTP ports and their TLS, EPP replicas."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from epp.addresses import AddressError, parse_host_port
from epp.config.base import Strict


class TlsConfig(Strict):
    """TLS on the gRPC port. The files are re-read when they change (a rotated Secret), so
    new connections get the new certificate without a restart."""

    cert_file: Path
    key_file: Path
    # Set: clients must present a certificate signed by this CA (mutual TLS).
    client_ca_file: Path | None = None
    reload_check_s: float = Field(5.0, gt=0.0)


class ServerConfig(Strict):
    grpc_host: str = "0.0.0.0"
    grpc_port: int = Field(9002, ge=0, le=65535)
    # gRPC health (plaintext, on grpc_host) as the upstream EPP serves it: GKE and the
    # upstream charts' probes ask it for `inference-extension`. Health stays on grpc_port
    # too. 0: a free port chosen at start (EppService.grpc_health_port, logged).
    grpc_health_port: int = Field(9003, ge=0, le=65535)
    metrics_host: str = "0.0.0.0"
    metrics_port: int = Field(9090, ge=0, le=65535)
    # The debug pages (/debug/endpoints, /debug/index) show which pod holds which prefix
    # and cost routing-loop time: served on this loopback address only (kubectl
    # port-forward reaches it), or on the metrics port when metrics_host is loopback.
    # 0: a free port chosen at start (EppService.debug_address, logged); null: not served.
    debug_host: str = "127.0.0.1"
    debug_port: int | None = Field(9091, ge=0, le=65535)
    max_grpc_message_bytes: int = Field(64 * 1024 * 1024, ge=4 * 1024 * 1024)
    # Larger bodies get 413 (at the headers when Content-Length says so). 32 MiB: vision
    # requests with base64 images fit (vLLM and the reference EPP set no cap). Work per
    # body is bounded (images are hashed, not decoded or tokenized; a long conversation is
    # cut from a window of its head), but decoding still grows with the bytes: one body at
    # the limit pauses the event loop 50-75 ms on 2 cores for the costliest shapes (one
    # text turn, ~800k tiny turns, token ids), ~40 ms for an image, plus ~1 ms/MiB to
    # re-emit it in FULL_DUPLEX_STREAMED mode (docs/reliability.md "Large bodies").
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1024, description="larger bodies get 413")
    # Used only when Envoy does not announce its body mode (protocol_config, Envoy < 1.34).
    assumed_body_mode: Literal["FULL_DUPLEX_STREAMED", "BUFFERED"] = "FULL_DUPLEX_STREAMED"
    stream_chunk_bytes: int = Field(62 * 1024, ge=1024, le=62 * 1024)
    # SIGTERM: readiness and gRPC health go NOT_SERVING at once, routing goes on for up to
    # drain_timeout_s, or until no routing stream has opened or been open for drain_quiet_s.
    drain_timeout_s: float = Field(15.0, ge=0.0)
    drain_quiet_s: float = Field(1.0, ge=0.0)
    # A request waiting in admission longer than keepalive_s gets one message to Envoy that
    # re-arms its ext_proc message timer (BUFFERED mode) for keepalive_extension_s: by
    # default flow_control.ttl_s + 5 s. It must not exceed the filter's
    # max_message_timeout (the generated configs allow 300 s), or Envoy ignores it.
    keepalive_s: float = Field(2.0, gt=0.0)
    keepalive_extension_s: float = Field(65.0, gt=0.0, le=300.0)
    # TLS on the ext_proc port, as the upstream EPP serves it (--secure-serving, default
    # on): gateways that dial the EPP over TLS without verifying it (Envoy AI Gateway,
    # kgateway) fail every handshake against a plaintext port. Without `tls` files the
    # EPP generates a self-signed certificate in memory at start. False: plaintext.
    secure_serving: bool = True
    tls: TlsConfig | None = None
    # Worker processes on this node (epp/serving/workers.py), each a whole EPP: above 1,
    # `epp serve` supervises them, they share grpc_port and grpc_health_port
    # (SO_REUSEPORT), worker i serves metrics on the i-th port from metrics_port that no
    # other setting takes, worker 0 alone the debug pages, and with worker_sharing they
    # send each other their decisions (epp/replicas over loopback). 1: one process.
    workers: int = Field(1, ge=1, le=64)
    worker_sharing: bool = True

    @model_validator(mode="after")
    def _tls_needs_secure_serving(self) -> ServerConfig:
        if not self.secure_serving and self.tls is not None:
            raise ValueError(
                "server.secure_serving: false (plaintext) contradicts server.tls "
                "(certificate files): remove one of them"
            )
        return self


class ReplicasConfig(Strict):
    """Several EPP replicas behind one Envoy share their routing decisions, so each one's
    prefix index and load count include the others' traffic. Off with no peers."""

    # Peers as host:port of their `listen_port`; a name resolving to several addresses (a
    # headless Service) stands for all of them, re-resolved every `resolve_s`.
    peers: list[str] = Field(default_factory=list)
    listen_host: str = "0.0.0.0"
    # Not 9003: the upstream EPP's gRPC health port (server.grpc_health_port).
    listen_port: int = Field(9010, ge=0, le=65535)
    resolve_s: float = Field(5.0, gt=0.0)
    # Frames waiting per peer (a slow or absent peer loses the oldest, routing never waits).
    queue_size: int = Field(4096, ge=1)
    # The last decisions sent to a replica the first time it connects (a restarted or new
    # replica starts with this much of the fleet's prefix index); 0: none.
    history: int = Field(4096, ge=0)
    # A peer's decision older than this on arrival (a backlog after a reconnect) only
    # feeds the prefix index: the pod's page already shows its load.
    max_age_s: float = Field(1.0, gt=0.0)
    # A peer's dispatch counts in a pod's load until a page fetched after it shows it
    # (datalayer/ledger.py: at least DISPATCH_TRANSIT_S after it), or for at most this
    # long while no page comes.
    load_ttl_s: float = Field(5.0, gt=0.0)
    # Reconnect delay after a failure doubles from 0.05 s up to this.
    backoff_max_s: float = Field(2.0, gt=0.0)
    # A peer's decision for a longer prompt is dropped and counted (no real request carries
    # one: 2**20 covers the longest context windows served, 1M tokens). Also what one
    # decision can add to a pod's prefill lane; what all peers' decisions add ends within
    # load_ttl_s of the last one (epp/replicas/inbox.py).
    max_prompt_tokens: int = Field(1_048_576, ge=1, le=2**31)
    # The listener closes a connection that has not completed its Hello (and, with a
    # secret, its proof) within handshake_timeout_s, and one that sent no frame for
    # idle_timeout_s (peers ping within it). At most max_connections are open; beyond, the
    # oldest still in its handshake (from the address holding the most) makes room, and
    # without a secret the longest silent too (epp/replicas/server.py).
    handshake_timeout_s: float = Field(5.0, gt=0.0, le=60.0)
    idle_timeout_s: float = Field(30.0, ge=1.0, le=3600.0)
    max_connections: int = Field(64, ge=2, le=65536)
    # A file holding a secret shared by every replica (at least 16 bytes once whitespace is
    # stripped; e.g. a mounted Kubernetes Secret). Set: a peer connection carries decisions
    # only after both replicas proved they hold it (epp/replicas/auth.py); the file is
    # re-read when it changes. Unset: the peers port takes anything that reaches it. A
    # relative path is taken from the working directory, as server.tls's files are.
    # Read when the replicas start, not here: a config is also validated where the file
    # does not exist (the chart's rendered config in tests/deploy, `epp bench --epp-config`).
    secret_file: Path | None = None

    @field_validator("peers")
    @classmethod
    def _host_port(cls, peers: list[str]) -> list[str]:
        for peer in peers:
            try:
                parse_host_port(peer)
            except AddressError as exc:
                raise ValueError(f"a peer must be host:port ({exc})") from None
        return peers
