"""HTTPS image fetching connects to the address the policy checked, yet verifies the server's
certificate against the URL's host name (TLS server name and Host header kept): a local TLS
server with a certificate from the test's own authority, its name resolved to the loopback by
the policy's resolver, which --allowed-media-domains opens."""

from __future__ import annotations

import asyncio
import datetime
import ssl
import tempfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from pytgi_router.http.media.address_policy import AddressPolicy
from pytgi_router.http.media.errors import ImageError
from pytgi_router.http.media.fetch import ImageFetcher
from pytgi_router.http.media.limits import MediaLimits
from tests.unit.router.http.media.images import encoded

PNG = encoded("PNG", (12, 8))
NAME = "images.test"


def _cert(subject: str, issuer_key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
          key: ec.EllipticCurvePrivateKey, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(hours=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(subject)]),
                                        critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    hosts: list[str] = []

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        Handler.hosts.append(self.headers.get("Host", ""))
        self.send_response(200)
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        self.wfile.write(PNG)


@pytest.fixture(scope="module")
def tls() -> Iterator[tuple[int, ssl.SSLContext, list[str]]]:
    """(the server's port, a client context trusting the test authority, server names seen)."""
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pytgi test CA")])
    ca = _cert("pytgi test CA", ca_key, ca_name, ca_key, ca=True)
    leaf = _cert(NAME, ca_key, ca_name, key, ca=False)
    folder = Path(tempfile.mkdtemp())
    (folder / "leaf.pem").write_bytes(leaf.public_bytes(serialization.Encoding.PEM))
    (folder / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    seen: list[str] = []
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(folder / "leaf.pem", folder / "key.pem")
    server_ctx.sni_callback = lambda sock, name, ctx: seen.append(name or "")  # type: ignore[assignment,func-returns-value]
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    httpd.socket = server_ctx.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    client_ctx = ssl.create_default_context(
        cadata=ca.public_bytes(serialization.Encoding.PEM).decode())
    yield httpd.server_address[1], client_ctx, seen
    httpd.shutdown()
    httpd.server_close()


async def to_loopback(host: str, port: int) -> list[str]:
    return ["127.0.0.1"]


def fetch(url: str, tls_ctx: ssl.SSLContext) -> bytes:
    limits = MediaLimits(allowed_domains=("127.0.0.1",), fetch_timeout_s=5.0)
    fetcher = ImageFetcher(limits, AddressPolicy(limits, to_loopback), tls_ctx)

    async def run() -> bytes:
        try:
            return await fetcher.fetch("messages[0].content[0]", url)
        finally:
            await fetcher.aclose()
    return asyncio.run(run())


def test_https_to_the_checked_address_verifies_the_urls_host(
        tls: tuple[int, ssl.SSLContext, list[str]]) -> None:
    port, client_ctx, seen = tls
    assert fetch(f"https://{NAME}:{port}/a.png", client_ctx) == PNG
    assert seen[-1] == NAME and Handler.hosts[-1] == f"{NAME}:{port}"


def test_a_certificate_for_another_name_is_refused(
        tls: tuple[int, ssl.SSLContext, list[str]]) -> None:
    port, client_ctx, _ = tls
    with pytest.raises(ImageError, match=r"image `messages\[0\].content\[0\]`: fetching "
                                         r"https://other.test:\d+/a.png failed: ConnectError"):
        fetch(f"https://other.test:{port}/a.png", client_ctx)
    # Without the test authority, the server's certificate is not trusted at all.
    with pytest.raises(ImageError, match="failed: ConnectError"):
        fetch(f"https://{NAME}:{port}/a.png", ssl.create_default_context())
