"""The image flags' command-line forms, shared by the router's and the launcher's CLI (which
passes them through), so both say the same thing and parse the same way."""

from __future__ import annotations

import argparse
from typing import Any

from pytgi_router.http.media.limits import (
    MAX_IMAGE_PIXELS,
    MAX_IMAGES_PER_REQUEST,
    MEDIA_FETCH_TIMEOUT_S,
    parse_media_domains,
)


def domains_flag(raw: str) -> tuple[str, ...]:
    """--allowed-media-domains as argparse reads it: a refused entry is named in the error."""
    try:
        return parse_media_domains(raw)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


# (flag, type, help); each also read from its environment form (MAX_IMAGE_PIXELS, ...).
MEDIA_FLAGS: list[tuple[str, Any, str]] = [
    ("--max-images-per-request", int, "images one request may carry; more get 422 "
     f"(default {MAX_IMAGES_PER_REQUEST})"),
    ("--max-image-bytes", int, "bytes of one encoded image (a data: URI's data or a fetched "
     "body), at most --payload-limit (default: --payload-limit)"),
    ("--max-image-pixels", int, "width x height of one image, checked from its header before "
     f"it is decoded (decompression bombs) (default {MAX_IMAGE_PIXELS})"),
    ("--allowed-media-domains", domains_flag, "comma list of hosts (example.com, "
     "*.example.com) and IP networks (127.0.0.1, 10.0.0.0/8) image URLs may be fetched from; "
     "turns URL fetching on for them. Non-public addresses (loopback, private, link-local) are "
     "fetched only inside a listed network (default: none)"),
    ("--media-fetch-timeout", float, "seconds one image URL may take to fetch, redirects "
     f"included (default {MEDIA_FETCH_TIMEOUT_S:g})"),
]
ALLOW_MEDIA_URLS_HELP = ("fetch http(s) image URLs from any host whose addresses are public "
                         "(off by default: images are then data: URIs only)")
