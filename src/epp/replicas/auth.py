"""Shared-secret authentication of peer connections (`replicas.secret_file`).

Why: the peers port otherwise takes frames from anything that reaches it, and a forged
Decision poisons the prefix index or inflates a pod's load (steering traffic); a forged
Completion releases requests still in flight. With a secret, a connection carries
decisions only after both ends proved they hold it, without sending it.

The proof (protocol.py shows the frames): each side sends a fresh random nonce in its
Hello; a proof is HMAC-SHA256 keyed with the secret over

    "epp-replicas-auth", the role ("dialler" or "listener"), PROTOCOL_VERSION,
    the dialler's replica id, the listener's replica id, the dialler's nonce, the
    listener's nonce

each part length-prefixed. The listener proves first (its Hello), so the dialler knows
it talks to a replica holding the secret before it sends anything else; the dialler's
proof (`Auth`) follows, and the listener applies no frame before checking it. Proofs are
compared with `hmac.compare_digest`. Because each side's nonce is fresh, a recorded
handshake replayed to either side fails; because the role is in the MAC, a listener's
proof cannot be reflected as a dialler's; because both ids are in it, a proof made for
one pair of replicas proves nothing for another.

What it does not do: encrypt, or authenticate frames after the handshake. Someone who
can take over an established TCP connection (on the network path) is not stopped; a
NetworkPolicy or a mesh with mutual TLS covers that. A proof also lets whoever sees one
test guesses of the secret offline, so the secret must be random (`openssl rand -hex
32`), not a password: at least MIN_SECRET_BYTES are required.

Rotation: the file is read again when its content changes (checked at most every
`check_s`, by content rather than mtime, as epp/tls/files.py does: a Kubernetes Secret volume
swaps a symlink). A new secret signs from then on and the previous one is still accepted
for `previous_s`, so replicas that see the new file at different times (the kubelet
updates each pod's volume within a minute or two) still connect. A listener sends one
proof per secret it accepts, and the dialler answers with whichever secret matched.
Connections already established are not affected by a rotation. A replaced file that
cannot be used is logged once and the last good secret stays.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from epp.replicas.protocol import NONCE_BYTES, PROTOCOL_VERSION, Hello

log = structlog.get_logger("epp.replicas")

MIN_SECRET_BYTES = 16
# A larger file is not a secret (a wrong path, e.g. a certificate bundle).
MAX_SECRET_FILE_BYTES = 4096
SECRET_CHECK_S = 5.0
# Longer than a Kubernetes Secret volume takes to reach every pod (kubelet sync period
# plus its cache TTL: about two minutes by default).
PREVIOUS_SECRET_S = 300.0

_DOMAIN = b"epp-replicas-auth"
DIALLER = b"dialler"
LISTENER = b"listener"


class SecretError(ValueError):
    """A secret file that cannot be used (the message names the file, never the secret)."""


def read_secret(path: Path) -> bytes:
    """The secret in `path`, surrounding whitespace stripped."""
    try:
        with path.open("rb") as file:
            data = file.read(MAX_SECRET_FILE_BYTES + 1)
    except OSError as exc:
        raise SecretError(f"replicas.secret_file {path}: {exc.strerror or exc}") from exc
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise SecretError(
            f"replicas.secret_file {path}: larger than {MAX_SECRET_FILE_BYTES} bytes, not a secret"
        )
    secret = data.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise SecretError(
            f"replicas.secret_file {path}: the secret is {len(secret)} bytes (whitespace "
            f"stripped), at least {MIN_SECRET_BYTES} are required (e.g. openssl rand -hex 32)"
        )
    return secret


def proof(
    key: bytes,
    role: bytes,
    dialler: str,
    listener: str,
    dialler_nonce: bytes,
    listener_nonce: bytes,
) -> bytes:
    """HMAC-SHA256 of one side's view of the handshake (see the module docstring)."""
    parts = (
        _DOMAIN,
        role,
        PROTOCOL_VERSION.to_bytes(4, "big"),
        dialler.encode(),
        listener.encode(),
        dialler_nonce,
        listener_nonce,
    )
    message = b"".join(len(part).to_bytes(2, "big") + part for part in parts)
    return hmac.new(key, message, hashlib.sha256).digest()


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


