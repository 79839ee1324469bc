"""`host:port` addresses: the one parser and formatter every component uses.

An address is written as in a URL and as Envoy writes it (`x-gateway-destination-endpoint`):
`10.0.0.7:8000`, `pod-a.pool.svc:9010`, and an IPv6 host in brackets, `[fd00::1]:8000`.
Parsed, a host is kept without its brackets (`fd00::1`), as sockets, getaddrinfo and Envoy's
`socket_address` take it; formatting puts them back.

The rules (each failure is an `AddressError` with a one-line message):
- the host is an IPv4 address, a DNS name (letters, digits, `-`, `_`, `.`) or a bracketed
  IPv6 address; never empty, never with whitespace;
- the port is ASCII digits, 1 to 65535 (0 means "any port" to a listener, which is no
  address to connect to);
- an IPv6 address without brackets is a host with no port: `fd00::1:8000` is itself a valid
  IPv6 address, so a port can only be told from it by brackets (`[fd00::1]:8000`).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

PORT_MIN = 1
PORT_MAX = 65535
_HOST_NAME = re.compile(r"[A-Za-z0-9_.-]+")
_PORT = re.compile(r"[0-9]+")


class AddressError(ValueError):
    """An address that cannot be used; the message names it and says what is wrong."""


@dataclass(frozen=True, slots=True)
class HostPort:
    """A parsed address: `host` without brackets, `port` in 1..65535."""

    host: str
    port: int

    def __str__(self) -> str:
        return format_host_port(self.host, self.port)


def is_ip_address(host: str) -> bool:
    """Whether `host` (bracketed or not) is an IP address rather than a name to resolve."""
    try:
        ipaddress.ip_address(unbracket(host))
    except ValueError:
        return False
    return True


def unbracket(host: str) -> str:
    """`fd00::1` for `[fd00::1]`; any other host unchanged."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def url_host(host: str) -> str:
    """The host as a URL or a ZMQ endpoint writes it: an IPv6 address bracketed
    (`tcp://[fd00::1]:5557`), anything else (an already bracketed host too) unchanged."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def format_host_port(host: str, port: int) -> str:
    """`host:port`, an IPv6 host bracketed: the inverse of `parse_host_port`."""
    return f"{url_host(host)}:{port}"


def _parse_port(text: str, address: str) -> int:
    if not text:
        raise AddressError(f"empty port in address {address!r}: expected host:port")
    if not _PORT.fullmatch(text):
        raise AddressError(f"bad port {text!r} in address {address!r}: not a number")
    port = int(text)
    if not PORT_MIN <= port <= PORT_MAX:
        raise AddressError(f"port {port} out of range {PORT_MIN}-{PORT_MAX} in address {address!r}")
    return port


def split_host_port(address: str) -> tuple[str, int | None]:
    """(host without brackets, port or None when the address has none)."""
    if not address:
        raise AddressError("empty address: expected host:port")
    if address != "".join(address.split()):
        raise AddressError(f"whitespace in address {address!r}")
    if address.startswith("["):
        return _split_bracketed(address)
    if address.count(":") > 1:
        if not _is_ipv6(address):
            raise AddressError(
                f"bad address {address!r}: an IPv6 address with a port is written "
                "in brackets, [fd00::1]:8000"
            )
        return address, None
    host, sep, port = address.rpartition(":")
    if not sep:
        host = address
    _check_host(host, address)
    return host, _parse_port(port, address) if sep else None


def parse_host_port(address: str, default_port: int | None = None) -> HostPort:
    """`host:port`, `[ipv6]:port`, or (with `default_port`) a host alone."""
    host, port = split_host_port(address)
    if port is None:
        if default_port is None:
            hint = f" (an IPv6 address with a port: [{host}]:8000)" if ":" in host else ""
            raise AddressError(f"address {address!r} has no port: expected host:port{hint}")
        port = default_port
    return HostPort(host, port)


def _split_bracketed(address: str) -> tuple[str, int | None]:
    host, sep, rest = address[1:].partition("]")
    if not sep:
        raise AddressError(f"bad address {address!r}: '[' without ']'")
    if not _is_ipv6(host):
        raise AddressError(f"bad address {address!r}: {host!r} in brackets is not an IPv6 address")
    if not rest:
        return host, None
    if not rest.startswith(":"):
        raise AddressError(f"bad address {address!r}: expected ':' and a port after ']'")
    return host, _parse_port(rest[1:], address)


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


def _check_host(host: str, address: str) -> None:
    if not host:
        raise AddressError(f"empty host in address {address!r}")
    if not _HOST_NAME.fullmatch(host):
        raise AddressError(
            f"bad host {host!r} in address {address!r}: expected an IP address or a DNS name"
        )
