"""Grammars of constrained requests: the wire's grammar to an llguidance matcher, cached by content.

A request's NextTokenChooserParameters may carry a grammar (GRAMMAR_TYPE_JSON: a JSON Schema as
a JSON string; GRAMMAR_TYPE_REGEX: a regex the whole output must match). llguidance (chosen over
xgrammar by measurement: bench/grammar_libraries.py) compiles it against the model's vocabulary
into an LLMatcher; each request gets a deep copy of its grammar's compiled matcher (~10 us: the
grammar and lexer are shared), advanced by every token it samples.

Why llguidance (bench/results/cpu/grammar_libraries.json, 128k vocabulary, this CPU): a
20-property schema compiles in ~2 ms (xgrammar: ~500 ms cold); masks cost ~20 us per token at
the median and ~0.4 ms for a batch of 64 (xgrammar: ~17 ms); it enforces every JSON-Schema
feature measured or refuses it by name (xgrammar silently ignored allOf); and it imports
neither torch nor numpy, so the router validates schemas with the same library.

Compiling costs ~2-5 ms for the usual schemas and 100 ms or more for very large ones, so it
happens off the step: the router sends PrepareGrammar for every constrained request before the
request joins its queue, and `prepare` compiles it in the worker's compile pool (one request's
grammar compiling never delays a running batch's steps); the request is scheduled once every
rank answered. Batch.from_pb then finds it in the cache (a hit); a request that reaches a shard
unprepared (a shard restarted in between, or a client of the shard that skips the RPC) is
compiled there, on the step, as before. The cache is an LRU keyed by the grammar's type and
text, and a grammar being compiled is compiled once, whoever asks for it meanwhile. The
vocabulary's own preparation (~0.7 s at 128k tokens) starts in the mask worker when the engine
is built, so the first constrained request does not pay it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import llguidance

from pytgi_proto import generate_pb2
from pytgi_shard.errors import InvalidRequest
from pytgi_shard.grammar_worker import MaskWorker

JSON = generate_pb2.GRAMMAR_TYPE_JSON
REGEX = generate_pb2.GRAMMAR_TYPE_REGEX
# Whitespace between JSON tokens: at most one space, as TGI's outlines-built grammars allow
# (`{"a": 1, "b": [2, 3]}` or compact); a model cannot loop on blank lines inside an object.
JSON_WHITESPACE = r"[ ]?"


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
        if kind not in (JSON, REGEX):
            raise InvalidRequest(f"unknown grammar_type {kind}")
        if not pb.grammar:
            raise InvalidRequest(f"grammar_type {generate_pb2.GrammarType.Name(kind)} needs a grammar")
        return cls(kind, pb.grammar)


def grammar_source(spec: GrammarSpec) -> str:
    """The llguidance grammar of `spec` (not yet checked: compiling it checks it)."""
    if spec.grammar_type == REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec.text)
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(
            spec.text, defaults={"whitespace_pattern": JSON_WHITESPACE}
        )
    except ValueError as e:
        raise InvalidRequest(f"invalid grammar: the JSON schema is not valid JSON: {e}") from e


@dataclass(slots=True)
class CompileStats:
    """How often a grammar was compiled (misses) or found compiled (hits)."""

    hits: int = 0
    misses: int = 0


class GrammarCompiler:
    """Compiles grammars for one model's vocabulary and keeps the last `capacity` of them.

    Thread-safe: the engine compiles on its own thread while the mask worker builds matchers.
    """

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_ids: Sequence[int],
        worker: MaskWorker,
        capacity: int = 256,
    ) -> None:
        # The logits' width: masks cover exactly these columns.
        self.vocab_size = vocab_size
        self.worker = worker
        self.capacity = capacity
        self.stats = CompileStats()
        self._cache: OrderedDict[GrammarSpec, llguidance.LLMatcher] = OrderedDict()
        # Grammars being compiled in the compile pool, by whoever asked first.
        self._compiling: dict[GrammarSpec, Future[llguidance.LLMatcher]] = {}
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

    def prepare(self, spec: GrammarSpec) -> Future[llguidance.LLMatcher]:
        """`spec` compiled into the cache in the compile pool (PrepareGrammar); done at once
        when it is cached already. The future raises InvalidRequest for a refused grammar."""
        with self._lock:
            compiled = self._cached(spec)
            if compiled is None:
                running = self._compiling.get(spec)
                if running is None:
                    running = self.worker.compile_pool.submit(self._compile_now, spec)
                    self._compiling[spec] = running
                return running
        done: Future[llguidance.LLMatcher] = Future()
        done.set_result(compiled)
        return done

    def prepare_request(self, request: generate_pb2.PrepareGrammarRequest) -> Future[bool]:
        """PrepareGrammar: the request's grammar compiled into the cache (`prepare`); the future
        says whether it was cached already. InvalidRequest (raised, or from the future) for a
        missing or refused grammar."""
        params = generate_pb2.NextTokenChooserParameters(
            grammar=request.grammar, grammar_type=request.grammar_type
        )
        spec = GrammarSpec.from_pb(params)
        if spec is None:
            raise InvalidRequest("PrepareGrammar needs a grammar")
        compiling = self.prepare(spec)
        cached = compiling.done()
        prepared: Future[bool] = Future()
        compiling.add_done_callback(lambda done: _settle(prepared, done, cached))
        return prepared

    def compile(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """The compiled matcher of `spec` (to be copied, never advanced): from the cache, from
        a compilation under way, or compiled now; InvalidRequest when llguidance refuses it."""
        with self._lock:
            compiled = self._cached(spec)
            running = self._compiling.get(spec) if compiled is None else None
        if compiled is not None:
            return compiled
        if running is not None:
            return running.result()
        return self._compile_now(spec)

    def _cached(self, spec: GrammarSpec) -> llguidance.LLMatcher | None:
        """The cached matcher (a hit, counted), or None; the caller holds the lock."""
        compiled = self._cache.get(spec)
        if compiled is not None:
            self._cache.move_to_end(spec)
            self.stats.hits += 1
        return compiled

    def _compile_now(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        try:
            compiled = llguidance.LLMatcher(self.tokenizer, grammar_source(spec), log_level=0)
            if compiled.is_error():
                raise InvalidRequest(f"invalid grammar: {_first_line(compiled.get_error())}")
        except BaseException:
            with self._lock:
                self._compiling.pop(spec, None)
            raise
        with self._lock:
            # Cached in the same breath as it stops being "compiling": nobody compiles it twice.
            self._compiling.pop(spec, None)
            self.stats.misses += 1
            self._cache[spec] = compiled
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        return compiled

    def __len__(self) -> int:
        return len(self._cache)


def new_matcher(compiled: llguidance.LLMatcher, generated_ids: Sequence[int]) -> llguidance.LLMatcher:
    """A request's own matcher, advanced past the tokens it already generated (a request resumed
    after preemption replays them). A replayed token the grammar refuses leaves the matcher in
    its error state, whose mask allows only EOS: the request then ends at once."""
    matcher = compiled.deep_copy()
    if generated_ids:
        matcher.consume_tokens(list(generated_ids))
    return matcher


def _tokenizer(tokenizer_json: str, vocab_size: int, eos_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of the vocabulary, at least the logits' width (a model's padding
    columns past the tokenizer's last id are never allowed); the tokenizer's own size when it
    has more ids than the model (the model never produces those)."""
    eos = eos_ids or None
    try:
        return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos)
    except ValueError:
        return llguidance.LLTokenizer(tokenizer_json, eos_token=eos)


def _first_line(error: str) -> str:
    """llguidance's messages end with a dump of the parser state: the first lines name the problem."""
    return error.split("\n<state>")[0].strip()


def _settle(prepared: Future[bool], done: Future[llguidance.LLMatcher], cached: bool) -> None:
    """`prepared` answers `cached` once `done` compiled, or fails as it did."""
    error = done.exception()
    if error is not None:
        prepared.set_exception(error)
    else:
        prepared.set_result(cached)
