"""Which URLs a webhook may be sent to: public addresses only, unless an allow-list names the target.

A webhook URL is chosen by whoever holds the admin token, and the ledger posts to it from inside the
operator's network: without a check, a subscription to ``http://169.254.169.254/...`` or
``http://10.0.0.1/...`` would make the ledger a proxy into that network (server-side request forgery).
So a target must resolve only to global unicast addresses (not private, loopback, link-local, CGNAT,
multicast, reserved or unspecified; an IPv4-mapped IPv6 address counts as its IPv4 address), written in
any form a resolver accepts (``2852039166`` and ``0xa9fea9fe`` are 169.254.169.254). Cloud metadata
names are refused by name. ``CHUNKLEDGER_WEBHOOK_ALLOW`` lists networks (CIDR) and host names that are
allowed anyway, e.g. an internal alert relay.

The check runs at registration and again at every delivery, on the addresses the name resolves to then;
the delivery connects to the address that was checked (the name goes in the Host header and TLS SNI),
so a name that resolves to a public address when checked and to an internal one a moment later (DNS
rebinding) cannot redirect the request. Deliveries do not follow redirects.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], list[str]]

# Names of cloud metadata services (they also answer on link-local addresses, refused anyway).
METADATA_NAMES = frozenset({"metadata", "metadata.google.internal", "metadata.goog", "instance-data"})


class TargetRefused(ValueError):
    """The URL may not receive webhooks; the message says why."""


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True)
class Target:
    """A checked delivery target: connect to ``address``, name ``host`` in Host and SNI."""

    url: str  # the URL with the host replaced by the checked address
    host_header: str
    sni_hostname: str | None  # https: the name the certificate must match


@dataclass
class TargetPolicy:
    """The allow-list and the resolver (tests pass their own resolver)."""

    networks: list[IPNetwork] = field(default_factory=list)
    hosts: frozenset[str] = frozenset()
    resolver: Resolver = system_resolver

    @classmethod
    def parse(cls, allow: str | Iterable[str], resolver: Resolver = system_resolver) -> TargetPolicy:
        """From ``"127.0.0.1/32, 10.0.0.0/8, relay.internal"``: CIDRs (or single addresses) and names."""
        items = [a.strip() for a in (allow.split(",") if isinstance(allow, str) else allow)]
        networks: list[IPNetwork] = []
        hosts: set[str] = set()
        for item in items:
            if not item:
                continue
            try:
                networks.append(ipaddress.ip_network(item, strict=False))
            except ValueError:
                hosts.add(item.lower().rstrip("."))
        return cls(networks, frozenset(hosts), resolver)

    def check_url(self, url: str) -> None:
        """Refuse a URL whose form or target is not allowed (at registration)."""
        self.target(url, resolve=True)

    def target(self, url: str, *, resolve: bool = True) -> Target:
        """The checked target of ``url``; raises :class:`TargetRefused`."""
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise TargetRefused(f"not a valid URL: {exc}") from None
        if parts.scheme not in ("http", "https"):
            raise TargetRefused("must start with http:// or https://")
        if parts.username is not None or parts.password is not None:
            raise TargetRefused("must not carry credentials (user:password@); the signature authenticates")
        host = (parts.hostname or "").lower().rstrip(".")
        if not host:
            raise TargetRefused("names no host")
        port = port or (443 if parts.scheme == "https" else 80)
        literal = _literal_address(host)
        if literal is not None:
            if not self._allowed(literal):
                raise TargetRefused(
                    f"{parts.hostname!r} is {_kind(literal)} address {literal}; webhooks go to public "
                    "addresses unless CHUNKLEDGER_WEBHOOK_ALLOW names it"
                )
            return _target(parts, host, None, port)
        else:
            if host in self.hosts:
                return _target(parts, host, None, port)
            if host == "localhost" or host.endswith(".localhost") or host in METADATA_NAMES:
                raise TargetRefused(
                    f"host {host!r} is a local or metadata name; allow it in CHUNKLEDGER_WEBHOOK_ALLOW"
                )
            if not resolve:
                return _target(parts, host, None, port)
            try:
                addresses = [
                    _unmapped(ipaddress.ip_address(a.split("%")[0])) for a in self.resolver(host, port)
                ]
            except (OSError, ValueError) as exc:
                raise TargetRefused(f"host {host!r} does not resolve: {exc}") from None
            if not addresses:
                raise TargetRefused(f"host {host!r} does not resolve")
        for addr in addresses:
            if not self._allowed(addr):
                raise TargetRefused(
                    f"{host!r} resolves to {_kind(addr)} address {addr}; webhooks go to public addresses "
                    "unless CHUNKLEDGER_WEBHOOK_ALLOW names it"
                )
        return _target(parts, host, addresses[0], port)

    def _allowed(self, addr: IPAddress) -> bool:
        if any(addr in net for net in self.networks if net.version == addr.version):
            return True
        return addr.is_global and not addr.is_multicast


def _literal_address(host: str) -> IPAddress | None:
    """An address written as the host: dotted, bracketed IPv6, or a legacy IPv4 form (2852039166)."""
    try:
        return _unmapped(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        pass
    if host and all(c in "0123456789abcdefx." for c in host) and any(c.isdigit() for c in host):
        try:  # the forms inet_aton accepts: decimal, octal, hex, fewer than four parts
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    return None


def _unmapped(addr: IPAddress) -> IPAddress:
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def _kind(addr: IPAddress) -> str:
    for name in ("loopback", "link_local", "private", "multicast", "unspecified", "reserved"):
        if getattr(addr, f"is_{name}"):
            return {"link_local": "a link-local", "unspecified": "an unspecified"}.get(name, f"a {name}")
    return "a non-public"


def _target(parts, host: str, addr: IPAddress | None, port: int) -> Target:  # type: ignore[no-untyped-def]
    default = 443 if parts.scheme == "https" else 80
    named = f"[{host}]" if ":" in host else host  # an IPv6 literal keeps its brackets in Host
    host_header = named if port == default else f"{named}:{port}"
    if addr is None:  # an allow-listed name (or no resolution asked): let the client resolve it
        return Target(parts.geturl(), host_header, None)
    shown = f"[{addr}]" if addr.version == 6 else str(addr)
    netloc = shown if parts.port is None else f"{shown}:{parts.port}"
    url = parts._replace(netloc=netloc).geturl()
    return Target(url, host_header, host if parts.scheme == "https" else None)
