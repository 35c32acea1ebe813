"""The requests of a run: prompts (synthetic or from a file) with their target output lengths."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pytgi_bench.settings import LengthRange
from pytgi_bench.token_aligner import TokenCounter, align_prompt

_PROMPT_KEYS = ("prompt", "inputs", "text")
_OUTPUT_KEYS = ("max_new_tokens", "output_len", "max_tokens")
# Bounds the /tokenize calls in flight while aligning, so the server is not flooded before a run.
_ALIGN_PARALLELISM = 16


@dataclass(slots=True, frozen=True)
class WorkloadItem:
    prompt: str
    # Prompt tokens as the server counts them (None when unknown).
    input_tokens: int | None
    max_new_tokens: int


@dataclass(slots=True)
class Workload:
    items: list[WorkloadItem]
    # True when every input_tokens came from the server's (or the model's) tokenizer.
    input_lengths_exact: bool
    # Synthetic prompts whose aligned length differs from the drawn target.
    length_mismatches: int = 0


def read_prompt_file(path: Path) -> list[tuple[str, int | None]]:
    """Prompts (and optional output lengths) from .jsonl, .json (a list) or text (one per line)."""
    if not path.is_file():
        raise FileNotFoundError(f"prompts file not found: {path}")
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        records = [
            _json(line, path, number)
            for number, line in enumerate(text.splitlines(), 1)
            if line.strip()
        ]
    elif path.suffix == ".json":
        records = _json(text, path, 1)
        if not isinstance(records, list):
            raise ValueError(f"{path}: a .json prompts file must hold a list")
    else:
        records = [line for line in text.splitlines() if line.strip()]
    prompts = [_prompt_record(record, path) for record in records]
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts


def _json(text: str, path: Path, line: int) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}:{line}: invalid JSON: {exc}") from None


def _prompt_record(record: object, path: Path) -> tuple[str, int | None]:
    if isinstance(record, str):
        return record, None
    if isinstance(record, dict):
        prompt = next((record[k] for k in _PROMPT_KEYS if k in record), None)
        output = next((record[k] for k in _OUTPUT_KEYS if k in record), None)
        if isinstance(prompt, str) and prompt and (output is None or isinstance(output, int)):
            return prompt, output
    raise ValueError(f"{path}: each record must be a string or have one of {_PROMPT_KEYS}")


async def build_workload(
    count: int,
    input_len: LengthRange,
    output_len: LengthRange,
    counter: TokenCounter,
    prompts_file: Path | None,
    seed: int,
) -> Workload:
    """`count` requests, reproducible from `seed`; file prompts are cycled when fewer."""
    rng = random.Random(seed)
    outputs = [output_len.sample(rng) for _ in range(count)]
    limit = asyncio.Semaphore(_ALIGN_PARALLELISM)
    if prompts_file is not None:
        prompts = read_prompt_file(prompts_file)
        chosen = [prompts[i % len(prompts)] for i in range(count)]

        async def measure(text: str) -> int:
            async with limit:
                return len(await counter.offsets(text))

        lengths = await asyncio.gather(*(measure(text) for text, _ in chosen))
        items = [
            WorkloadItem(text, length, own if own is not None else out)
            for (text, own), length, out in zip(chosen, lengths, outputs, strict=True)
        ]
        return Workload(items, counter.exact)

    targets = [input_len.sample(rng) for _ in range(count)]
    seeds = [rng.getrandbits(32) for _ in range(count)]

    async def aligned(target: int, item_seed: int) -> tuple[str, int]:
        async with limit:
            return await align_prompt(counter, target, random.Random(item_seed))

    prompts_aligned = await asyncio.gather(
        *(aligned(t, s) for t, s in zip(targets, seeds, strict=True))
    )
    items = [
        WorkloadItem(text, length, out)
        for (text, length), out in zip(prompts_aligned, outputs, strict=True)
    ]
    mismatches = sum(1 for (_, n), t in zip(prompts_aligned, targets, strict=True) if n != t)
    return Workload(items, counter.exact, mismatches)
