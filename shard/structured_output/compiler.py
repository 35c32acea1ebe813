"""Grammars of constrained requests: the wire's grammar to each request's own llguidance matcher.

A request's NextTokenChooserParameters may carry a grammar (GRAMMAR_TYPE_JSON: a JSON Schema as
a JSON string; GRAMMAR_TYPE_REGEX: a regex the whole output must match; GRAMMAR_TYPE_LARK: an
llguidance Lark grammar, which the router builds for a reasoning model's answer). llguidance (chosen over
xgrammar by measurement: bench/experiments/grammar_libraries.py) compiles it against the model's vocabulary
into an LLMatcher, advanced by every token the request samples.

Why llguidance (bench/results/cpu/grammar_libraries.json, 128k vocabulary, this CPU): a
20-property schema compiles in ~2 ms (xgrammar: ~500 ms cold); masks cost ~20 us per token at
the median and ~0.4 ms for a batch of 64 (xgrammar: ~17 ms); it enforces every JSON-Schema
feature measured or refuses it by name (xgrammar silently ignored allOf); and it imports
neither torch nor numpy, so the router validates schemas with the same library.

Every request gets a matcher of its own, compiled for it: llguidance's deep_copy would share
the lexer's automaton, and its errors, with every other copy (shard/structured_output/cache.py says why
that poisoned a grammar for everyone). Compiling costs ~2-9 ms for the usual schemas at a 128k
vocabulary and a second or more for very large ones, and a large grammar's first mask can cost
as much again, so both happen off the step: the router sends PrepareGrammar for every
constrained request before the request joins its queue, and `prepare` builds that request's
matcher in the worker's compile pool (at a lower priority than the forward where the OS allows)
and computes its first mask there; the request is scheduled once every rank answered, and its
first step takes the prepared matcher (`take`) and copies its mask. Only a request that reaches
a shard without one (resumed after preemption, its matcher evicted from the cache under the
byte budget, a shard restarted in between, or a client that skips the RPC) has its matcher built
on the step. A grammar llguidance refuses, or that allows no output at all (`[a&&b]`,
`{"$ref": "#"}`: its first mask is llguidance's error state), is refused by PrepareGrammar, which
the router answers with a 422.

A matcher that fails while its request runs (a limit of PARSER_LIMITS hit, a refused token)
fails that request alone: its mask is checked with every step (grammar_batch.py) and the shard
reports the error in the request's Generation instead of letting the error state's mask force
EOS. The vocabulary's own preparation (~0.7 s at 128k tokens) starts in the compile pool when
the engine is built, so the first constrained request does not pay it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import llguidance
import numpy as np

from pytgi_proto import generate_pb2
from pytgi_proto.contracts import JSON_WHITESPACE
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.settings import DEFAULT_GRAMMAR_CACHE_BYTES
from pytgi_shard.structured_output.cache import GrammarCache, Prepared, matcher_bytes
from pytgi_shard.structured_output.worker import MaskWorker

JSON = generate_pb2.GRAMMAR_TYPE_JSON
REGEX = generate_pb2.GRAMMAR_TYPE_REGEX
LARK = generate_pb2.GRAMMAR_TYPE_LARK
# llguidance's errors when no byte can ever be produced: the grammar's language is empty.
_NO_OUTPUT = ("NoExtension", "NoExtensionBias")
# Where llguidance's parser state dump starts in its error messages.
_STATE_MARKERS = ("\n<state>", "\n<non-verbose/>")


def parser_limits() -> llguidance.LLParserLimits:
    """What one matcher may cost, set on every matcher. llguidance's own bounds on a mask (lexer
    fuel ~14 ms, 50,000 Earley items ~2.5 ms a step, 2,000 items in a row) keep a hostile
    grammar from stalling a step, and hold whatever it hits to that request: its matcher fails
    and the request with it. Its errors stay short (no parser state: it would quote the
    request's output into the logs and the client's error)."""
    return llguidance.LLParserLimits(verbose_errors=False)


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """One request's grammar as the router sent it: the cache key of its compiled form."""

    grammar_type: int
    text: str

    @classmethod
    def from_pb(cls, pb: generate_pb2.NextTokenChooserParameters) -> GrammarSpec | None:
        """None for an unconstrained request; InvalidRequest for an inconsistent pair."""
        kind = pb.grammar_type
        if kind == generate_pb2.GRAMMAR_TYPE_NONE:
            if pb.grammar:
                raise InvalidRequest("grammar is set but grammar_type is GRAMMAR_TYPE_NONE")
            return None
        if kind not in (JSON, REGEX, LARK):
            raise InvalidRequest(f"unknown grammar_type {kind}")
        if not pb.grammar:
            raise InvalidRequest(f"grammar_type {generate_pb2.GrammarType.Name(kind)} needs a grammar")
        return cls(kind, pb.grammar)


def grammar_source(spec: GrammarSpec) -> str:
    """The llguidance grammar of `spec` (not yet checked: compiling it checks it)."""
    if spec.grammar_type == REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    if spec.grammar_type == LARK:
        return llguidance.LLMatcher.grammar_from_lark(spec.text)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            spec.text, defaults={"whitespace_pattern": JSON_WHITESPACE}
        )
    except ValueError as e:
        raise InvalidRequest(f"invalid grammar: the JSON schema is not valid JSON: {e}") from e


