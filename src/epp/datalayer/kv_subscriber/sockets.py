"""The two ZMQ conversations with a vLLM pod: the live SUB socket (with its monitor) and
the replay request on the pod's ROUTER socket (DEALER: `[b"", start seq]` ->
`[b"", (topic,) seq, payload]` ... then `seq ff..ff`). No state of the subscriber here."""

from __future__ import annotations

from collections.abc import Callable

import zmq
import zmq.asyncio

from epp.datalayer.kv_subscriber.state import SubscriberSettings
from epp.prefix.kv_events import REPLAY_END_SEQ, decode_seq, encode_seq

MONITOR_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


class ReplayFailed(Exception):
    """A replay that broke or does not cover what was asked."""


class ReplayTimedOut(ReplayFailed):
    """The replay socket did not answer in time: it is left alone for a while."""


def raise_socket_limit(context: zmq.Context) -> None:
    """Let `context` hold as many sockets as libzmq can: its default, 1,023, is ~340
    followed pods at three sockets each (SUB, and the monitor's pair). Before any socket."""
    context.set(zmq.MAX_SOCKETS, context.get(zmq.SOCKET_LIMIT))


def open_sub_socket(
    context: zmq.asyncio.Context, endpoint: str, topic: bytes, settings: SubscriberSettings
) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
    """The SUB socket connected to `endpoint` and subscribed to `topic`, and its monitor."""
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    # Without it ZMQ refuses an IPv6 address ("tcp://[fd00::1]:5557": EINVAL, or a
    # connect that never completes); with it, IPv4 addresses still work.
    sub.setsockopt(zmq.IPV6, 1)
    sub.setsockopt(zmq.RCVHWM, settings.rcvhwm)
    sub.setsockopt(zmq.RECONNECT_IVL, max(1, int(settings.reconnect_ivl_s * 1000)))
    sub.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(settings.reconnect_max_s * 1000)))
    sub.setsockopt(zmq.MAXMSGSIZE, settings.max_message_bytes)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    monitor = sub.get_monitor_socket(MONITOR_EVENTS)
    sub.connect(endpoint)
    return sub, monitor


class ReplayRequest:
    """One replay request: `send(start)`, then `receive()` each buffered batch as
    (seq, payload) until None (the end marker). Use as a context manager (closes the
    socket). Raises ReplayTimedOut when the socket is silent for `resync_timeout_s` or the
    whole replay exceeds `replay_max_s`, ReplayFailed on a malformed message."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        endpoint: str,
        settings: SubscriberSettings,
        clock: Callable[[], float],
    ) -> None:
        self._settings = settings
        self._clock = clock
        self._deadline = 0.0
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IPV6, 1)
        dealer.setsockopt(zmq.MAXMSGSIZE, settings.max_message_bytes)
        dealer.connect(endpoint)
        self._dealer = dealer

    def __enter__(self) -> ReplayRequest:
        return self

    def __exit__(self, *exc: object) -> None:
        self._dealer.close(linger=0)

    async def send(self, start: int) -> None:
        await self._dealer.send_multipart((b"", encode_seq(start)))
        self._deadline = self._clock() + self._settings.replay_max_s

    async def receive(self) -> tuple[int, bytes] | None:
        wait = min(self._settings.resync_timeout_s, self._deadline - self._clock())
        if wait <= 0 or not await self._dealer.poll(int(wait * 1000)):
            raise ReplayTimedOut("the replay socket did not answer in time")
        frames = await self._dealer.recv_multipart()
        if frames and frames[0] == b"":
            frames = frames[1:]
        if len(frames) < 2 or (seq := decode_seq(frames[-2])) is None:
            raise ReplayFailed(f"a replay message of {len(frames)} frames")
        if seq == REPLAY_END_SEQ:
            return None
        return seq, frames[-1]
