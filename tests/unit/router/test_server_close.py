"""The router's shutdown (RouterServer.close) closes the image fetcher's HTTP client: the
intake a vision model's validator uses holds one, opened at its first URL fetch."""

from __future__ import annotations

import asyncio

from pytgi_router.http.media.intake import ImageIntake
from pytgi_router.server import RouterServer
from pytgi_router.settings import RouterSettings


def test_close_closes_the_image_fetchers_client() -> None:
    settings = RouterSettings(tokenizer_name="m")
    server = RouterServer(settings)
    intake = ImageIntake(settings.media_limits())
    server._intake = intake  # what start() keeps for a vision model

    async def run() -> bool:
        client = intake.fetcher._http()  # opened, as the first URL fetch opens it
        await server.close()
        return client.is_closed

    assert asyncio.run(run())
    assert intake.fetcher._client is None