def build_matcher(tokenizer: llguidance.LLTokenizer, source: str, mask_width: int) -> Prepared:
    """A new matcher of `source` with its first mask computed; InvalidRequest when llguidance
    refuses the grammar or the grammar allows no output (its first mask is an error state)."""
    matcher = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise InvalidRequest(f"invalid grammar: {first_line(matcher.get_error())}")
    words = np.empty(mask_width, dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    if matcher.is_error():
        raise InvalidRequest(f"invalid grammar: {_first_mask_error(matcher.get_error())}")
    return Prepared(matcher, words)


def _first_mask_error(error: str) -> str:
    """Why a grammar's first mask failed: most often it matches nothing at all."""
    reason = first_line(error)
    if reason in _NO_OUTPUT:
        return f"no output can match it ({reason})"
    return reason


@dataclass(slots=True)
class CompileStats:
    """How constrained requests got their matchers: built off the step by PrepareGrammar
    (`prepared`), then taken by their first step (`hits`), or built on the step (`misses`)."""

    prepared: int = 0
    hits: int = 0
    misses: int = 0


class GrammarCompiler:
    """Builds matchers for one model's vocabulary, and keeps grammars' sources and the matchers
    prepared for requests about to run within `cache_bytes` (shard/structured_output/cache.py).

    Thread-safe: the compile pool prepares matchers while the engine takes them.
    """

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_ids: Sequence[int],
        worker: MaskWorker,
        cache_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES,
    ) -> None:
        # The logits' width: masks cover exactly these columns.
        self.vocab_size = vocab_size
        self.worker = worker
        self.stats = CompileStats()
        self.cache: GrammarCache[GrammarSpec] = GrammarCache(cache_bytes)
        self._lock = threading.Lock()
        self._tokenizer: Future[llguidance.LLTokenizer] = worker.compile_pool.submit(
            _tokenizer, tokenizer_json, vocab_size, sorted(eos_ids)
        )

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """The vocabulary as llguidance sees it (waits while it is still being prepared)."""
        return self._tokenizer.result()

    @property
    def mask_width(self) -> int:
        """int32 words per row of a token bitmask (one bit per token of the llguidance vocab)."""
        return (self.tokenizer.vocab_size + 31) // 32

    def prepare(self, spec: GrammarSpec) -> Future[bool]:
        """One matcher of `spec` built in the compile pool for a request about to be scheduled
        (PrepareGrammar); the future says whether the grammar was known already, or raises
        InvalidRequest for a refused grammar."""
        return self.worker.compile_pool.submit(self._prepare_now, spec)

    def prepare_request(self, request: generate_pb2.PrepareGrammarRequest) -> Future[bool]:
        """PrepareGrammar: `prepare` for the request's grammar. InvalidRequest (raised, or from
        the future) for a missing or refused grammar."""
        params = generate_pb2.NextTokenChooserParameters(
            grammar=request.grammar, grammar_type=request.grammar_type
        )
        spec = GrammarSpec.from_pb(params)
        if spec is None:
            raise InvalidRequest("PrepareGrammar needs a grammar")
        return self.prepare(spec)

    def take(self, spec: GrammarSpec) -> Prepared:
        """A matcher of `spec` for a request about to sample: the one prepared for it (a hit),
        or built now, on the caller's thread (a miss); InvalidRequest when llguidance refuses
        the grammar."""
        with self._lock:
            prepared = self.cache.take(spec)
            if prepared is not None:
                self.stats.hits += 1
                return prepared
            self.stats.misses += 1
        return self._build(spec)[0]

    def _prepare_now(self, spec: GrammarSpec) -> bool:
        prepared, source, known = self._build(spec)
        size = matcher_bytes(source, self.mask_width)
        with self._lock:
            self.stats.prepared += 1
            self.cache.add_prepared(spec, prepared, size)
        return known

    def _build(self, spec: GrammarSpec) -> tuple[Prepared, str, bool]:
        """A new matcher of `spec` (build_matcher), its source, and whether that source was
        known; a new source is kept once a matcher of it was built."""
        with self._lock:
            cached = self.cache.source(spec)
        source = cached if cached is not None else grammar_source(spec)
        prepared = build_matcher(self.tokenizer, source, self.mask_width)
        if cached is None:
            with self._lock:
                self.cache.add_source(spec, source)
        return prepared, source, cached is not None

    def __len__(self) -> int:
        return len(self.cache)


def _tokenizer(tokenizer_json: str, vocab_size: int, eos_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary, at least the logits' width (a model's padding
    columns past the tokenizer's last id are never allowed); the tokenizer's own size when it
    has more ids than the model (the model never produces those)."""
    eos = eos_ids or None
    try:
        return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
    except ValueError:
        return llguidance.LLTokenizer(tokenizer_json, eos_token=eos)


def first_line(error: str) -> str:
    """llguidance's messages may end with a dump of the parser state (`<state>`, or
    `<non-verbose/>` in its place): the first lines name the problem."""
    for marker in _STATE_MARKERS:
        error = error.split(marker)[0]
    return error.strip()
