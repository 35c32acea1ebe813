"""The transformers baselines: `generate` request by request (plain, or with a static cache that
transformers compiles on a GPU), `generate` on static batches, and transformers' own continuous
batching (`generate_batch`), all greedy on the same token ids."""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

from pytgi_bench.compare.system_result import SystemResult

Prompts = list[list[int]]


class Timing(NamedTuple):
    tokens: int
    # Seconds to count instead of the whole call, when the system reports a narrower window.
    served_s: float | None = None


def _load(model_dir: Path, dtype: torch.dtype, device: str, attn: str | None = None):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": attn} if attn else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **kwargs)
    return model.to(device).eval()  # type: ignore[arg-type]


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _timed(
    run: Callable[[Prompts, int], int | Timing],
    prompts: Prompts,
    new_tokens: int,
    repeats: int,
    device: str,
    result: SystemResult,
) -> SystemResult:
    """Warm-up on a few prompts, then `repeats` timed passes over all of them."""
    run(prompts[: min(4, len(prompts))], min(new_tokens, 8))
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        done = run(prompts, new_tokens)
        _sync(device)
        call_s = time.perf_counter() - start
        timing = done if isinstance(done, Timing) else Timing(done)
        if timing.served_s is not None:
            result.extra.setdefault("call_s", []).append(call_s)
        result.wall_s.append(call_s if timing.served_s is None else timing.served_s)
        result.output_tokens.append(timing.tokens)
    return result


@torch.inference_mode()
def hf_sequential(
    model_dir: Path,
    prompts: Prompts,
    new_tokens: int,
    repeats: int,
    dtype: torch.dtype,
    device: str,
) -> SystemResult:
    result = SystemResult("hf-sequential", "transformers generate, one request at a time")
    start = time.perf_counter()
    model = _load(model_dir, dtype, device)
    result.startup_s = time.perf_counter() - start
    pad = model.generation_config.pad_token_id

    def run(batch: Prompts, n: int) -> int:
        produced = 0
        for ids in batch:
            x = torch.tensor([ids], device=device)
            out = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                do_sample=False,
                pad_token_id=pad,
            )
            produced += out.shape[1] - x.shape[1]
        return produced

    return _timed(run, prompts, new_tokens, repeats, device, result)


def _compiled_graphs() -> int | None:
    """Graphs torch.compile has built in this process: evidence that transformers compiled."""
    try:
        from torch._dynamo.utils import counters

        return int(counters["stats"].get("unique_graphs", 0))
    except Exception:  # a private counter: its absence must not cost the row
        return None


def _generate_s(model: Any, ids: list[int], n: int, device: str, **kwargs: Any) -> float:
    """Seconds for one greedy `generate` of exactly `n` tokens after `ids`."""
    x = torch.tensor([ids], device=device)
    _sync(device)
    start = time.perf_counter()
    # No min_new_tokens: the benchmark models never choose EOS, and a logits processor would
    # add work to every step of the loop being timed.
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         **kwargs)
    _sync(device)
    seconds = time.perf_counter() - start
    if out.shape[1] - x.shape[1] != n:
        raise RuntimeError(f"generate produced {out.shape[1] - x.shape[1]} tokens, not {n}")
    return seconds


@torch.inference_mode()
def hf_compiled_single(
    model_dir: Path,
    prompts: Prompts,
    new_tokens: int,
    repeats: int,
    dtype: torch.dtype,
    device: str,
) -> SystemResult:
    """transformers at its fastest for one stream: `generate` with a static KV cache, which
    transformers compiles (torch.compile, CUDA graphs) on a GPU by itself — its documented
    fast path for low-latency decoding. Not compiled on the CPU (transformers does not there).

    Per prompt, one run of 1 token (time to first token: the prefill) and one of `new_tokens`;
    time per output token = (whole - first) / (new_tokens - 1). The first call compiles, untimed
    (its seconds are reported as warmup_s).
    """
    result = SystemResult(
        "hf-compiled-b1",
        "transformers generate, one request at a time, static cache"
        + (" + torch.compile" if device.startswith("cuda") else " (not compiled on CPU)"),
    )
    start = time.perf_counter()
    model = _load(model_dir, dtype, device)
    result.startup_s = time.perf_counter() - start
    kwargs = {
        "pad_token_id": model.generation_config.pad_token_id,
        "cache_implementation": "static",
    }
    warmup_s = _generate_s(model, prompts[0], new_tokens, device, **kwargs)
    result.extra["warmup_s"] = round(warmup_s, 2)
    result.extra["dynamo_graphs"] = _compiled_graphs()
    _generate_s(model, prompts[0], 1, device, **kwargs)
    for _ in range(repeats):
        firsts, wholes = [], []
        for ids in prompts:
            firsts.append(_generate_s(model, ids, 1, device, **kwargs))
            wholes.append(_generate_s(model, ids, new_tokens, device, **kwargs))
        result.wall_s.append(sum(wholes))
        result.output_tokens.append(new_tokens * len(prompts))
        per_token = [(w - f) / max(new_tokens - 1, 1) for f, w in zip(firsts, wholes, strict=True)]
        result.extra.setdefault("single_stream", []).append(
            {
                "ttft_ms": 1e3 * statistics.median(firsts),
                "tpot_ms": 1e3 * statistics.median(per_token),
            }
        )
    result.extra.update({"compiled": device.startswith("cuda"), "requests": len(prompts)})
    return result


