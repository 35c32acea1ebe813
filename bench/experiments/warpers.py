"""Top-k + top-p + typical-p on a batch: the full-vocabulary sort against the top-k candidates.

Times shard/sample/chooser.py's plain warpers (a sort of every row) and shard/sample/candidate_warpers.py
(the path a batch takes when every row has a top-k), checks that they give the same scores bit
for bit, and prints a table.

    python -m pytgi_bench.experiments.warpers --shapes 256x4096,64x32000,16x128256 --top-k 50 --threads 2
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pytgi_shard.sample.candidate_warpers import top_candidates, top_p_over, typical_p_over
from pytgi_shard.sample.chooser import _top_k, _top_p, _typical_p


def _column(rows: int, value: float, device: torch.device) -> torch.Tensor:
    return torch.full((rows, 1), value, device=device)


@dataclass(frozen=True, slots=True)
class _Case:
    logits: torch.Tensor
    top_k: torch.Tensor
    max_top_k: int
    top_p: torch.Tensor
    typical_p: torch.Tensor

    def top_k_only(self) -> torch.Tensor:
        scores = self.logits.clone()
        _top_k(scores, self.top_k, self.max_top_k)
        return scores

    def full_sort(self) -> torch.Tensor:
        scores = self.top_k_only()
        _top_p(scores, self.top_p)
        _typical_p(scores, self.typical_p)
        return scores

    def candidates(self) -> torch.Tensor:
        scores = self.logits.clone()
        ids = top_candidates(scores, _top_k(scores, self.top_k, self.max_top_k))
        top_p_over(scores, ids, self.top_p)
        typical_p_over(scores, ids, self.typical_p)
        return scores


def _best_ms(fn: Callable[[], torch.Tensor], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pytgi_bench.experiments.warpers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="256x4096,64x32000,16x128256", help="ROWSxVOCAB,...")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--typical-p", type=float, default=0.9)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"# top-k {args.top_k}, top-p {args.top_p}, typical-p {args.typical_p}, {device}")
    print("| rows x vocab | top-k alone ms | full sort ms | top-k candidates ms | same scores |")
    print("|---|---|---|---|---|")
    for shape in args.shapes.split(","):
        rows, vocab = (int(x) for x in shape.split("x"))
        case = _Case(
            torch.randn(rows, vocab, device=device) * 3,
            torch.full((rows, 1), args.top_k, device=device),
            args.top_k,
            _column(rows, args.top_p, device),
            _column(rows, args.typical_p, device),
        )
        same = torch.equal(case.full_sort(), case.candidates())
        times = [
            _best_ms(f, args.repeats) for f in (case.top_k_only, case.full_sort, case.candidates)
        ]
        print(f"| {rows} x {vocab} | {times[0]:.2f} | {times[1]:.2f} | {times[2]:.2f} | "
              f"{'yes' if same else 'NO'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
