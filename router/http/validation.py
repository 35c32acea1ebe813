"""Validator: TGI's parameter rules and messages, tokenization once, every limit checked.

Whatever passes here is something a shard accepts: token ids from the model's own tokenizer,
budgets inside the limits the shard reported at warmup, parameters in range.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from tokenizers import Encoding, Tokenizer

from pytgi_proto import generate_pb2
from pytgi_proto.parameters import FLOAT32_TINY, SAMPLING
from pytgi_router.core.errors import ValidationError
from pytgi_router.core.lora_adapters import AdapterRef, AdapterTable
from pytgi_router.core.request import StoppingParameters, ValidRequest
from pytgi_router.http.grammar import Grammar, GrammarChecker, GrammarLimits
from pytgi_router.http.media.prepare import ImagePreparer, PreparedImages
from pytgi_router.http.media.vision_model import VisionModel
from pytgi_router.http.prompt_windows import (
    GROWTH,
    Tokenized,
    first_window,
    head_words,
    keep_last,
    settled_at,
    tail_holds,
    tokens_at_least,
)
from pytgi_router.http.schemas import GenerateParameters, GenerateRequest
from pytgi_router.http.token_bound import max_chars_per_token

T = TypeVar("T")

# Inputs longer than this (in characters) are tokenized in the worker pool, off the event loop;
# shorter ones cost less than the thread hop.
OFFLOAD_CHARS = 2048
# Prompts longer than this (in characters) that cannot fit are refused from their length alone
# (refuse_by_length); shorter ones tokenize quickly enough to get TGI's exact token count.
REFUSE_BY_LENGTH_CHARS = 65536

# A temperature below this is greedy (vLLM's threshold too): dividing logits by it overflows
# float32 (1e-40: infinite scores, NaN logprobs) or, below float32's range, arrives at the shard
# as 0, which proto3 reads as "unset" (1e-50 sampled at temperature 1). Its limit is the argmax.
GREEDY_BELOW_TEMPERATURE = 1e-5

# The longest stop sequence, in characters: the shard matches every stop sequence against the
# newly decoded text at every step, and the count alone (--max-stop-sequences) bounds nothing
# when one sequence may be as long as the payload limit.
MAX_STOP_SEQUENCE_CHARS = 512

@dataclass(frozen=True, slots=True)
class ValidationLimits:
    max_best_of: int
    max_stop_sequences: int
    max_top_n_tokens: int
    max_input_tokens: int
    max_total_tokens: int
    # TGI's default; --disable-grammar-support turns it off.
    grammar_supported: bool = True
    grammar: GrammarLimits = GrammarLimits()
    # The LoRA adapters the shards serve at start, in their order (adapter_index i > 0 is
    # adapters[i-1]); a Validator given the live AdapterTable follows loads and unloads instead.
    adapters: tuple[str, ...] = ()


@dataclass(slots=True)
class ValidGenerateRequest:
    """A GenerateRequest that passed validation: `request` is what the inference core runs (a
    ValidRequest: tokens, sampling, stopping); the other fields say how to answer, which the core
    never sees."""

    request: ValidRequest
    best_of: int
    details: bool
    decoder_input_details: bool
    return_full_text: bool


class Validator:
    def __init__(
        self,
        tokenizer: Tokenizer,
        limits: ValidationLimits,
        executor: Executor | None = None,
        rng: random.Random | None = None,
        adapters: AdapterTable | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        # The LoRA adapters `adapter_id` may name, as they are now (core/lora_adapters.py).
        self.adapters = adapters if adapters is not None else AdapterTable(limits.adapters)
        self.executor = executor
        self.grammars = GrammarChecker(limits.grammar)
        self._rng = rng or random.SystemRandom()
        # None when the tokenizer does not make a character-count bound certain (token_bound.py).
        self.max_chars_per_token = max_chars_per_token(tokenizer)
        # A vision-language model's image preparation (router/http/media/); None: text only.
        self.images: ImagePreparer | None = None

    def random_seed(self) -> int:
        return self._rng.getrandbits(64)

    # ---- tokenization ------------------------------------------------------------------------

    def encode_sync(self, text: str, add_special_tokens: bool = True) -> Encoding:
        """`encode_batch`, not `encode`: only the batch call releases the GIL while the Rust side
        works, so a megabyte prompt tokenizing in the pool does not stall the event loop."""
        try:
            return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        except Exception as err:  # the tokenizer's own failure, reported as TGI does
            raise ValidationError(f"tokenizer error {err}") from None

    async def encode(self, text: str, add_special_tokens: bool = True) -> Encoding:
        if len(text) <= OFFLOAD_CHARS or self.executor is None:
            return self.encode_sync(text, add_special_tokens)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, self.encode_sync, text, add_special_tokens)

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs `fn` in the worker pool (e.g. a chat template render on a large conversation)."""
        if self.executor is None:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def encode_tail(self, text: str, add_special_tokens: bool, keep: int) -> Tokenized:
        """The last `keep` tokens of `text`, tokenizing only as much of its end as they need
        (prompt_windows.py): `truncate` must not cost a megabyte prompt's full tokenization."""
        chars, tries = first_window(keep), 0
        while True:
            start = max(len(text) - chars, 0)
            tail = text[start:]
            encoding = await self.encode(tail, add_special_tokens)
            if start == 0 or tail_holds(encoding, keep, settled_at(tail), tries):
                return Tokenized(keep_last(encoding, keep), start)
            chars, tries = chars * GROWTH, tries + 1

    async def tokenize(self, text: str, add_special_tokens: bool, truncate: int | None) -> Tokenized:
        """/tokenize and /chat_tokenize: bounded as a generate request's prompt is (at most
        `max_input_tokens` after `truncate`), so that a body near the payload limit is refused
        rather than answered with tens of megabytes of tokens."""
        self._check_truncate(truncate)
        if truncate is not None:
            return await self.encode_tail(text, add_special_tokens, truncate)
        self.refuse_by_length(text, None, None)
        await self.refuse_by_head(text, add_special_tokens, None, None)
        tokenized = Tokenized(await self.encode(text, add_special_tokens))
        self._check_input_length(len(tokenized.encoding.ids))
        return tokenized

    def refuse_by_length(self, inputs: str, truncate: int | None, max_new: int | None) -> None:
        """Refuses, before tokenizing, a prompt whose length alone proves it cannot fit: at
        least ceil(chars / max_chars_per_token) tokens. Not with `truncate` (a long prompt then
        fits by losing its start), nor when the tokenizer gives no certain bound, nor for a
        prompt short enough to count exactly."""
        per_token = self.max_chars_per_token
        if truncate is not None or per_token is None or len(inputs) <= REFUSE_BY_LENGTH_CHARS:
            return
        self._refuse_at_least(math.ceil(len(inputs) / per_token), max_new)

    async def refuse_by_head(
        self, inputs: str, add_special_tokens: bool, truncate: int | None, max_new: int | None
    ) -> None:
        """refuse_by_length's question for a tokenizer that gives no certain bound: a long
        prompt's head (prompt_windows.py), not all of it, is tokenized, and its count is a
        floor on the prompt's. A head too short to prove anything costs a window of
        tokenizing before the whole prompt's."""
        window = first_window(self.limits.max_input_tokens)
        if truncate is not None or self.max_chars_per_token is not None or len(
                inputs) <= max(REFUSE_BY_LENGTH_CHARS, window):
            return
        head = await self.encode(head_words(inputs, window), add_special_tokens)
        self._refuse_at_least(tokens_at_least(head), max_new)

    def _refuse_at_least(self, at_least: int, max_new: int | None) -> None:
        """TGI's two length messages, for a prompt known to have at least `at_least` tokens."""
        lim = self.limits
        if max_new is not None and at_least + max_new > lim.max_total_tokens:
            raise ValidationError(
                f"`inputs` tokens + `max_new_tokens` must be <= {lim.max_total_tokens}. "
                f"Given: at least {at_least} `inputs` tokens and {max_new} `max_new_tokens`"
            )
        if at_least > lim.max_input_tokens:
            raise ValidationError(
                f"`inputs` must have less than {lim.max_input_tokens} tokens. "
                f"Given: at least {at_least}"
            )

    # ---- generate requests -------------------------------------------------------------------

    async def validate(self, req: GenerateRequest, *, stream: bool = False) -> ValidGenerateRequest:
        p = req.parameters
        lim = self.limits
        best_of = self._best_of(p, stream)
        if stream and p.decoder_input_details:
            raise ValidationError(
                "`decoder_input_details` == true is not supported when streaming tokens"
            )
        sampling = self._sampling_parameters(p, best_of)
        if p.max_new_tokens is not None and p.max_new_tokens == 0:
            raise ValidationError("`max_new_tokens` must be strictly positive")
        if len(p.stop) > lim.max_stop_sequences:
            raise ValidationError(
                f"`stop` supports up to {lim.max_stop_sequences} stop sequences. "
                f"Given: {len(p.stop)}"
            )
        longest = max(map(len, p.stop), default=0)
        if longest > MAX_STOP_SEQUENCE_CHARS:
            raise ValidationError(
                f"`stop` sequences must be at most {MAX_STOP_SEQUENCE_CHARS} characters long. "
                f"Given: {longest}"
            )
        top_n = p.top_n_tokens or 0
        if top_n > lim.max_top_n_tokens:
            raise ValidationError(
                f"`top_n_tokens` must be >= 0 and <= {lim.max_top_n_tokens}. Given: {top_n}"
            )
        self._check_truncate(p.truncate)
        prepared = await self._images(req)
        inputs = req.inputs if prepared is None else prepared.text
        if req.input_ids is not None:
            input_ids = given_ids(req.input_ids, p.truncate)
        else:
            if not req.inputs:
                raise ValidationError("`inputs` cannot be empty")
            self.refuse_by_length(inputs, p.truncate, p.max_new_tokens)
            # A "prefix" family's prompt with images carries its own <bos> (PaliGemma).
            add_special = req.add_special_tokens and not (
                prepared is not None and self._vision().prompt.attention == "prefix")
            await self.refuse_by_head(inputs, add_special, p.truncate, p.max_new_tokens)
            input_ids = await self._input_ids(inputs, add_special, p.truncate)
        # The wire messages copy megabytes of pixel values: in the worker pool too.
        images = () if prepared is None else await self.offload(
            prepared.wire, self._vision(), input_ids)
        noncausal = () if self.images is None else self._vision().prompt.noncausal_spans(
            [(i.token_offset, i.token_count) for i in images], len(input_ids))
        max_new_tokens = self._max_new_tokens(len(input_ids), p.max_new_tokens)
        if p.grammar is not None:
            grammar = await self._grammar(p.grammar)
            # The stubs type the enum field as GrammarType, an int subclass; the value is one.
            sampling.grammar_type = cast(generate_pb2.GrammarType, grammar.grammar_type)
            sampling.grammar = grammar.value
        adapter = self.adapter(p.adapter_id, req.adapter_from_model)
        valid = ValidRequest(
            inputs=req.inputs,
            input_ids=input_ids,
            truncate=p.truncate or lim.max_input_tokens,
            sampling=sampling,
            stopping=StoppingParameters(
                max_new_tokens=max_new_tokens, stop_sequences=p.stop, ignore_eos_token=p.ignore_eos
            ),
            top_n_tokens=top_n,
            prefill_logprobs=p.decoder_input_details,
            add_special_tokens=req.add_special_tokens,
            adapter_index=adapter.index if adapter else 0,
            adapter_key=adapter.key if adapter else 0,
            adapter_name=adapter.name if adapter else "",
            images=images,
            noncausal_spans=noncausal,
        )
        return ValidGenerateRequest(
            request=valid,
            best_of=best_of,
            details=p.details or p.decoder_input_details,
            decoder_input_details=p.decoder_input_details,
            return_full_text=bool(p.return_full_text),
        )

    async def _images(self, req: GenerateRequest) -> PreparedImages | None:
        """A vision-language model's images (chat's parts, or /generate's markdown) with their
        tokens in the prompt; None without images. A text model's /generate markdown stays
        the text it is (TGI); chat images never reach here for it (ImageSupport refuses them)."""
        if self.images is None:
            if req.images:
                raise ValidationError("this model does not accept images")
            return None
        if req.input_ids is not None:
            return None
        return await self.images.prepare(req.inputs, req.images)

    def _vision(self) -> VisionModel:
        assert self.images is not None
        return self.images.vision

    def adapter(self, adapter_id: str | None, from_model: bool = False) -> AdapterRef | None:
        """None (the base model) or the loaded adapter `adapter_id` names. An unknown
        `adapter_id` is refused: running the base model instead would answer something the
        client did not ask for. OpenAI's `model` may also name the served model (any name: TGI
        serves one), so there an unknown name means the base model."""
        if adapter_id is None or adapter_id == "":
            return None
        ref = self.adapters.get(adapter_id)
        if ref is not None:
            return ref
        if from_model:
            return None
        adapters = self.adapters.names()
        loaded = (f"loaded adapters: {', '.join(adapters)}" if adapters
                  else "no adapters are loaded (the server was started without --lora-adapters)")
        raise ValidationError(f"`adapter_id` {adapter_id!r} is not a loaded adapter; {loaded}")

    def _best_of(self, p: GenerateParameters, stream: bool) -> int:
        best_of = 1 if p.best_of is None else p.best_of
        max_best_of = self.limits.max_best_of
        if max_best_of == 1 and best_of != 1:
            raise ValidationError("`best_of` != 1 is not allowed for this endpoint")
        if not 0 < best_of <= max_best_of:
            raise ValidationError(f"`best_of` must be > 0 and <= {max_best_of}. Given: {best_of}")
        if best_of > 1:
            if stream:
                raise ValidationError("`best_of` != 1 is not supported when streaming tokens")
            warped = (p.temperature, p.top_k, p.top_p, p.typical_p)
            if not p.do_sample and all(v is None for v in warped):
                raise ValidationError("you must use sampling when `best_of` is > 1")
            if p.seed is not None:
                raise ValidationError("`seed` must not be set when `best_of` > 1")
        return best_of

    def _sampling_parameters(
        self, p: GenerateParameters, best_of: int
    ) -> generate_pb2.NextTokenChooserParameters:
        """The wire's sampling message: each parameter checked against its row's bounds
        (pytgi_proto.parameters), then TGI's rules on how they combine."""
        values = checked_sampling(p)
        # Past float32's range a mass arrives as 0, which proto3 reads as "unset" (no
        # filtering): any mass that small keeps just the most likely token, and so does
        # float32's smallest normal value, which is sent instead.
        top_p = values["top_p"] = max(values["top_p"], FLOAT32_TINY)
        typical_p = values["typical_p"] = max(values["typical_p"], FLOAT32_TINY)
        temperature, top_k = values["temperature"], values["top_k"]
        # The shard samples whenever a warper is active (TGI's NextTokenChooser): say so.
        warped = temperature != 1.0 or top_k != 0 or top_p < 1.0 or typical_p < 1.0
        values["do_sample"] = p.do_sample or warped
        if p.seed is None:
            values["seed"] = self.random_seed()
        if temperature < GREEDY_BELOW_TEMPERATURE:
            # Greedy; the warpers keep the most likely token anyway.
            values.update(temperature=1.0, top_k=0, top_p=1.0, typical_p=1.0, do_sample=False)
        return generate_pb2.NextTokenChooserParameters(**values)

    def _check_truncate(self, truncate: int | None) -> None:
        limit = self.limits.max_input_tokens
        if truncate is not None and not 0 < truncate <= limit:
            raise ValidationError(
                f"`truncate` must be strictly positive and less than {limit}. Given: {truncate}"
            )

    async def _input_ids(self, inputs: str, add_special: bool, truncate: int | None) -> list[int]:
        """TGI truncates on the left: the prompt's end is kept, and only its end tokenized."""
        if truncate is None:
            ids: list[int] = (await self.encode(inputs, add_special)).ids
            return ids
        return list((await self.encode_tail(inputs, add_special, truncate)).encoding.ids)

    def _max_new_tokens(self, input_length: int, requested: int | None) -> int:
        lim = self.limits
        max_new = max(lim.max_total_tokens - input_length, 0) if requested is None else requested
        if input_length + max_new > lim.max_total_tokens:
            raise ValidationError(
                f"`inputs` tokens + `max_new_tokens` must be <= {lim.max_total_tokens}. "
                f"Given: {input_length} `inputs` tokens and {max_new} `max_new_tokens`"
            )
        self._check_input_length(input_length)
        if max_new == 0:
            raise ValidationError("`max_new_tokens` must be strictly positive")
        return max_new

    def _check_input_length(self, input_length: int) -> None:
        limit = self.limits.max_input_tokens
        if input_length > limit:
            raise ValidationError(
                f"`inputs` must have less than {limit} tokens. Given: {input_length}"
            )

    async def _grammar(self, grammar: dict[str, Any]) -> Grammar:
        """Shape, then a compile by the constraint library (in the worker pool when large: a
        big schema takes milliseconds)."""
        if not self.limits.grammar_supported:
            raise ValidationError("grammar is not supported")
        parsed = self.grammars.parse(grammar)
        if len(parsed.value) > OFFLOAD_CHARS:
            await self.offload(self.grammars.check, parsed)
        else:
            self.grammars.check(parsed)
        return parsed


def checked_sampling(p: GenerateParameters) -> dict[str, Any]:
    """Each sampling parameter by its wire name: given, it must keep its row's bounds (TGI's
    messages, in the table's order); absent, it is the row's neutral value."""
    values: dict[str, Any] = {}
    for param in SAMPLING:
        value = getattr(p, param.name)
        if value is None:
            value = param.neutral
        elif (message := param.violation(value)) is not None:
            raise ValidationError(message)
        values[param.wire or param.name] = value
    return values


def given_ids(ids: list[int], truncate: int | None) -> list[int]:
    """A prompt given as token ids: non-empty, each a non-negative integer (the model's
    vocabulary bounds them at submission), truncated on the left as TGI truncates text."""
    if not ids:
        raise ValidationError("`input_ids` cannot be empty")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValidationError("`input_ids` must be a list of non-negative integers")
    return ids[-truncate:] if truncate else list(ids)