def _left_padded(batch: Prompts, pad: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, prompt in enumerate(batch):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids.to(device), mask.to(device)


@torch.inference_mode()
def hf_static(
    model_dir: Path,
    prompts: Prompts,
    new_tokens: int,
    repeats: int,
    dtype: torch.dtype,
    device: str,
    batch_size: int,
) -> SystemResult:
    result = SystemResult(
        "hf-static",
        f"transformers generate, static batches of {batch_size} (left padding, arrival order)",
    )
    start = time.perf_counter()
    model = _load(model_dir, dtype, device)
    result.startup_s = time.perf_counter() - start
    pad = model.generation_config.pad_token_id
    pad = 0 if pad is None else pad

    def run(all_prompts: Prompts, n: int) -> int:
        produced = 0
        for first in range(0, len(all_prompts), batch_size):
            ids, mask = _left_padded(all_prompts[first : first + batch_size], pad, device)
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=pad
            )
            produced += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        return produced

    result.extra["batch_size"] = batch_size
    return _timed(run, prompts, new_tokens, repeats, device, result)


class _ErrorCapture(logging.Handler):
    """generate_batch logs its failures instead of raising: keep the first one."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.message: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.message is None:
            text = record.getMessage()
            if record.exc_info and record.exc_info[1] is not None:
                text = f"{text} ({type(record.exc_info[1]).__name__})"
            self.message = text


def _paged_sdpa() -> str:
    """transformers' paged SDPA attention: "sdpa_paged" in 4.x, "paged|sdpa" in 5.x before 5.23,
    plain "sdpa" since (continuous batching pages it; the prefixed name is gone)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name in ("paged|sdpa", "sdpa_paged"):
        if name in ALL_ATTENTION_FUNCTIONS:
            return name
    return "sdpa"


def _served_window(outputs: list[Any]) -> float | None:
    """First request created to last request finished, when transformers stamps both (5.x):
    generate_batch first sizes its cache and captures CUDA graphs for the workload — set-up
    that a server does once at start, not per batch of requests. None: time the whole call."""
    try:
        created = min(float(o.created_time) for o in outputs)
        finished = max(float(o.lifespan[1]) for o in outputs)
    except (AttributeError, IndexError, TypeError, ValueError):
        return None
    if any(float(o.lifespan[1]) <= 0 for o in outputs) or finished <= created:
        return None
    return finished - created


class RequestsFailed(RuntimeError):
    """generate_batch returned, but with requests missing, failed or without a single token."""


def _check_outputs(outputs: list[Any], requests: int, logged: str | None) -> None:
    """Raises RequestsFailed unless every request came back finished with tokens: transformers
    returns failed requests (5.x: `error` set, status FAILED, no tokens) instead of raising,
    and only logs why — `logged`, the first error it logged, is the reason reported."""
    failed = [o for o in outputs if o.error is not None or _status(o) == "FAILED"]
    empty = [o for o in outputs if not o.generated_tokens]
    if len(outputs) == requests and not failed and not empty:
        return
    first = next((o.error for o in failed if o.error), None)
    raise RequestsFailed(
        f"{len(outputs)}/{requests} requests returned, {len(failed)} failed, "
        f"{len(empty)} without tokens: {first or logged or 'no error given'}"
    )


