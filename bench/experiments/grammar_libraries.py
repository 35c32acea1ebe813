"""llguidance or xgrammar: the constraint library pytgi uses, chosen by measurement on the CPU.

    python bench/experiments/grammar_libraries.py --xgrammar-python /tmp/xgvenv/bin/python \\
        --out bench/results/cpu/grammar_libraries.json

Each library runs in its own interpreter (`--llguidance-python`, default this one; xgrammar needs
torch, so it lives in a scratch venv: `python -m venv /tmp/xgvenv && /tmp/xgvenv/bin/pip install
torch==2.13.0 xgrammar jsonschema tokenizers`), over the same 128,256-token byte-level BPE
vocabulary (Llama 3's size), trained here on Python sources (no download). Measured:

- import: seconds, and whether importing the library imports torch (the router must not);
- tokenizer: seconds to build the library's view of the vocabulary (once per process);
- compile: a 20-property JSON schema, cold and again (a new matcher from the cached result);
- mask: microseconds per token for one matcher over a whole generation of that schema, and for a
  batch of 64 matchers (the batch entry point where the library has one);
- coverage: per JSON-Schema feature, 12 seeded random constrained generations per case; a case
  is "enforced" when every finished output validates (jsonschema), "refused" when the library
  rejects the schema, "ignored" when some output breaks it (the worst: a silent pass),
  "unproven" when no output finished within MAX_TOKENS.

This file imports nothing of pytgi: it runs inside the scratch venv as a script.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 128_256
# "</s>": the second special token of build_tokenizer's vocabulary.
EOS = 1
BATCH = 64
SAMPLES = 12
MAX_TOKENS = 400

SCHEMA_20: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 24},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "score": {"type": "number"},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 16}, "zip": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "phone": {"type": ["string", "null"], "maxLength": 12},
        "created": {"type": "string", "format": "date"},
        "level": {"type": "integer", "enum": [1, 2, 3]},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        "notes": {"type": "string", "maxLength": 32},
        "verified": {"type": "boolean"},
        "country": {"type": "string", "minLength": 2, "maxLength": 2},
        "limits": {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
        "kind": {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "integer"}]},
        "parent": {"type": ["integer", "null"]},
        "status": {"const": "ok"},
    },
    "required": ["id", "name", "role", "address", "status"],
    "additionalProperties": False,
}

COVERAGE: dict[str, dict[str, Any]] = {
    "nested objects": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "object", "properties": {"c": {"type": "integer"}},
                                     "required": ["c"]}},
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    "enum": {"enum": ["red", "green", 3, None]},
    "const": {"const": {"x": 1}},
    "array minItems/maxItems": {
        "type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4
    },
    "string minLength/maxLength": {"type": "string", "minLength": 3, "maxLength": 5},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "object", "properties": {
        "k": {"type": "boolean"}}, "required": ["k"], "additionalProperties": False}]},
    "oneOf": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}},
                         "required": ["a"]},
                        {"properties": {"b": {"type": "string", "maxLength": 3}},
                         "required": ["b"]}]},
    "additionalProperties false": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
        "additionalProperties": False,
    },
    "additionalProperties schema": {
        "type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3
    },
    "pattern": {"type": "string", "pattern": "^[A-Z][a-z]{2,4}-[0-9]{3}$"},
    "integer minimum/maximum": {"type": "integer", "minimum": 10, "maximum": 99},
    "number exclusiveMinimum": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "format date-time": {"type": "string", "format": "date-time"},
    "format uuid": {"type": "string", "format": "uuid"},
    "$ref/$defs": {"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}},
                                   "required": ["x"]}},
                   "type": "array", "items": {"$ref": "#/$defs/p"}, "maxItems": 2},
    "recursive $ref": {"$defs": {"n": {"type": "object", "properties": {
        "v": {"type": "integer"}, "next": {"anyOf": [{"$ref": "#/$defs/n"}, {"type": "null"}]}},
        "required": ["v", "next"], "additionalProperties": False}}, "$ref": "#/$defs/n"},
    "type list with null": {"type": ["string", "null"], "maxLength": 3},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}],
                    "items": False},
    "uniqueItems": {"type": "array", "items": {"enum": [1, 2, 3]}, "uniqueItems": True},
    "minProperties": {"type": "object", "additionalProperties": {"type": "integer"},
                      "minProperties": 2, "maxProperties": 3},
}


def build_tokenizer(path: Path) -> None:
    """A 128,256-token byte-level BPE (Llama 3's size and pre-tokenizer family), trained on the
    Python sources of this interpreter's standard library and transformers (when installed)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    site = Path(sysconfig.get_paths()["purelib"]) / "transformers"
    files += sorted(site.rglob("*.py"))
    texts = [p.read_text(errors="replace") for p in files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != VOCAB:
        raise SystemExit(f"trained {tok.get_vocab_size()} tokens, not {VOCAB}: more text needed")
    tok.save(str(path))


class Llguidance:
    """llguidance: a matcher per request; a cached grammar is a template matcher, deep-copied."""

    def __init__(self, tokenizer_path: Path) -> None:
        import llguidance

        self.llg = llguidance
        text = tokenizer_path.read_text()
        self.tokenizer = llguidance.LLTokenizer(text, n_vocab=VOCAB, eos_token=EOS)
        self.executor = llguidance.LLExecutor()

    def compile(self, schema: str) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, bitmask: np.ndarray, row: int) -> None:
        v = bitmask[row]
        matcher.unsafe_compute_mask_ptr(v.ctypes.data, v.nbytes)

    def fill_batch(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self.executor.unsafe_compute_mask_ptr(
            pairs, bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0]
        )

    def consume(self, matcher: Any, token: int) -> None:
        if not matcher.consume_token(token):
            raise RuntimeError(matcher.get_error())

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_stopped())


