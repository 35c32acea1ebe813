"""MediaLimits: what the router accepts of images, from its flags (RouterSettings.media_limits)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

# Defaults of the flags (RouterSettings' fields name them).
MAX_IMAGES_PER_REQUEST = 8
# 32 Mpx: an 8192 x 4096 image; a 48 Mpx phone photo must be scaled down first. Its RGB pixels
# take 96 MiB while decoded, so a handful in flight stay well inside a router's memory.
MAX_IMAGE_PIXELS = 1 << 25
# Pillow refuses images over twice its MAX_IMAGE_PIXELS (89,478,485) while reading the header,
# before our own check: --max-image-pixels cannot usefully be larger.
PILLOW_PIXEL_CEILING = 2 * 89_478_485
MEDIA_FETCH_TIMEOUT_S = 10.0
MAX_MEDIA_REDIRECTS = 3

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """Per-request and per-image bounds, and the URL fetching policy's inputs."""

    max_images: int = MAX_IMAGES_PER_REQUEST
    max_image_bytes: int = 2_000_000
    max_image_pixels: int = MAX_IMAGE_PIXELS
    # --allow-media-urls: any host whose addresses are public may be fetched.
    allow_urls: bool = False
    # --allowed-media-domains: host names (`example.com`, `*.example.com`) and IP networks
    # (`127.0.0.1`, `10.0.0.0/8`); a non-public address is fetched only inside a listed network.
    allowed_domains: tuple[str, ...] = ()
    fetch_timeout_s: float = MEDIA_FETCH_TIMEOUT_S
    max_redirects: int = MAX_MEDIA_REDIRECTS

    @property
    def fetching(self) -> bool:
        """Whether any URL may be fetched at all (off unless a flag turns it on)."""
        return self.allow_urls or bool(self.allowed_domains)

    @property
    def networks(self) -> tuple[Network, ...]:
        """The IP entries of --allowed-media-domains."""
        return tuple(n for n in map(as_network, self.allowed_domains) if n is not None)

    @property
    def host_names(self) -> tuple[str, ...]:
        """The host-name entries of --allowed-media-domains, lower-cased."""
        return tuple(d.lower().rstrip(".") for d in self.allowed_domains if as_network(d) is None)


def as_network(entry: str) -> Network | None:
    """An allow-list entry read as an IP address or network (`[::1]` too), else None."""
    try:
        return ipaddress.ip_network(entry.strip("[]"), strict=False)
    except ValueError:
        return None


def parse_media_domains(raw: str) -> tuple[str, ...]:
    """--allowed-media-domains' comma list (its env form too): host names, `*.suffix` wildcards,
    IP addresses and CIDR networks; anything else is refused at start-up, not at first use."""
    out = []
    for entry in (e.strip() for e in raw.split(",")):
        if not entry:
            continue
        host = entry[2:] if entry.startswith("*.") else entry
        if as_network(entry) is None and not _is_host_name(host):
            raise ValueError(f"--allowed-media-domains: {entry!r} is neither a host name "
                             "(example.com, *.example.com) nor an IP address or network")
        out.append(entry)
    return tuple(out)


def _is_host_name(host: str) -> bool:
    labels = host.rstrip(".").split(".")
    return bool(host) and all(
        0 < len(label) <= 63 and label.replace("-", "").isalnum() and label.isascii()
        for label in labels)


def media_limit_problems(limits: MediaLimits, payload_limit: int) -> list[str]:
    """Start-up refusals of the media flags, in RouterSettings' style (the launcher checks the
    same before it starts anything)."""
    out = []
    if limits.max_images < 0:
        out.append(f"--max-images-per-request must be >= 0, got {limits.max_images}")
    if not 0 < limits.max_image_bytes <= payload_limit:
        out.append(f"--max-image-bytes must be > 0 and <= --payload-limit ({payload_limit}), "
                   f"got {limits.max_image_bytes}")
    if not 0 < limits.max_image_pixels <= PILLOW_PIXEL_CEILING:
        out.append(f"--max-image-pixels must be > 0 and <= {PILLOW_PIXEL_CEILING} (Pillow's own "
                   f"bomb guard), got {limits.max_image_pixels}")
    if not limits.fetch_timeout_s > 0:
        out.append(f"--media-fetch-timeout must be > 0, got {limits.fetch_timeout_s}")
    return out
