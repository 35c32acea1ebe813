"""Speculation's metrics (the shards' --speculate), from each Decode answer that carried drafts.

A DecodeResponse says how many draft tokens the step fed and how many rows carried them; every
token a Generation carries past its first is a kept draft (only a drafting row emits more than
one). So the router learns, per verification step: drafted tokens, kept tokens and, per drafting
row, how many it kept (TGI's `tgi_request_skipped_tokens`: tokens a sequence got without a step
of its own). Plain steps (drafted_tokens 0) cost one integer test.
"""

from __future__ import annotations

from collections.abc import Iterable

from pytgi_proto import generate_pb2
from pytgi_router.metrics import Metrics


class SpeculationStats:
    """Totals since start and the metrics they feed."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.drafted = 0
        self.accepted = 0
        self.rows = 0

    def observe(self, response: generate_pb2.DecodeResponse) -> None:
        """Records one Decode answer; nothing when it carried no drafts."""
        if not response.drafted_tokens:
            return
        self.record(response.drafted_tokens, response.drafted_rows, response.generations)

    def record(
        self, drafted: int, rows: int, generations: Iterable[generate_pb2.Generation]
    ) -> None:
        m = self.metrics
        kept = [n - 1 for n in (len(g.tokens.ids) for g in generations) if n > 1]
        accepted = sum(kept)
        for count in kept:
            m.request_skipped_tokens.observe(count)
        # The drafting rows that kept nothing (their first token is the plain step's).
        for _ in range(max(rows - len(kept), 0)):
            m.request_skipped_tokens.observe(0)
        self.drafted += drafted
        self.accepted += accepted
        self.rows += rows
        m.speculative_drafted_tokens.inc(drafted)
        m.speculative_accepted_tokens.inc(accepted)
        m.speculative_rows.inc(rows)
        m.speculative_acceptance_rate.set(self.accepted / self.drafted)
        if self.rows:
            m.speculative_mean_accepted_length.set((self.accepted + self.rows) / self.rows)