class Xgrammar:
    """xgrammar: a CompiledGrammar per schema (the compiler caches by content), a matcher each."""

    def __init__(self, tokenizer_path: Path) -> None:
        import xgrammar
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgrammar
        hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_path))
        info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB, stop_token_ids=[EOS])
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        self.batch = xgrammar.BatchGrammarMatcher()

    def compile(self, schema: str) -> Any:
        return self.compiler.compile_json_schema(schema, strict_mode=True)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: np.ndarray, row: int) -> None:
        import torch

        matcher.fill_next_token_bitmask(torch.from_numpy(bitmask), row)

    def fill_batch(self, matchers: list[Any], bitmask: np.ndarray) -> None:
        import torch

        self.batch.batch_fill_next_token_bitmask(matchers, torch.from_numpy(bitmask))

    def consume(self, matcher: Any, token: int) -> None:
        if not matcher.accept_token(token):
            raise RuntimeError(f"token {token} refused")

    def done(self, matcher: Any) -> bool:
        return bool(matcher.is_terminated())


def allowed(bitmask: np.ndarray, row: int) -> np.ndarray:
    return np.unpackbits(bitmask[row].view(np.uint8), bitorder="little")[:VOCAB].astype(bool)


def structural_bonus(tokenizer_path: Path) -> np.ndarray:
    """+6 for tokens holding a JSON closer or separator, +12 for EOS: random outputs then end in
    tens of tokens instead of running to the cap inside an unbounded string."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    bonus = np.zeros(VOCAB, dtype=np.float64)
    for i in range(VOCAB):
        if any(c in tok.decode([i]) for c in '"}],'):
            bonus[i] = 6.0
    bonus[EOS] = 12.0
    return bonus


def generate(
    lib: Any, compiled: Any, seed: int, bonus: np.ndarray, timings: list[float] | None = None
) -> list[int] | None:
    """One seeded random constrained generation; None when it hit MAX_TOKENS unfinished."""
    rng = np.random.default_rng(seed)
    matcher = lib.matcher(compiled)
    bitmask = np.zeros((1, (VOCAB + 31) // 32), dtype=np.int32)
    out: list[int] = []
    for _ in range(MAX_TOKENS):
        start = time.perf_counter()
        lib.fill(matcher, bitmask, 0)
        if timings is not None:
            timings.append(time.perf_counter() - start)
        scores = np.where(allowed(bitmask, 0), rng.gumbel(size=VOCAB) + bonus, -np.inf)
        token = int(scores.argmax())
        if token == EOS:
            return out
        lib.consume(matcher, token)
        out.append(token)
        if lib.done(matcher):
            return out
    return None


def coverage(lib: Any, tokenizer_path: Path, bonus: np.ndarray) -> dict[str, Any]:
    import jsonschema
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    cases = {**COVERAGE, "20-property schema": SCHEMA_20}
    result: dict[str, Any] = {}
    for name, schema in cases.items():
        try:
            compiled = lib.compile(json.dumps(schema))
        except Exception as e:  # noqa: BLE001 - any refusal is the measurement
            result[name] = {"verdict": "refused", "error": str(e)[:160]}
            continue
        invalid, unfinished, example = 0, 0, ""
        for seed in range(SAMPLES):
            ids = generate(lib, compiled, seed, bonus)
            if ids is None:
                unfinished += 1
                continue
            text = tok.decode(ids)
            example = example or text
            try:
                jsonschema.validate(json.loads(text), schema)
            except (ValueError, jsonschema.ValidationError):
                invalid += 1
                example = text
        verdict = "ignored" if invalid else "enforced" if unfinished < SAMPLES else "unproven"
        result[name] = {"verdict": verdict, "invalid": invalid, "unfinished": unfinished,
                        "example": example[:120]}
    return result


def measure(name: str, tokenizer_path: Path) -> dict[str, Any]:
    """Everything for one library, in this interpreter."""
    start = time.perf_counter()
    cls = Llguidance if name == "llguidance" else Xgrammar
    __import__(name)
    import_s = time.perf_counter() - start
    imports_torch = "torch" in sys.modules
    start = time.perf_counter()
    lib: Llguidance | Xgrammar = cls(tokenizer_path)
    tokenizer_s = time.perf_counter() - start
    schema = json.dumps(SCHEMA_20)
    start = time.perf_counter()
    compiled = lib.compile(schema)
    cold_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    lib.compile(schema)
    again_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    lib.matcher(compiled)
    matcher_ms = (time.perf_counter() - start) * 1e3
    bonus = structural_bonus(tokenizer_path)
    timings: list[float] = []
    for seed in range(4):
        generate(lib, compiled, seed, bonus, timings)
    us = np.array(timings) * 1e6
    batch_us = batch_mask(lib, compiled, bonus)
    return {
        "library": name,
        "version": _version(name),
        "import_s": round(import_s, 3),
        "imports_torch": imports_torch,
        "tokenizer_s": round(tokenizer_s, 3),
        "compile_20_properties_cold_ms": round(cold_ms, 2),
        "compile_20_properties_again_ms": round(again_ms, 3),
        "new_matcher_from_cached_ms": round(matcher_ms, 3),
        "mask_us_per_token": {"mean": round(float(us.mean()), 1),
                              "p50": round(float(np.percentile(us, 50)), 1),
                              "p99": round(float(np.percentile(us, 99)), 1),
                              "tokens": len(timings)},
        "batch64_mask_ms": round(batch_us / 1e3, 3),
        "coverage": coverage(lib, tokenizer_path, bonus),
    }


def batch_mask(lib: Any, compiled: Any, bonus: np.ndarray) -> float:
    """µs to fill 64 rows: 64 matchers each advanced a different number of tokens into one
    generation of the 20-property schema, filled by the library's batch entry point."""
    ids = generate(lib, compiled, 99, bonus) or []
    matchers = []
    for i in range(BATCH):
        m = lib.matcher(compiled)
        for token in ids[: (i * len(ids)) // BATCH]:
            lib.consume(m, token)
        matchers.append(m)
    bitmask = np.zeros((BATCH, (VOCAB + 31) // 32), dtype=np.int32)
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        lib.fill_batch(matchers, bitmask)
        runs.append(time.perf_counter() - start)
    return float(np.median(runs)) * 1e6


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def table(results: list[dict[str, Any]]) -> str:
    rows = [
        ("import (s) / imports torch", lambda r: f"{r['import_s']} / {r['imports_torch']}"),
        ("tokenizer setup (s)", lambda r: str(r["tokenizer_s"])),
        ("compile 20-prop schema cold (ms)", lambda r: str(r["compile_20_properties_cold_ms"])),
        ("compile again (ms)", lambda r: str(r["compile_20_properties_again_ms"])),
        ("new matcher from cached (ms)", lambda r: str(r["new_matcher_from_cached_ms"])),
        ("mask per token mean/p50/p99 (us)", lambda r: "{mean}/{p50}/{p99}".format(
            **r["mask_us_per_token"])),
        ("batch 64 mask (ms)", lambda r: str(r["batch64_mask_ms"])),
    ]
    cases = list(results[0]["coverage"])
    lines = ["| | " + " | ".join(f"{r['library']} {r['version']}" for r in results) + " |",
             "|---" * (len(results) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(f(r) for r in results) + " |" for label, f in rows]
    for case in cases:
        cells = []
        for r in results:
            c = r["coverage"][case]
            cells.append(c["verdict"] + (f" ({c['invalid']} invalid)" if c.get("invalid") else ""))
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokenizer", type=Path, default=Path("/tmp/pytgi-bpe-128k.json"))
    parser.add_argument("--llguidance-python", default=sys.executable)
    parser.add_argument("--xgrammar-python", default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", choices=["llguidance", "xgrammar"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.only:
        print(json.dumps(measure(args.only, args.tokenizer)))
        return
    if not args.tokenizer.exists():
        build_tokenizer(args.tokenizer)
    results = []
    for name, python in (("llguidance", args.llguidance_python), ("xgrammar", args.xgrammar_python)):
        if python is None:
            continue
        cmd = [python, __file__, "--only", name, "--tokenizer", str(args.tokenizer)]
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    command = "python bench/experiments/grammar_libraries.py " + " ".join(sys.argv[1:])
    print(command)
    print(table(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": command, "vocab": VOCAB, "results": results},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()
