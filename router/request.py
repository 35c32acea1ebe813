"""A validated request: what the HTTP layer hands to the inference loop."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParameters:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    do_sample: bool = False
    seed: int = 0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    watermark: bool = False
    # "" or a regex / JSON-schema string; grammar_type follows the proto enum (0 none, 1 json, 2 regex).
    grammar: str = ""
    grammar_type: int = 0


@dataclass(slots=True)
class StoppingParameters:
    max_new_tokens: int
    stop_sequences: list[str] = field(default_factory=list)
    ignore_eos_token: bool = False


@dataclass(slots=True)
class ValidRequest:
    """A request that passed validation: tokenized once, every limit checked."""

    inputs: str
    input_ids: list[int]
    truncate: int
    sampling: SamplingParameters
    stopping: StoppingParameters
    top_n_tokens: int = 0
    prefill_logprobs: bool = False
    add_special_tokens: bool = True

    @property
    def input_length(self) -> int:
        return len(self.input_ids)
