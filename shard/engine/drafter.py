"""The drafter interface: a decode step asks for drafts, whoever proposes them.

The step decides which rows may draft and up to how many tokens each (drafting.plan_asks: the
eligibility, the KV room, max_new_tokens, the back-off, the batch cap, the step's token
budget); the drafter proposes at most that many tokens per asked row, and the target verifies
them exactly (shard/engine/verification.py). A server has one drafter: the n-gram index of each
request's own tokens (--speculate alone), or a draft model (--speculator-model,
shard/engine/draft_model.py).

Proposals are tokens only (a point mass at each position): greedy verification keeps the
agreeing prefix, and speculative sampling against a point-mass proposal accepts a draft d with
the target's probability p(d), so every drafter's tokens suit either rule. A drafter that
proposes from a distribution (a draft model sampling, heads) would add its probabilities here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pytgi_shard.engine.batch import Batch
from pytgi_shard.engine.drafting import Drafts, ngram_drafts


class Drafter(Protocol):
    """Proposes a decode step's drafts."""

    # Names the drafter in logs and Info ("ngram", "draft-model").
    name: str

    def propose(self, batch: Batch, asks: Sequence[tuple[int, int]]) -> Drafts | None:
        """Up to k tokens for each asked (row, k) of `batch` (rows ascending), in a Drafts
        that lists only the rows given any; None when none is."""
        ...


class NgramDrafter:
    """Prompt lookup: each request's NgramIndex (shard/speculative/ngram.py), kept in its
    DraftState and fed here, when its row is asked, with the tokens it has emitted since."""

    name = "ngram"

    def propose(self, batch: Batch, asks: Sequence[tuple[int, int]]) -> Drafts | None:
        requests = batch.requests
        for row, _ in asks:
            state, length = requests[row].draft, requests[row].length
            assert state is not None, "plan_asks asks only rows with a DraftState"
            behind = length - len(state.index.tokens)
            if behind:
                state.index.extend(batch.all_ids[row, length - behind : length].tolist())
        return ngram_drafts([r.draft for r in requests], asks)
