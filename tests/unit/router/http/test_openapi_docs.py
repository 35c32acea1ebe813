"""/docs loads Swagger UI from a CDN: every external asset is pinned to one release and carries
a Subresource Integrity hash, so the browser refuses bytes other than the reviewed ones."""

from __future__ import annotations

import base64
import re
from html.parser import HTMLParser

from pytgi_router.http.openapi import SWAGGER_PAGE


class _Assets(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.external: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        url = a.get("src") if tag == "script" else a.get("href") if tag == "link" else None
        if url is not None and "//" in url:
            self.external.append({"url": url, **a})


def test_every_external_docs_asset_is_pinned_with_an_integrity_hash() -> None:
    parser = _Assets()
    parser.feed(SWAGGER_PAGE)
    assert len(parser.external) == 2  # the stylesheet and the bundle
    for asset in parser.external:
        url = asset["url"] or ""
        assert url.startswith("https://") and re.search(r"@\d+\.\d+\.\d+/", url), url
        algorithm, _, digest = (asset.get("integrity") or "").partition("-")
        assert algorithm == "sha384" and len(base64.b64decode(digest, validate=True)) == 48, url
        assert asset.get("crossorigin") == "anonymous", url
