"""Every request parameter, declared once: the table the router parses, bounds-checks and
documents requests from, and the shard reads its "0 means unset" values from.

Both processes import pytgi_proto and nothing of each other, so the table lives here, beside
the wire it fills. A new sampling parameter is one `Parameter` row here, its field in
generate.proto's NextTokenChooserParameters, one field of the router's GenerateParameters
(schemas.py) and its warper in the shard's chooser; parsing, the 422 bounds, the OpenAPI
document and the wire message follow from the row.

Plain Python (no torch, no grpc): the router's core imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pytgi_proto import generate_pb2

# The wire carries sampling parameters as 32-bit floats: a larger value arrives as infinity
# (a grammar's -inf logits over an infinite temperature are NaN).
FLOAT32_MAX = 3.4028234663852886e38
# float32's smallest normal value: a probability mass below it is 0 (or subnormal) on the wire.
FLOAT32_TINY = 1.1754943508222875e-38
# repetition_penalty divides a seen token's positive logit by itself and multiplies a negative
# one: 1e-40 overflows float32 (infinite scores, NaN logprobs, token 0 forever) and a huge one
# can make a constrained row all -inf. At either end of this range the choice among seen tokens
# is already fixed, so nothing a user could want lies beyond it (TGI only asks for > 0).
REPETITION_PENALTY_RANGE = (1e-3, 1e3)

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
I32 = 2**31

# The JSON type a parameter is read as ("strings": a list of strings, or one bare string).
Kind = Literal["integer", "number", "boolean", "string", "object", "strings"]


@dataclass(frozen=True, slots=True)
class Bound:
    """One range rule and the 422 it raises, word for word TGI's where TGI has the rule.
    `message` may hold `{value}`: the value given. An open end excludes its limit."""

    message: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def holds(self, value: float) -> bool:
        """Whether `value` lies inside (NaN never does: the parsers refuse it before)."""
        above_low = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below_high = self.high is None or (
            value < self.high if self.high_open else value <= self.high)
        return above_low and below_high

    def error(self, value: Any) -> str:
        return self.message.format(value=value)

    def openapi(self) -> dict[str, float]:
        """The same range as JSON Schema keywords (OpenAPI 3.0 spelling)."""
        out: dict[str, float] = {}
        if self.low is not None:
            out["exclusiveMinimum" if self.low_open else "minimum"] = self.low
        if self.high is not None:
            out["exclusiveMaximum" if self.high_open else "maximum"] = self.high
        return out


@dataclass(frozen=True, slots=True)
class Parameter:
    """One field of a TGI `parameters` object.

    `neutral` is the value that changes nothing (what an absent parameter means to the
    sampler); for a `wire` field, proto3's 0 arrives when it was never set, and the shard
    reads 0 as `neutral`. `bounds` are the static 422 rules, checked in order on a given
    value (limits from the command line, e.g. --max-best-of, stay in the validator).
    `lo`/`hi` are an integer's JSON range (TGI's u32 unless said otherwise)."""

    name: str
    kind: Kind
    description: str = ""
    wire: str | None = None
    neutral: Any = None
    # True: a plain flag whose absence reads as False (TGI's `bool` fields, not `Option`).
    flag: bool = False
    bounds: tuple[Bound, ...] = ()
    lo: int = 0
    hi: int = U32_MAX
    # Other spellings of the same field in a TGI body (read as one switch with `name`).
    aliases: tuple[str, ...] = ()
    # The OpenAI request fields that map onto it (chat and completions), documentation of
    # router/http/openai/schemas.py's mapping.
    openai: tuple[str, ...] = ()
    # OpenAPI keywords beyond type and bounds (limits whose default the document shows).
    openapi: dict[str, Any] = field(default_factory=dict)

    def violation(self, value: Any) -> str | None:
        """The first broken bound's message (the router's 422), or None."""
        for bound in self.bounds:
            if not bound.holds(value):
                return bound.error(value)
        return None

    def schema(self) -> dict[str, Any]:
        """This parameter's OpenAPI property."""
        out: dict[str, Any] = {"type": "array", "items": {"type": "string"}} if (
            self.kind == "strings") else {"type": self.kind}
        if self.flag:
            out["default"] = False
        elif self.kind != "strings":
            out["nullable"] = True
        for bound in self.bounds:
            out.update(bound.openapi())
        out.update(self.openapi)
        if self.description:
            out["description"] = self.description
        return out


_REP_LOW, _REP_HIGH = REPETITION_PENALTY_RANGE

