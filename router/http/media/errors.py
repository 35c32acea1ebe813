"""ImageError: one refused image, named by where the body put it."""

from __future__ import annotations

from pytgi_router.core.errors import ValidationError


class ImageError(ValidationError):
    """An image the server will not take: TGI's 422 (each route answers it in its own shape),
    with the image's place in the body (`messages[0].content[1]`, `inputs image 0`) so a client
    with several images knows which one, and the reason."""

    def __init__(self, where: str, reason: str) -> None:
        super().__init__(f"image `{where}`: {reason}")
        self.where = where
        self.reason = reason


class ImagesNotAccepted(ValidationError):
    """A request with images to a model that cannot see them (a text-only model): refused
    rather than flattened into text the model would answer about without seeing."""

    def __init__(self, model: str, where: str, why: str = "a text-only model") -> None:
        super().__init__(f"model `{model}` does not accept images ({why}): `{where}` is an image")
        self.where = where
