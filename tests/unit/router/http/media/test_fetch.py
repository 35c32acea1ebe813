"""Fetching image URLs from a real HTTP server on the loopback, which the policy opens only when
--allowed-media-domains lists it: redirects re-checked at each hop, the byte limit while the body
streams, the time-out, HTTP errors; and ImageIntake's count limit and decoding of fetched images."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pytgi_router.http.media.errors import ImageError
from pytgi_router.http.media.fetch import ImageFetcher
from pytgi_router.http.media.intake import ImageIntake
from pytgi_router.http.media.limits import MediaLimits
from pytgi_router.http.media.source import ImageRef
from tests.unit.router.http.media.images import data_uri, encoded

PNG = encoded("PNG", (20, 10))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    seen_hosts: list[str] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        Handler.seen_hosts.append(self.headers.get("Host", ""))
        port = self.server.server_address[1]
        path = self.path
        if path == "/img.png":
            self._send(200, PNG, {"Content-Length": str(len(PNG)), "Content-Type": "image/png"})
        elif path.startswith("/redirect/"):
            targets = {"ok": "/img.png", "metadata": "http://169.254.169.254/latest/meta-data",
                       "loopback2": f"http://127.0.0.2:{port}/img.png", "loop": "/redirect/loop",
                       "private": "http://10.0.0.1/img.png"}
            self._send(302, b"", {"Location": targets[path.split("/")[2]]})
        elif path == "/big":  # no Content-Length: only streaming can bound it
            self._send(200, b"x" * 50_000, {})
        elif path == "/declared-big":
            self._send(200, b"", {"Content-Length": "999999999"})
        elif path == "/gzipped":  # Accept-Encoding: identity ignored
            self._send(200, b"\x1f\x8b" + b"\x00" * 30, {"Content-Encoding": "gzip"})
        elif path == "/slow":
            time.sleep(1.5)
            self._send(200, PNG, {})
        else:
            self._send(404, b"no", {})

    def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
        try:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


LOOPBACK = MediaLimits(allowed_domains=("127.0.0.1",), max_image_bytes=10_000,
                       fetch_timeout_s=1.0)


def fetch(url: str, limits: MediaLimits = LOOPBACK) -> bytes:
    async def run() -> bytes:
        fetcher = ImageFetcher(limits)
        try:
            return await fetcher.fetch("messages[0].content[0]", url)
        finally:
            await fetcher.aclose()
    return asyncio.run(run())


def refused(url: str, limits: MediaLimits = LOOPBACK) -> str:
    with pytest.raises(ImageError) as err:
        fetch(url, limits)
    assert "image `messages[0].content[0]`" in str(err.value)
    return str(err.value)


def test_a_listed_loopback_serves_and_the_host_header_is_the_urls(server: str) -> None:
    assert fetch(f"{server}/img.png") == PNG
    assert Handler.seen_hosts[-1] == server.removeprefix("http://")
    assert fetch(f"{server}/redirect/ok") == PNG


def test_the_loopback_is_refused_unless_listed(server: str) -> None:
    assert "fetching image URLs is off" in refused(f"{server}/img.png", MediaLimits())
    assert "loopback address" in refused(f"{server}/img.png", MediaLimits(allow_urls=True))


def test_each_redirect_is_checked_again(server: str) -> None:
    assert "host 169.254.169.254 is not in --allowed-media-domains" in refused(
        f"{server}/redirect/metadata")
    assert "host 10.0.0.1 is not in --allowed-media-domains" in refused(
        f"{server}/redirect/private")
    opened = MediaLimits(allowed_domains=("127.0.0.1",), allow_urls=True)
    assert "169.254.169.254 is a link-local address" in refused(
        f"{server}/redirect/metadata", opened)
    assert "10.0.0.1 is a private address" in refused(f"{server}/redirect/private", opened)
    assert "127.0.0.2 is a loopback address" in refused(f"{server}/redirect/loopback2", opened)
    assert "more than 3 redirects" in refused(f"{server}/redirect/loop")


def test_the_byte_limit_holds_while_streaming(server: str) -> None:
    assert "over the limit of 10000 bytes" in refused(f"{server}/big")
    assert "999999999 bytes, over the limit" in refused(f"{server}/declared-big")


def test_a_compressed_body_and_a_url_httpx_refuses_are_refusals(server: str) -> None:
    # Inflating is where a small body becomes gigabytes: compressed answers are refused.
    assert "Content-Encoding 'gzip'" in refused(f"{server}/gzipped")
    assert "is not a valid URL" in refused(f"{server}/img\x01.png")


def test_time_out_and_http_errors(server: str) -> None:
    start = time.monotonic()
    assert "not fetched within 1 s" in refused(f"{server}/slow")
    assert time.monotonic() - start < 1.4
    assert "answered HTTP 404" in refused(f"{server}/nothing.png")


def test_intake_fetches_and_decodes_and_counts(server: str) -> None:
    limits = MediaLimits(allowed_domains=("127.0.0.1",), max_images=2)
    refs = [ImageRef("messages[0].content[0]", f"{server}/img.png"),
            ImageRef("messages[0].content[1]", data_uri(encoded("JPEG", (8, 8))))]
    sizes = asyncio.run(ImageIntake(limits).load(refs, lambda decoded: decoded.size))
    assert sizes == [(20, 10), (8, 8)]
    with pytest.raises(ImageError, match=r"image `messages\[1\].content\[0\]`: a request carries "
                                         r"at most 2 images .* has 3"):
        asyncio.run(ImageIntake(limits).load([*refs, ImageRef("messages[1].content[0]", "x")],
                                             lambda decoded: decoded))
    with pytest.raises(ImageError, match="a data: URI or an http\\(s\\) URL, got 'file:///x'"):
        asyncio.run(ImageIntake(limits).load([ImageRef("a", "file:///x")],
                                             lambda decoded: decoded))