# Sampling rows first, in the order the validator checks them (which 422 a request with two
# bad values gets).
SAMPLING: tuple[Parameter, ...] = (
    Parameter(
        "temperature", "number", "divides the logits; below 1e-5 it is greedy",
        wire="temperature", neutral=1.0, openai=("temperature",),
        bounds=(
            Bound("`temperature` must be strictly positive", low=0.0, low_open=True),
            Bound(f"`temperature` must be <= {FLOAT32_MAX} (a 32-bit float). Given: {{value}}",
                  high=FLOAT32_MAX),
        ),
    ),
    Parameter(
        "repetition_penalty", "number", "divides a seen token's positive logit (CTRL)",
        wire="repetition_penalty", neutral=1.0, openai=("repetition_penalty", "presence_penalty"),
        bounds=(
            Bound("`repetition_penalty` must be strictly positive", low=0.0, low_open=True),
            Bound(f"`repetition_penalty` must be >= {_REP_LOW} and <= {_REP_HIGH}. "
                  "Given: {value}", low=_REP_LOW, high=_REP_HIGH),
        ),
    ),
    Parameter(
        "frequency_penalty", "number", "subtracted from a logit once per earlier occurrence",
        wire="frequency_penalty", neutral=0.0, openai=("frequency_penalty",),
        bounds=(Bound("`frequency_penalty` must be >= -2.0 and <= 2.0", low=-2.0, high=2.0),),
    ),
    Parameter(
        "top_p", "number", "nucleus sampling: the smallest set holding this probability mass",
        wire="top_p", neutral=1.0, openai=("top_p",),
        bounds=(Bound("`top_p` must be > 0.0 and <= 1.0", low=0.0, low_open=True, high=1.0),),
    ),
    Parameter(
        "typical_p", "number", "locally typical sampling's mass",
        wire="typical_p", neutral=1.0,
        bounds=(Bound("`typical_p` must be > 0.0 and < 1.0", low=0.0, low_open=True, high=1.0,
                      high_open=True),),
    ),
    Parameter(
        "top_k", "integer", "keep only the k most likely tokens", wire="top_k", neutral=0,
        lo=-I32, hi=I32 - 1,
        bounds=(Bound("`top_k` must be strictly positive", low=0, low_open=True),),
    ),
    Parameter(
        "do_sample", "boolean", "true when `parameters` is omitted entirely",
        wire="do_sample", neutral=False, flag=True,
    ),
    Parameter(
        "seed", "integer", "random when not given", wire="seed", neutral=0, hi=U64_MAX,
        openai=("seed",), openapi={"minimum": 0},
    ),
    Parameter(
        "watermark", "boolean", "Kirchenbauer et al.'s green-list watermark",
        wire="watermark", neutral=False, flag=True,
    ),
)

# The rest of a `parameters` object: how to answer, when to stop, what to return.
OTHERS: tuple[Parameter, ...] = (
    Parameter("best_of", "integer", openapi={"minimum": 1, "example": 1}),
    Parameter("max_new_tokens", "integer", "default: max_total_tokens - input tokens",
              openai=("max_tokens", "max_completion_tokens"), openapi={"minimum": 1}),
    Parameter("return_full_text", "boolean"),
    Parameter("stop", "strings", openai=("stop",), openapi={"maxItems": 4}),
    Parameter("truncate", "integer", openapi={"minimum": 1}),
    Parameter("details", "boolean", flag=True),
    Parameter("decoder_input_details", "boolean", flag=True),
    Parameter("top_n_tokens", "integer", openai=("top_logprobs",),
              openapi={"minimum": 0, "maximum": 5}),
    Parameter("grammar", "object", "{type: json|json_object|json_schema|regex|lark, value} "
              "(lark: an llguidance Lark grammar)",
              openai=("response_format",)),
    Parameter("adapter_id", "string"),
    # pytgi extension (vLLM's name; TGI has none): generate until max_new_tokens or a stop
    # sequence even past EOS, for token-exact benchmarks. vLLM's TGI backend sends
    # `ignore_eos_token`: the same switch.
    Parameter("ignore_eos", "boolean",
              "pytgi extension: generate past EOS (token-exact benchmarks)", flag=True,
              aliases=("ignore_eos_token",), openai=("ignore_eos", "ignore_eos_token")),
)

PARAMETERS: tuple[Parameter, ...] = SAMPLING + OTHERS
BY_NAME: dict[str, Parameter] = {p.name: p for p in PARAMETERS}


def openapi_properties() -> dict[str, Any]:
    """The `GenerateParameters` schema's properties, aliases documented as such."""
    out: dict[str, Any] = {}
    for param in PARAMETERS:
        out[param.name] = param.schema()
        for alias in param.aliases:
            out[alias] = {**param.schema(), "description": f"alias of {param.name}"}
    return out


def neutral_sampling(**given: Any) -> generate_pb2.NextTokenChooserParameters:
    """The wire's sampling message with every field at its neutral value, then `given`: the
    one sampling type the router's request and the wire share."""
    values = {p.wire: p.neutral for p in SAMPLING if p.wire is not None}
    values.update(given)
    return generate_pb2.NextTokenChooserParameters(**values)


def replace_sampling(
    sampling: generate_pb2.NextTokenChooserParameters, **changes: Any
) -> generate_pb2.NextTokenChooserParameters:
    """A copy with `changes` (dataclasses.replace for the message), e.g. best_of's own seeds."""
    out = generate_pb2.NextTokenChooserParameters()
    out.CopyFrom(sampling)
    for name, value in changes.items():
        setattr(out, name, value)
    return out


def wire_values(sampling: generate_pb2.NextTokenChooserParameters) -> dict[str, Any]:
    """Each sampling row's value by its name, proto3's 0 ("never set") read as the row's
    neutral value: what the shard's SamplingParams is built from."""
    return {name: getattr(sampling, wire) or neutral for name, wire, neutral in _WIRE_ROWS}


_WIRE_ROWS: tuple[tuple[str, str, Any], ...] = tuple(
    (p.name, p.wire, p.neutral) for p in SAMPLING if p.wire is not None)