class SharedSecret:
    """The secret of `replicas.secret_file`, re-read when the file's content changes.

    The constructor reads the file and raises SecretError when it cannot be used: the
    process does not start. `accepted()` gives the secrets accepted now, the current one
    first (it signs), then the previous one while `previous_s` has not passed since the
    change was seen."""

    def __init__(
        self,
        path: Path,
        *,
        check_s: float = SECRET_CHECK_S,
        previous_s: float = PREVIOUS_SECRET_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.path = path
        self._check_s = check_s
        self._previous_s = previous_s
        self._clock = clock
        self._current = read_secret(path)
        self._previous: bytes | None = None
        self._previous_until = 0.0
        self._next_check = clock() + check_s
        self._failed: str | None = None  # the error last logged, logged once
        self.reloads = 0

    def __repr__(self) -> str:  # never the secret
        return f"SharedSecret({str(self.path)!r})"

    def accepted(self) -> tuple[bytes, ...]:
        now = self._clock()
        if now >= self._next_check:
            self._next_check = now + self._check_s
            self._check(now)
        if self._previous is not None and now < self._previous_until:
            return (self._current, self._previous)
        return (self._current,)

    def _check(self, now: float) -> None:
        try:
            secret = read_secret(self.path)
            if hmac.compare_digest(secret, self._current):
                self._failed = None
                return
            # Taken only if a second read agrees: a file being rewritten in place may be
            # read half-written (a Kubernetes Secret volume is swapped atomically).
            if not hmac.compare_digest(read_secret(self.path), secret):
                return
        except SecretError as exc:
            if str(exc) != self._failed:
                self._failed = str(exc)
                log.error("replica_secret_reload_failed", error=str(exc), kept="the last secret")
            return
        self._failed = None
        self._previous, self._previous_until = self._current, now + self._previous_s
        self._current = secret
        self.reloads += 1
        log.info(
            "replica_secret_reloaded", file=str(self.path), previous_accepted_s=self._previous_s
        )


class PeerAuth:
    """The proofs of one replica's handshakes, on both sides (no I/O but the secret file)."""

    def __init__(self, secret: SharedSecret) -> None:
        self.secret = secret

    def listener_proofs(self, dialler: Hello, listener: str, nonce: bytes) -> tuple[bytes, ...]:
        """The listener's proofs for its Hello: one per accepted secret."""
        if dialler.nonce is None:
            return ()
        return tuple(
            proof(key, LISTENER, dialler.replica, listener, dialler.nonce, nonce)
            for key in self.secret.accepted()
        )

    def dialler_proof(self, sent: Hello, got: Hello) -> tuple[bytes, bool]:
        """The dialler's proof, and whether the listener's Hello proved a secret this
        replica accepts. The proof uses the secret that matched (during a rotation the
        listener may not know the newest yet), else the current one."""
        assert sent.nonce is not None and got.nonce is not None
        keys = self.secret.accepted()
        for key in keys:
            expected = proof(key, LISTENER, sent.replica, got.replica, sent.nonce, got.nonce)
            if any(hmac.compare_digest(expected, given) for given in got.proofs):
                return proof(key, DIALLER, sent.replica, got.replica, sent.nonce, got.nonce), True
        return proof(keys[0], DIALLER, sent.replica, got.replica, sent.nonce, got.nonce), False

    def dialler_proved(self, dialler: Hello, listener: Hello, given: bytes) -> bool:
        """Whether the dialler's `Auth` proof holds for a secret this replica accepts."""
        if dialler.nonce is None or listener.nonce is None:
            return False
        return any(
            hmac.compare_digest(
                proof(
                    key, DIALLER, dialler.replica, listener.replica, dialler.nonce, listener.nonce
                ),
                given,
            )
            for key in self.secret.accepted()
        )
