"""Turns one forward's logits into each request's next token and its Generation message.

This is the "decode" part of a step (TGI's decode_ns): choose tokens for the whole batch with
tensor ops, move them to the host once, then one short loop per request to detokenize, check
stopping and build the protos.
"""

from __future__ import annotations

import torch

from pytgi_proto import generate_pb2
from pytgi_shard.batch import Batch, ForwardInputs, RequestState
from pytgi_shard.detokenizer import Detokenizer
from pytgi_shard.sampling import top_tokens

NAN = float("nan")


def next_tokens(
    batch: Batch, logits: torch.Tensor, inputs: ForwardInputs, detokenizer: Detokenizer
) -> tuple[list[generate_pb2.Generation], list[int]]:
    """Advances every request of `batch` by one token; returns the Generations and the ids of
    the requests that finished."""
    prefill = _prefill_tokens(batch, logits, inputs, detokenizer) if not batch.prefilled else {}
    last = logits if logits.shape[0] == len(batch) else logits.index_select(0, inputs.last_rows)
    next_ids, logprobs = batch.chooser(last, batch.all_ids, batch.lengths)
    chosen = logprobs.gather(1, next_ids.unsqueeze(1)).squeeze(1)
    top_n = [r.top_n_tokens for r in batch.requests]
    tops = top_tokens(logprobs, top_n) if any(top_n) else None
    batch.append(next_ids)
    ids, lps = next_ids.tolist(), chosen.tolist()

    requests = batch.requests
    for r, token in zip(requests, ids, strict=True):
        r.text.ids.append(token)
    texts = detokenizer.advance([r.text for r in requests])
    top_texts = _top_texts(tops, detokenizer)
    special = detokenizer.special_ids
    generations = []
    finished = []
    for i, r in enumerate(requests):
        token, text = ids[i], texts[i]
        generation = generate_pb2.Generation(
            request_id=r.id,
            tokens=generate_pb2.Tokens(
                ids=[token], logprobs=[lps[i]], texts=[text], is_special=[token in special]
            ),
        )
        if r.id in prefill:
            generation.prefill_tokens.CopyFrom(prefill[r.id])
        if tops is not None and r.top_n_tokens:
            generation.top_tokens.append(_tokens(*tops[i], top_texts[i], special))
        reason = r.stopping(token, text)
        if reason is not None:
            generation.generated_text.CopyFrom(_generated_text(r, reason, detokenizer))
            finished.append(r.id)
        generations.append(generation)
    return generations, finished


def _generated_text(
    r: RequestState, reason: int, detokenizer: Detokenizer
) -> generate_pb2.GeneratedText:
    out = generate_pb2.GeneratedText(
        text=detokenizer.decode(r.text.generated_ids, skip_special_tokens=True),
        generated_tokens=r.stopping.generated,
        finish_reason=reason,  # type: ignore[arg-type]
    )
    if r.seed is not None:
        out.seed = r.seed
    return out


def _prefill_tokens(
    batch: Batch, logits: torch.Tensor, inputs: ForwardInputs, detokenizer: Detokenizer
) -> dict[int, generate_pb2.Tokens]:
    """Prompt tokens with their logprobs (from the raw logits; the first has none: NaN)."""
    if inputs.prompt_rows is None or inputs.prompt_targets is None:
        return {}
    rows = logits.index_select(0, inputs.prompt_rows)
    logprobs = torch.log_softmax(rows, dim=-1).gather(1, inputs.prompt_targets.unsqueeze(1))
    flat = logprobs.squeeze(1).tolist()
    special = detokenizer.special_ids
    out = {}
    offset = 0
    for row, r in enumerate(batch.requests):
        if not r.prefill_logprobs:
            continue
        prompt = batch.all_ids[row, : r.prompt_length].tolist()
        lps = [NAN, *flat[offset : offset + r.prompt_length - 1]]
        offset += r.prompt_length - 1
        out[r.id] = _tokens(prompt, lps, detokenizer.token_texts(prompt), special)
    return out


def _top_texts(
    tops: list[tuple[list[int], list[float]]] | None, detokenizer: Detokenizer
) -> list[list[str]]:
    """Each top token decoded alone, with one tokenizer call for the whole batch."""
    if tops is None:
        return []
    texts = iter(detokenizer.token_texts([t for ids, _ in tops for t in ids]))
    return [[next(texts) for _ in ids] for ids, _ in tops]


def _tokens(
    ids: list[int], logprobs: list[float], texts: list[str], special: frozenset[int]
) -> generate_pb2.Tokens:
    return generate_pb2.Tokens(
        ids=ids, logprobs=logprobs, texts=texts, is_special=[i in special for i in ids]
    )
