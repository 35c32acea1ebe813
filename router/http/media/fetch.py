"""ImageFetcher: an image URL's bytes, fetched under the address policy (address_policy.py).

Each hop connects to the address the policy checked (the URL's host rewritten to it; Host header
and TLS server name kept as the original host, so certificates are still verified against it),
never follows a redirect by itself (each target is checked again), streams the body under the
byte limit, and the whole fetch, redirects included, runs under one time-out. No environment
proxies (`trust_env=False`): a proxy would connect where the policy never looked."""

from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urljoin

import httpx

from pytgi_router.http.media.address_policy import AddressPolicy, Target
from pytgi_router.http.media.errors import ImageError
from pytgi_router.http.media.limits import MediaLimits

ACCEPT = "image/png, image/jpeg, image/webp, image/gif"


class ImageFetcher:
    def __init__(self, limits: MediaLimits, policy: AddressPolicy | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        """`tls`: the context verifying servers' certificates (None: httpx's default, the
        certifi roots); tests pass one trusting their own authority."""
        self.limits = limits
        self.policy = policy or AddressPolicy(limits)
        self.tls = tls
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        """One client, made at first use; no pooled connections, so that a connection made for
        one host name is never reused for another name on the same address."""
        if self._client is None:
            self._client = httpx.AsyncClient(
                trust_env=False, follow_redirects=False, timeout=self.limits.fetch_timeout_s,
                limits=httpx.Limits(max_keepalive_connections=0),
                verify=self.tls if self.tls is not None else True)
        return self._client

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def fetch(self, where: str, url: str) -> bytes:
        """The image's bytes, or an ImageError naming the rule or the failure."""
        timeout = self.limits.fetch_timeout_s
        try:
            return await asyncio.wait_for(self._follow(where, url), timeout)
        except asyncio.TimeoutError:
            raise ImageError(where, f"{url} was not fetched within {timeout:g} s "
                                    "(--media-fetch-timeout)") from None
        except httpx.HTTPError as err:
            raise ImageError(where, f"fetching {url} failed: {type(err).__name__}") from None
        except httpx.InvalidURL as err:  # not an HTTPError: a URL urlsplit took, httpx refuses
            raise ImageError(where, f"{url!r} is not a valid URL ({err})") from None

    async def _follow(self, where: str, url: str) -> bytes:
        """The hops by hand: each redirect's target goes through the policy again (an allowed
        host may redirect into the private network)."""
        for _ in range(self.limits.max_redirects + 1):
            target = await self.policy.target(where, url)
            status, location, data = await self._get(where, target)
            if location is None:
                if status != 200:
                    raise ImageError(where, f"fetching {url} answered HTTP {status}")
                return data
            url = urljoin(url, location)
        raise ImageError(where, f"more than {self.limits.max_redirects} redirects")

    async def _get(self, where: str, target: Target) -> tuple[int, str | None, bytes]:
        """One GET to the checked address: (status, redirect location or None, body)."""
        url = httpx.URL(target.url)
        netloc = url.netloc.decode("ascii")
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        request = self._http().build_request(
            "GET", url.copy_with(host=str(target.address)),
            headers={"Host": netloc, "Accept": ACCEPT, "Accept-Encoding": "identity"}, extensions=extensions)
        response = await self._http().send(request, stream=True)
        try:
            if response.is_redirect:
                return response.status_code, response.headers.get("location", ""), b""
            if response.status_code != 200:
                return response.status_code, None, b""
            return 200, None, await self._body(where, target.url, response)
        finally:
            await response.aclose()

    async def _body(self, where: str, url: str, response: httpx.Response) -> bytes:
        """The body under --max-image-bytes, counted as it arrives: a Content-Length may be
        absent or lie, so the declared size only refuses early."""
        limit = self.limits.max_image_bytes
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding != "identity":
            # Asked for identity; a compressed body would be counted after inflating, and one
            # network chunk of gzip or brotli can inflate to gigabytes before the count sees it.
            raise ImageError(where, f"{url} answered with Content-Encoding {encoding!r}; images "
                                    "are fetched uncompressed (Accept-Encoding: identity)")
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise ImageError(where, f"{url} is {declared} bytes, over the limit of {limit} bytes "
                                    "per image (--max-image-bytes)")
        chunks, size = [], 0
        async for chunk in response.aiter_raw():
            size += len(chunk)
            if size > limit:
                raise ImageError(where, f"{url} is over the limit of {limit} bytes per image "
                                        "(--max-image-bytes)")
            chunks.append(chunk)
        return b"".join(chunks)
