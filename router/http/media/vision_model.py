"""What the served model makes of images: `ImageSupport` says whether it takes them (and why
not), `VisionModel` how a prompt carries them (its image token, repeated once per token the
image takes) and its image processor. Read once at start-up from the checkpoint's config.json,
preprocessor_config.json and tokenizer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from tokenizers import Tokenizer

from pytgi_router.http.media.errors import ImageError, ImagesNotAccepted
from pytgi_router.http.media.families import (
    VISION_FAMILIES,
    VLM_MODEL_TYPES,
    PromptImages,
    VisionFamily,
)
from pytgi_router.http.media.markdown import MarkdownImages
from pytgi_router.http.media.processed import ImageProcessor
from pytgi_router.http.media.source import ImageRef


@dataclass(frozen=True, slots=True)
class VisionModel:
    model_type: str
    # The family's prompt rendering, its image token the one this tokenizer has.
    prompt: PromptImages
    processor: ImageProcessor
    image_token: str
    image_token_id: int
    # The BOS token's text: a "prefix" family's prompt writes it after its last image.
    bos_token: str = ""

    def chat_text(self, text: str, refs: Sequence[ImageRef], counts: Sequence[int],
                  bodies: Sequence[str] = ()) -> str:
        """The rendered chat prompt with each image's one placeholder token repeated once per
        image token (transformers' processor does the same; the family says what stands for an
        image, `PromptImages.chat`); a template that did not place every image once is
        refused, not guessed at. `bodies`: each image's own text where the family makes one
        (ProcessedImage.text)."""
        pieces = text.split(self.prompt.placeholder)
        if len(pieces) - 1 != len(refs):
            where = refs[0].where if refs else "messages"
            raise ImageError(where, f"the chat template placed {len(pieces) - 1} images for the "
                                    f"{len(refs)} in the request (an image in a role the "
                                    "template does not render?)")
        out = [pieces[0]]
        bodies = bodies or [""] * len(counts)
        for count, body, piece in zip(counts, bodies, pieces[1:], strict=True):
            out += [self.prompt.chat_text(count, body), piece]
        return self._prefix_layout(out)

    def markdown_text(self, found: MarkdownImages, counts: Sequence[int],
                      bodies: Sequence[str] = ()) -> str:
        """`/generate` inputs with each markdown image replaced by the model's image text (TGI's
        rendering for the family, `PromptImages.markdown`)."""
        out = [found.texts[0]]
        bodies = bodies or [""] * len(counts)
        for count, body, piece in zip(counts, bodies, found.texts[1:], strict=True):
            out += [self.prompt.markdown_text(count, body), piece]
        return self._prefix_layout(out)

    def _prefix_layout(self, pieces: list[str]) -> str:
        """`pieces` (text, image, text, ..., text) joined; for a "prefix" family (PaliGemma)
        with <bos> after the last image and "\n" at the end, as PaliGemmaProcessor lays out
        a prompt whose images it was given in place."""
        if self.prompt.attention != "prefix":
            return "".join(pieces)
        head = "".join(pieces[:-1])
        return head + self.bos_token + pieces[-1] + "\n"

    def spans(self, where: Sequence[str], ids: Sequence[int], counts: Sequence[int],
              runs: Sequence[tuple[int, ...]] = ()) -> list[tuple[int, int]]:
        """(offset, count) of each image's tokens in the tokenized prompt: runs of the image
        token, in order, exactly as many as each image takes. `truncate` cutting into an image
        leaves fewer and is refused. An image whose tokens are several runs (`runs[i]`, the
        run lengths; Idefics3's tiles) gives one span per run, in order."""
        positions = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(positions) != sum(counts):
            raise ImageError(where[0] if where else "inputs",
                             f"the prompt holds {len(positions)} image tokens where its images "
                             f"take {sum(counts)}: `truncate` cut into an image, or the text "
                             f"itself contains {self.image_token}")
        out, start = [], 0
        runs = runs or [()] * len(counts)
        for name, count, pieces in zip(where, counts, runs, strict=True):
            if sum(pieces or (count,)) != count:
                raise ImageError(name, f"its runs {list(pieces)} do not add up to {count}")
            for run in pieces or (count,):
                offset = positions[start]
                if positions[start + run - 1] != offset + run - 1:
                    raise ImageError(name, "its image tokens are not contiguous in the prompt")
                out.append((offset, run))
                start += run
        return out


@dataclass(frozen=True, slots=True)
class ImageSupport:
    """The served model and images: `vision` when the router can prepare them, else why not."""

    vision: VisionModel | None = None
    why_not: str = "a text-only model"

    def refuse_unless_accepted(self, model_name: str, refs: Sequence[ImageRef]) -> None:
        """Images for a model that cannot take them are refused, naming the first one."""
        if refs and self.vision is None:
            raise ImagesNotAccepted(model_name, refs[0].where, self.why_not)

    def describe(self) -> str:
        """The start-up log line."""
        if self.vision is None:
            return f"images: refused ({self.why_not})"
        return f"images: prepared for {self.vision.model_type} (its image processor)"


def image_support(config: dict[str, Any] | None, preprocessor: dict[str, Any] | None,
                  tokenizer: Tokenizer) -> ImageSupport:
    """Whether (and how) this checkpoint takes images: its family's row in VISION_FAMILIES,
    its processor built from the checkpoint, and the tokenizer's image token."""
    config = config or {}
    model_type = str(config.get("model_type", ""))
    if model_type not in VLM_MODEL_TYPES:
        return ImageSupport(why_not="a text-only model")
    family = VISION_FAMILIES.get(model_type)
    if family is None:
        return ImageSupport(why_not=f"images for {model_type} are not prepared by "
                                    "this server yet")
    if preprocessor is None:
        return ImageSupport(why_not="its checkpoint has no preprocessor_config.json")
    token, token_id = image_token(family, config, tokenizer)
    if token_id is None:
        return ImageSupport(why_not=f"its tokenizer has no {family.prompt.image_token}")
    try:
        processor = family.processor(config, preprocessor)
    except (ValueError, KeyError, TypeError) as e:
        return ImageSupport(why_not=f"its image processor is not served: {e}")
    prompt = family.prompt
    bos = ""
    if prompt.attention == "prefix":
        bos = bos_token(config, tokenizer)
        if not bos:
            return ImageSupport(why_not="its config.json names no BOS token its tokenizer has")
    if token != prompt.image_token:
        placeholder = token if prompt.placeholder == prompt.image_token else prompt.placeholder
        prompt = replace(prompt, image_token=token, placeholder=placeholder)
    return ImageSupport(VisionModel(model_type, prompt, processor, token, token_id, bos))


def bos_token(config: dict[str, Any], tokenizer: Tokenizer) -> str:
    """The BOS token's text, by config.json's bos_token_id (top level or text_config's)."""
    text = config.get("text_config") or {}
    value = config.get("bos_token_id", text.get("bos_token_id") if isinstance(text, dict)
                       else None)
    named = tokenizer.id_to_token(value) if isinstance(value, int) else None
    return named or ""


def image_token(family: VisionFamily, config: dict[str, Any], tokenizer: Tokenizer
                ) -> tuple[str, int | None]:
    """The image token and its id: the family's token by name, else the one config.json's
    image token id names (a checkpoint that renamed it)."""
    name = family.prompt.image_token
    token_id = tokenizer.token_to_id(name)
    if token_id is not None:
        return name, token_id
    for key in family.token_id_keys:
        value = config.get(key)
        if isinstance(value, int):
            named = tokenizer.id_to_token(value)
            if named is not None:
                return named, value
    return name, None
