"""Constrained output as the shards receive it: TGI's `grammar` object and OpenAI's
`response_format` turned into one (grammar_type, grammar) pair — a JSON Schema as JSON text, or a
regex that the whole output must match.

Every grammar is compiled here once with the constraint library's own compiler (llguidance, with
no torch), so a schema that is not valid, uses a feature the engine does not implement, or a
regex that does not parse is a 422 naming the problem before any shard sees it. Two more
refusals keep a grammar from costing the shards what no output is worth (GrammarChecker):

- its text (the compact JSON Schema, or the regex) over `max_bytes` (--max-grammar-bytes),
  refused before anything compiles it, or even writes it out (json_size_exceeds). Compiling
  grows faster than the text: measured on this CPU, a 59 KB schema of 2,000 optional properties
  took 0.6 s to validate here and 1.3 s to compile against a 4k vocabulary, a 0.35 MB one of
  10,000 took 3-10 s and 19 s, and its first mask ~1 s; and neither can be generated past its
  `{` (the parser's items there are over llguidance's limits: 2,000 in a row, 50,000 a step).
  The default 64 KiB takes tool sets of dozens of functions and bounds one validation to well
  under a second; the verdict on a grammar is kept, so one sent with every request is compiled
  here once;
- a grammar that allows no output at all (`[a&&b]`, `[^\\x00-\\x{10FFFF}]`, `{"$ref": "#"}`):
  llguidance compiles it, and its first mask is an error state, which on a shard would force EOS
  at once (an empty 200). The grammar is compiled over a vocabulary of the 256 bytes, and its
  first mask computed: a language with no first byte is empty whatever the model's vocabulary.
  (A grammar that allows a first byte but can never end, such as a required property that
  refers to its own object, is not detected; its request fails in generation or at its length.)
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from llguidance import LLMatcher, LLParserLimits, LLTokenizer, TokenizerWrapper

from pytgi_proto import generate_pb2
from pytgi_proto.contracts import MAX_GRAMMAR_BYTES
from pytgi_router.core.errors import ValidationError

GRAMMAR_NONE = generate_pb2.GRAMMAR_TYPE_NONE
GRAMMAR_JSON = generate_pb2.GRAMMAR_TYPE_JSON
GRAMMAR_REGEX = generate_pb2.GRAMMAR_TYPE_REGEX
GRAMMAR_LARK = generate_pb2.GRAMMAR_TYPE_LARK

# OpenAI's `{"type": "json_object"}` (and TGI's json types given no schema): any JSON object.
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}

JSON_KINDS = ("json", "json_object", "json_schema")

# llguidance's messages for schemas it parses but cannot enforce.
_UNSUPPORTED = ("Unimplemented keys", "Unknown format")
# llguidance's errors when no byte can ever be produced: the grammar's language is empty.
_NO_OUTPUT = ("NoExtension", "NoExtensionBias")
# How much grammar text the router's verdicts cover (GrammarChecker).
MEMO_BYTES = 8 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Grammar:
    """What goes on the wire: `grammar_type` (the proto enum) and its `value`."""

    grammar_type: int
    value: str


def parse_grammar(grammar: dict[str, Any], max_bytes: int | None = None) -> Grammar:
    """TGI's shapes: `{"type": "json" | "json_object", "value": <schema or JSON text>}`,
    `{"type": "json_schema", "value": {"name"?, "schema"}}`, `{"type": "regex", "value": str}`;
    and pytgi's `{"type": "lark", "value": str}` (an llguidance Lark grammar: what the router
    builds for a reasoning model, reasoning/constraint.py, and accepts from clients too).
    Only the shape is checked here, and a schema surely over `max_bytes` refused before it is
    written out (`GrammarChecker.check` compiles it)."""
    kind = grammar.get("type")
    value = grammar.get("value")
    if kind == "regex":
        if not isinstance(value, str):
            raise ValidationError("grammar is not valid: a regex grammar needs a string value")
        return Grammar(GRAMMAR_REGEX, value)
    if kind == "lark":
        if not isinstance(value, str):
            raise ValidationError("grammar is not valid: a lark grammar needs a string value")
        return Grammar(GRAMMAR_LARK, value)
    if kind not in JSON_KINDS:
        raise ValidationError(
            f"grammar is not valid: unknown type {kind!r} (expected json, json_object, "
            "json_schema, regex or lark)"
        )
    schema = _schema_of(kind, value)
    if max_bytes is not None and json_size_exceeds(schema, max_bytes):
        raise _too_long(max_bytes)
    return Grammar(GRAMMAR_JSON, json.dumps(schema, separators=(",", ":"), ensure_ascii=False))


def json_size_exceeds(value: Any, limit: int) -> bool:
    """Whether `value`'s compact JSON is surely longer than `limit` bytes: a lower bound of its
    size (strings' characters, quotes, braces, separators), counted until it passes `limit`.
    Refusing a 0.35 MB schema this way costs ~2 ms of the event loop; writing it out ~45 ms."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            # {}, then "k": per member and the commas between them
            total += 1 + 4 * len(item) + sum(len(k) for k in item) if item else 2
            stack.extend(item.values())
        elif isinstance(item, list):
            total += 1 + len(item) if item else 2  # [] and the commas
            stack.extend(item)
        else:
            total += len(item) + 2 if isinstance(item, str) else 1
        if total > limit:
            return True
    return False


def _too_long(max_bytes: int) -> ValidationError:
    return ValidationError(
        f"grammar is not valid: it is longer than {max_bytes} bytes, this server's limit "
        "(--max-grammar-bytes)"
    )


def _schema_of(kind: str, value: Any) -> dict[str, Any]:
    if kind == "json_schema":
        if value is not None and not isinstance(value, dict):
            raise ValidationError("grammar is not valid: a json_schema value must be an object "
                                  "with a `schema`")
        value = (value or {}).get("schema")
    if value is None:
        return ANY_JSON_OBJECT
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValidationError(f"grammar is not valid: {err}") from None
    if not isinstance(value, dict):
        raise ValidationError("grammar is not valid: the JSON schema must be an object")
    return value


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """What the router accepts of a grammar (RouterSettings' --max-grammar-bytes)."""

    max_bytes: int = MAX_GRAMMAR_BYTES


class _ByteVocabulary:
    """The 256 bytes and an end token: the smallest vocabulary that can spell every output."""

    eos_token_id = 256
    bos_token_id = None
    tokens: Sequence[bytes] = [bytes([b]) for b in range(256)] + [b""]
    special_token_ids: Sequence[int] = [256]

    def __call__(self, text: bytes | str) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


class GrammarChecker:
    """Compiles grammars as the shards will, over the byte vocabulary, within `limits`: a 422
    for a grammar over a limit, refused by llguidance, or allowing no output. One per process
    (the vocabulary is built once); thread-safe (validation runs it in its worker pool).

    The verdicts on the last grammars checked (`memo_bytes` of their text) are kept: a client
    that sends one large schema with every request has it compiled here once, not per request
    (a 59 KB schema of 1,200 properties costs ~0.2 s), which leaves the CPU to the shards, who
    compile it for every request (each request's matcher is its own: shard/structured_output/compiler.py)."""

    def __init__(self, limits: GrammarLimits | None = None, memo_bytes: int = MEMO_BYTES) -> None:
        self.limits = limits or GrammarLimits()
        self.memo_bytes = memo_bytes
        self._vocabulary = LLTokenizer(TokenizerWrapper(_ByteVocabulary()))
        # (grammar_type, text) -> None for a valid grammar, else its refusal; oldest first.
        self._verdicts: OrderedDict[tuple[int, str], str | None] = OrderedDict()
        self._verdict_bytes = 0
        self._lock = threading.Lock()

    def parse(self, grammar: dict[str, Any]) -> Grammar:
        """parse_grammar within the size limit."""
        return parse_grammar(grammar, self.limits.max_bytes)

    def check(self, grammar: Grammar) -> None:
        if len(grammar.value.encode()) > self.limits.max_bytes:
            raise _too_long(self.limits.max_bytes)
        key = (grammar.grammar_type, grammar.value)
        with self._lock:
            known = key in self._verdicts
            verdict = self._verdicts.get(key)
            if known:
                self._verdicts.move_to_end(key)
        if not known:
            verdict = self._compile(grammar)
            self._remember(key, verdict)
        if verdict is not None:
            raise ValidationError(verdict)

    def _compile(self, grammar: Grammar) -> str | None:
        """None for a grammar llguidance compiles and that allows some output, else why not."""
        matcher = LLMatcher(
            self._vocabulary, _source(grammar), log_level=0,
            limits=LLParserLimits(verbose_errors=False),
        )  # fmt: skip
        if matcher.is_error():
            return f"grammar is not valid: {_reason(grammar, matcher.get_error())}"
        return _first_mask_refusal(grammar, matcher)

    def _remember(self, key: tuple[int, str], verdict: str | None) -> None:
        with self._lock:
            if key in self._verdicts:
                return
            self._verdicts[key] = verdict
            self._verdict_bytes += len(key[1])
            while self._verdict_bytes > self.memo_bytes and self._verdicts:
                (_, text), _ = self._verdicts.popitem(last=False)
                self._verdict_bytes -= len(text)


def _source(grammar: Grammar) -> str:
    """llguidance's grammar of `grammar` (compiling it checks it)."""
    if grammar.grammar_type == GRAMMAR_REGEX:
        return LLMatcher.grammar_from_regex(grammar.value)
    if grammar.grammar_type == GRAMMAR_LARK:
        return LLMatcher.grammar_from_lark(grammar.value)
    return LLMatcher.grammar_from_json_schema(grammar.value)


def _first_mask_refusal(grammar: Grammar, matcher: LLMatcher) -> str | None:
    """Why the grammar's first mask fails, or None: a grammar that allows no output has
    llguidance's error state there."""
    words = np.empty(((257 + 31) // 32,), dtype=np.int32)
    matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
    if not matcher.is_error():
        return None
    error = matcher.get_error()
    if error.split("\n")[0].strip() in _NO_OUTPUT:
        return "grammar is not valid: no output can match it"
    return f"grammar is not valid: {_reason(grammar, error)}"


def _reason(grammar: Grammar, message: str) -> str:
    """The library's message, on one line: for a regex its `error:` line, for a schema what it
    names, marked as unsupported when the schema is valid but not enforceable."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    error = next((line[len("error: "):] for line in lines if line.startswith("error: ")), None)
    if grammar.grammar_type == GRAMMAR_REGEX:
        return f"invalid regex {grammar.value!r}: {error or lines[0]}"
    if grammar.grammar_type == GRAMMAR_LARK:
        return f"invalid lark grammar: {lines[0] if lines else message}"
    if error is not None:  # a `pattern` inside the schema
        return f"invalid regex in the JSON schema: {error}"
    if message.startswith(_UNSUPPORTED):
        return f"unsupported JSON Schema feature: {lines[0]}"
    return lines[0] if lines else message


def response_format_grammar(fmt: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's `response_format` as a TGI grammar object: `text` (or none) is unconstrained,
    `json_object` any JSON object, `json_schema` its `json_schema.schema` (`strict` or not:
    the output always follows it). TGI's own grammar objects pass through unchanged."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind == "text":
        return None
    if "value" in fmt:
        return fmt
    if kind == "json_object":
        return {"type": "json", "value": ANY_JSON_OBJECT}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise ValidationError(
                "`response_format.json_schema` must be an object with a `schema`"
            )
        return {"type": "json_schema", "value": spec}
    return fmt
