"""The image flags: the router's CLI and environment forms, the start-up refusals, and the
launcher passing them to the router."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytgi_launcher.cli import parse_settings as launcher_settings
from pytgi_launcher.commands import router_argv
from pytgi_router.cli import parse_settings
from pytgi_router.http.media.limits import MAX_IMAGE_PIXELS, MAX_IMAGES_PER_REQUEST


def test_defaults_keep_fetching_off_and_bound_each_image_by_the_payload_limit() -> None:
    limits = parse_settings(["--tokenizer-name", "m", "--payload-limit", "5000"], {}).media_limits()
    assert not limits.fetching and limits.allowed_domains == ()
    assert limits.max_image_bytes == 5000
    assert (limits.max_images, limits.max_image_pixels) == (MAX_IMAGES_PER_REQUEST,
                                                            MAX_IMAGE_PIXELS)


def test_flags_and_their_environment_forms() -> None:
    env = {"ALLOWED_MEDIA_DOMAINS": "images.example, 10.0.0.0/8", "ALLOW_MEDIA_URLS": "true",
           "MAX_IMAGE_PIXELS": "1000000", "MEDIA_FETCH_TIMEOUT": "2.5"}
    limits = parse_settings(["--tokenizer-name", "m", "--max-images-per-request", "3"],
                            env).media_limits()
    assert limits.allowed_domains == ("images.example", "10.0.0.0/8") and limits.allow_urls
    assert (limits.max_images, limits.max_image_pixels, limits.fetch_timeout_s) == (3, 10**6, 2.5)
    assert [str(n) for n in limits.networks] == ["10.0.0.0/8"]
    assert limits.host_names == ("images.example",)


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-image-bytes", "3000000"], "--max-image-bytes must be > 0 and <= --payload-limit"),
    (["--max-image-pixels", "0"], "--max-image-pixels must be > 0"),
    (["--max-images-per-request", "-1"], "--max-images-per-request must be >= 0"),
    (["--media-fetch-timeout", "0"], "--media-fetch-timeout must be > 0"),
    (["--allowed-media-domains", "http://x.example"], "neither a host name"),
])
def test_bad_values_are_refused_at_start_up(argv: list[str], message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--tokenizer-name", "m", *argv], {})
    assert message in capsys.readouterr().err


def test_the_launcher_passes_them_to_the_router() -> None:
    s = launcher_settings(["--allowed-media-domains", "127.0.0.1,*.cdn.example",
                           "--allow-media-urls", "--max-image-pixels", "4096",
                           "--max-images-per-request", "2"], {})
    argv = router_argv(s, Path("/model"))
    routed = parse_settings(argv[3:], {}).media_limits()
    assert routed.allowed_domains == ("127.0.0.1", "*.cdn.example") and routed.allow_urls
    assert (routed.max_image_pixels, routed.max_images) == (4096, 2)
    plain = router_argv(launcher_settings([], {}), Path("/model"))
    assert not any("media" in a or "image" in a for a in plain)


def test_the_launcher_refuses_bad_values_before_starting_anything(
        capsys: pytest.CaptureFixture[str]) -> None:
    for argv, message in [(["--max-image-bytes", "3000000"], "<= --payload-limit"),
                          (["--max-image-pixels", "200000000"], "Pillow's own bomb guard")]:
        with pytest.raises(SystemExit):
            launcher_settings(argv, {})
        assert message in capsys.readouterr().err
