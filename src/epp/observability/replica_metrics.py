"""Prometheus metrics of decision sharing between EPP replicas (epp/replicas), on the
EPP's registry. Registered only when `replicas.peers` is set."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class ReplicaMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.peers = Gauge(
            "epp_replica_peers",
            "Peer replica addresses resolved from replicas.peers, this replica excluded.",
            registry=registry,
        )
        self.connected = Gauge(
            "epp_replica_peers_connected",
            "Peer replicas this one is connected to and sends its decisions to.",
            registry=registry,
        )
        self.sent = Counter(
            "epp_replica_decisions_sent_total",
            "Routing decisions written to a peer replica's connection (one per peer).",
            registry=registry,
        )
        self.dropped = Counter(
            "epp_replica_decisions_dropped_total",
            "Frames dropped from a full send queue (a slow or absent peer loses the oldest).",
            registry=registry,
        )
        # applied: index and load; late: older than replicas.max_age_s, index only;
        # unknown_pod: a pod this replica does not know (yet); self: its own, ignored;
        # invalid: values no real request carries, dropped (by reason: `invalid`).
        self.received = Counter(
            "epp_replica_decisions_received_total",
            "Routing decisions received from peer replicas, by outcome.",
            ["outcome"],
            registry=registry,
        )
        self.invalid = Counter(
            "epp_replica_decisions_invalid_total",
            "Peer decisions dropped for a value no real request carries, by reason.",
            ["reason"],
            registry=registry,
        )
        self.completions_forwarded = Counter(
            "epp_replica_completions_forwarded_total",
            "Response ends seen here for another replica's decision, sent to it.",
            registry=registry,
        )
        self.completions_received = Counter(
            "epp_replica_completions_received_total",
            "Response ends of this replica's decisions, received from peer replicas.",
            registry=registry,
        )
        self.rejected = Counter(
            "epp_replica_connections_rejected_total",
            "Peer connections closed for a bad frame, handshake, limit or silence, by reason.",
            ["reason"],
            registry=registry,
        )
