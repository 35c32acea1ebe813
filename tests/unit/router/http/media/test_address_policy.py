"""The URL policy: fetching off by default; http(s) only; any public host under
--allow-media-urls, the listed ones under --allowed-media-domains; loopback, private, link-local
and the other non-public addresses only inside a listed network, also when a public-looking name
resolves to them."""

from __future__ import annotations

import asyncio

import pytest

from pytgi_router.http.media.address_policy import AddressPolicy, non_public_kind
from pytgi_router.http.media.errors import ImageError
from pytgi_router.http.media.limits import MediaLimits, as_network, parse_media_domains

DNS = {"public.example": ["93.184.216.34"], "sneaky.example": ["93.184.216.34", "10.1.2.3"],
       "internal.example": ["192.168.1.5"], "metadata.example": ["169.254.169.254"],
       "cdn.images.example": ["93.184.216.35"]}


async def fake_dns(host: str, port: int) -> list[str]:
    if host not in DNS:
        raise OSError("Name or service not known")
    return DNS[host]


def target(url: str, **limits: object) -> str:
    policy = AddressPolicy(MediaLimits(**limits), fake_dns)  # type: ignore[arg-type]
    return str(asyncio.run(policy.target("messages[0].content[1]", url)).address)


def refused(url: str, **limits: object) -> str:
    with pytest.raises(ImageError) as err:
        target(url, **limits)
    assert "image `messages[0].content[1]`" in str(err.value)
    return str(err.value)


def test_fetching_is_off_by_default() -> None:
    assert "fetching image URLs is off" in refused("https://public.example/a.png")


def test_any_public_host_with_allow_media_urls() -> None:
    assert target("https://public.example/a.png", allow_urls=True) == "93.184.216.34"
    assert target("http://93.184.216.34:8080/a.png", allow_urls=True) == "93.184.216.34"


@pytest.mark.parametrize(("url", "kind"), [
    ("http://127.0.0.1/a.png", "loopback"),
    ("http://localhost.example.invalid/", "does not resolve"),
    ("http://[::1]/a.png", "loopback"),
    ("http://10.0.0.7/", "private"),
    ("http://172.16.0.1/", "private"),
    ("http://192.168.0.1/", "private"),
    ("http://169.254.169.254/latest/meta-data/", "link-local"),
    ("http://[::ffff:127.0.0.1]/", "loopback"),
    ("http://[fe80::1]/", "link-local"),
    ("http://0.0.0.0/", "unspecified"),
    ("http://224.0.0.1/", "multicast"),
    ("http://100.64.0.1/", "non-public"),
    ("http://internal.example/a.png", "resolves to 192.168.1.5, which is a private address"),
    ("http://metadata.example/", "link-local"),
    # One private address among public ones is enough to refuse (DNS rebinding).
    ("http://sneaky.example/", "10.1.2.3, which is a private"),
])
def test_non_public_addresses_are_refused(url: str, kind: str) -> None:
    assert kind in refused(url, allow_urls=True)


@pytest.mark.parametrize("url", [
    # Decimal, hexadecimal, octal and short IPv4 forms are no literal to ipaddress; the
    # resolver (inet_aton, no network) reads them as 127.0.0.1, and that address is checked.
    "http://2130706433/", "http://0x7f.1/", "http://0177.0.0.1/", "http://127.1/",
    # Userinfo that looks like a host: the host is what follows the '@'.
    "http://public.example@127.0.0.1/", "http://public.example:80@127.0.0.1/",
])
def test_other_spellings_of_the_loopback_are_refused(url: str) -> None:
    policy = AddressPolicy(MediaLimits(allow_urls=True))  # the system resolver
    with pytest.raises(ImageError, match="127.0.0.1.* is a loopback address"):
        asyncio.run(policy.target("messages[0].content[1]", url))


def test_ipv6_forms_carrying_a_private_ipv4_are_refused() -> None:
    assert "6to4 loopback" in refused("http://[2002:7f00:1::]/", allow_urls=True)
    assert "6to4 private" in refused("http://[2002:a00:1::5]/", allow_urls=True)
    assert "reserved" in refused("http://[::127.0.0.1]/", allow_urls=True)  # IPv4-compatible
    assert "reserved" in refused("http://[64:ff9b::a00:1]/", allow_urls=True)  # NAT64
    assert target("http://[2002:5db8:d822::1]/", allow_urls=True) == "2002:5db8:d822::1"


def test_a_malformed_url_is_a_refusal_not_an_error() -> None:
    assert "is not a valid URL" in refused("http://[::1/a.png", allow_urls=True)
    assert "is not a valid URL" in refused("http://public.example:99999/", allow_urls=True)


def test_schemes_other_than_http_are_refused() -> None:
    for url in ("file:///etc/passwd", "ftp://public.example/a.png", "gopher://x/"):
        assert "URLs are not fetched" in refused(url, allow_urls=True)


def test_a_listed_network_opens_its_addresses_only() -> None:
    assert target("http://127.0.0.1:9/x", allowed_domains=("127.0.0.1",)) == "127.0.0.1"
    assert "loopback" in refused("http://127.0.0.2/x", allowed_domains=("127.0.0.1",),
                                 allow_urls=True)
    assert "not in --allowed-media-domains" in refused("http://127.0.0.2/x",
                                                       allowed_domains=("127.0.0.1",))
    assert "not in --allowed-media-domains" in refused("https://public.example/",
                                                       allowed_domains=("127.0.0.1",))
    assert target("http://internal.example/", allowed_domains=("192.168.0.0/16",)) == "192.168.1.5"


def test_listed_host_names_and_wildcards() -> None:
    listed = ("public.example", "*.images.example")
    assert target("https://public.example/a.png", allowed_domains=listed) == "93.184.216.34"
    assert target("https://cdn.images.example/a", allowed_domains=listed) == "93.184.216.35"
    assert "host internal.example is not in" in refused("http://internal.example/",
                                                        allowed_domains=listed)
    # A listed name does not open a private address it resolves to.
    assert "private" in refused("http://internal.example/", allowed_domains=("internal.example",))


def test_allow_list_parsing() -> None:
    assert parse_media_domains(" a.example, *.b.example,10.0.0.0/8,,[::1] ") == (
        "a.example", "*.b.example", "10.0.0.0/8", "[::1]")
    for bad in ("http://a.example", "a b", "*.", "a_b.example/x"):
        with pytest.raises(ValueError, match="--allowed-media-domains"):
            parse_media_domains(bad)
    assert as_network("[::1]") is not None and as_network("a.example") is None


def test_non_public_kind() -> None:
    import ipaddress
    assert non_public_kind(ipaddress.ip_address("8.8.8.8")) is None
    assert non_public_kind(ipaddress.ip_address("2606:4700::1111")) is None