def _status(output: Any) -> str:
    """The request status' name: an Enum of strings in 4.x, an IntEnum in 5.x."""
    return str(getattr(output.status, "name", output.status)).upper()


def _batching_config(knobs: dict[str, int]) -> dict[str, Any]:
    """generate_batch's sizing knobs: 5.x takes them in a ContinuousBatchingConfig (it ignores
    them on the GenerationConfig), 4.x on the GenerationConfig ({} here)."""
    try:
        from transformers import ContinuousBatchingConfig  # type: ignore[attr-defined]
    except ImportError:
        return {}
    fields: dict[str, Any] = dict(knobs)  # typed loosely: its fields differ between releases
    return {"continuous_batching_config": ContinuousBatchingConfig(**fields)}


@contextlib.contextmanager
def _cpu_memory_probe(available_bytes: int | None) -> Iterator[None]:
    """transformers sizes its paged cache from accelerator memory only (on CPU 4.57 gets None,
    5.17 a negative block count, and generate_batch refuses); this reports `available_bytes`
    instead, for the patched CPU row."""
    if available_bytes is None:
        yield
        return
    from transformers.generation.continuous_batching import cache

    handler = cache.PagedAttentionMemoryHandler
    original = handler.__dict__["get_available_memory"]
    handler.get_available_memory = staticmethod(  # type: ignore[method-assign,assignment]
        lambda max_memory_percent=1.0: int(available_bytes * max_memory_percent)
    )
    try:
        yield
    finally:
        handler.get_available_memory = original  # type: ignore[method-assign]


# no_grad, not inference_mode: transformers 5.x allocates the paged cache and its static input
# tensors in this thread and updates them in place from its generation thread, where inference
# mode (thread-local) is off — tensors made in inference mode then refuse every in-place write,
# each request fails and generate_batch returns them all, empty, in a fraction of a second.
@torch.no_grad()
def hf_continuous(
    model_dir: Path,
    prompts: Prompts,
    new_tokens: int,
    repeats: int,
    dtype: torch.dtype,
    device: str,
    num_blocks: int | None = None,
    max_batch_tokens: int | None = None,
    cpu_memory_bytes: int | None = None,
) -> SystemResult:
    """`model.generate_batch` with the `sdpa_paged` attention; N/A with its error if it refuses.

    `cpu_memory_bytes` patches transformers' memory probe on CPU (see _cpu_memory_probe).
    """
    from transformers import GenerationConfig

    if cpu_memory_bytes is None:
        result = SystemResult(
            "hf-cb", "transformers continuous batching (generate_batch, sdpa_paged), unmodified"
        )
    else:
        result = SystemResult(
            "hf-cb-cpu-patched",
            "transformers generate_batch with its CPU memory probe patched to work on CPU",
        )
        result.extra["cpu_memory_bytes"] = cpu_memory_bytes
    start = time.perf_counter()
    model = _load(model_dir, dtype, device, attn=_paged_sdpa())
    result.startup_s = time.perf_counter() - start
    knobs = {
        k: v
        for k, v in {"num_blocks": num_blocks, "max_batch_tokens": max_batch_tokens}.items()
        if v is not None
    }
    batching = _batching_config(knobs)
    config = GenerationConfig(
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=model.generation_config.pad_token_id,
        **({} if batching else knobs),
    )
    result.extra.update(knobs)
    capture = _ErrorCapture()
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    cb_logger.addHandler(capture)
    try:

        def run(batch: Prompts, n: int) -> Timing:
            config.max_new_tokens = n
            outputs = model.generate_batch(
                batch, generation_config=config, progress_bar=False, **batching
            )
            done = list(outputs.values())
            _check_outputs(done, len(batch), capture.message)
            return Timing(sum(len(o.generated_tokens) for o in done), _served_window(done))

        with _cpu_memory_probe(cpu_memory_bytes):
            return _timed(run, prompts, new_tokens, repeats, device, result)
    except RequestsFailed as exc:  # it accepted the setup, then broke: an error, not N/A
        return SystemResult(result.system, result.description, status="error", error=str(exc))
    except Exception as exc:  # any refusal of this setup is the row's N/A reason
        return SystemResult.not_available(
            result.system, result.description, f"{type(exc).__name__}: {exc}"
        )
    finally:
        cb_logger.removeHandler(capture)
