"""Which URLs the router may fetch images from, so that it is never an SSRF proxy into its own
network: http(s) only; hosts allowed by --allow-media-urls (any) or --allowed-media-domains (those
listed); every address a host resolves to must be public, or inside a network the allow list names
explicitly (`127.0.0.1`, `10.0.0.0/8`). The router resolves the name itself and connects to the
address it checked (fetch.py), so a DNS answer cannot change between the check and the connection;
each redirect's target goes through the same check."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from pytgi_router.http.media.errors import ImageError
from pytgi_router.http.media.limits import MediaLimits

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
# host, port -> the addresses it resolves to (injectable for tests).
Resolver = Callable[[str, int], Awaitable[list[str]]]
FETCHING_OFF = ("fetching image URLs is off on this server: send the image inside the request as "
                "a data: URI (base64), or start the server with --allow-media-urls or "
                "--allowed-media-domains")


@dataclass(frozen=True, slots=True)
class Target:
    """A checked hop: the URL as sent, its host and port, and the address to connect to."""

    url: str
    scheme: str
    host: str
    port: int
    address: Address


async def system_resolver(host: str, port: int) -> list[str]:
    """The resolver's addresses for `host` (the event loop's getaddrinfo, in its thread pool)."""
    infos = await asyncio.get_running_loop().getaddrinfo(
        host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    return [str(info[4][0]) for info in infos]


class AddressPolicy:
    def __init__(self, limits: MediaLimits, resolver: Resolver = system_resolver) -> None:
        self.limits = limits
        self.networks = limits.networks
        self.names = limits.host_names
        self.resolver = resolver

    async def target(self, where: str, url: str) -> Target:
        """The checked target of `url`, or an ImageError saying which rule refused it."""
        if not self.limits.fetching:
            raise ImageError(where, FETCHING_OFF)
        scheme, host, port = _scheme_host_port(where, url)
        literal = _literal(host)
        if not self._host_allowed(host, literal):
            raise ImageError(where, f"host {host} is not in --allowed-media-domains")
        addresses = [literal] if literal is not None else await self._resolve(where, host, port)
        for address in addresses:
            self._check_address(where, host, address, named=literal is None)
        return Target(url, scheme, host, port, addresses[0])

    def _host_allowed(self, host: str, literal: Address | None) -> bool:
        """The host rule alone (the addresses are checked after): a literal IP must lie in a
        listed network, since a listed name says nothing about raw addresses."""
        if self.limits.allow_urls:
            return True
        if literal is not None:
            return any(literal in n for n in self.networks)
        if self.networks and not self.names:
            return True  # only networks listed: the addresses decide (_check_address)
        return any(host == n or (n.startswith("*.") and host.endswith(n[1:])) for n in self.names)

    async def _resolve(self, where: str, host: str, port: int) -> list[Address]:
        """Every address `host` resolves to: all are checked, and the fetch connects to one of
        them, so a second lookup (DNS rebinding) never decides where it goes."""
        try:
            found = await self.resolver(host, port)
        except OSError as err:
            raise ImageError(where, f"host {host} does not resolve ({err})") from None
        addresses = [a for a in map(_literal, found) if a is not None]
        if not addresses:
            raise ImageError(where, f"host {host} does not resolve")
        return addresses

    def _check_address(self, where: str, host: str, address: Address, named: bool) -> None:
        """Public addresses pass; any other only inside a listed network. A name listed alone
        does not open its private addresses: DNS could point it anywhere."""
        if any(address in n for n in self.networks):
            return
        kind = non_public_kind(address)
        if kind is not None:
            via = f"host {host} resolves to {address}, which" if named else str(address)
            raise ImageError(where, f"{via} is a {kind} address: the server fetches only public "
                                    "addresses unless --allowed-media-domains lists the address "
                                    "or its network")
        if not self.limits.allow_urls and self.networks and not self.names:
            raise ImageError(where, f"{address} is not in --allowed-media-domains")


def non_public_kind(address: Address) -> str | None:
    """Why an address is not a public one (None: it is): loopback, private, link-local (cloud
    metadata at 169.254.169.254), multicast, reserved, …; IPv4-mapped IPv6 as its IPv4. A 6to4
    address (2002::/16) is judged by the IPv4 address it carries too: Python calls
    2002:7f00:1:: global, yet 6to4 tunnels it to the IPv4 host it embeds (127.0.0.1)."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        elif address.sixtofour is not None:
            inner = non_public_kind(address.sixtofour)
            if inner is not None:
                return f"6to4 {inner}"
    checks = (("loopback", address.is_loopback), ("unspecified", address.is_unspecified),
              ("link-local", address.is_link_local), ("multicast", address.is_multicast),
              ("private", address.is_private), ("reserved", address.is_reserved))
    for kind, hit in checks:
        if hit:
            return kind
    return None if address.is_global else "non-public"


def _scheme_host_port(where: str, url: str) -> tuple[str, str, int]:
    """An http(s) URL's scheme, host (lower case, no trailing dot) and port (the scheme's by
    default), as urlsplit reads them: the host after any userinfo, so `http://a.example@10.0.0.1`
    is 10.0.0.1's; anything else is the image's refusal."""
    try:
        parts = urlsplit(url)
        scheme, host, port = parts.scheme.lower(), parts.hostname, parts.port
    except ValueError:  # an unclosed IPv6 bracket, a port out of range
        raise ImageError(where, f"{url!r} is not a valid URL") from None
    if scheme not in ("http", "https"):
        raise ImageError(where, f"{scheme or 'a relative'}: URLs are not fetched: an image is "
                                "a data: URI or an http(s) URL")
    if not host:
        raise ImageError(where, f"{url!r} has no host")
    return scheme, host.rstrip(".").lower(), port or (443 if scheme == "https" else 80)


def _literal(host: str) -> Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
