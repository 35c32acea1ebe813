"""What prompt logprobs (`decoder_input_details`) cost a shard: the time and peak memory of one
long prompt's prefill with and without them, whole and in chunks (--max-batch-prefill-tokens).

TGI 3 turns them off unless `--enable-prefill-logprobs` is given, for their memory; pytgi always
serves them. The logits of every prompt row ([chunk, vocab], float32 on the CPU) are the cost,
so the model is a small random Llama with Llama 3's 128,256-token vocabulary (hidden 256, 2
layers): the rest of the forward is small and the difference is the logprobs'. Each case runs in
a fresh process, whose peak RSS after the prefill, less the peak after loading and a tiny
warmup, is the prefill's own peak; the time is the fastest of --repeats prefills.

    python -m pytgi_bench.experiments.prefill_logprobs [--root build/bench-models] [--prompt 2048]
        [--chunks 2048,512] [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pytgi_bench.compare.model_builder import LlamaShape, build_random_llama
from pytgi_proto import generate_pb2 as pb

REPO = Path(__file__).resolve().parents[2]
DEMO_MODEL = REPO / "launcher" / "demo_model"
SHAPE = LlamaShape("logprobs-probe", 256, 768, 2, 4, 2, vocab_size=128256,
                   max_position_embeddings=8192)
BLOCK = 16


@dataclass(frozen=True, slots=True)
class Case:
    prompt: int
    chunk: int
    logprobs: bool
    seconds: float
    peak_mib: float
    # chunk x vocab float32: one copy of the prompt rows' logits.
    logits_mib: float


def _prefill_calls(
    prompt: list[int], chunk: int, logprobs: bool, batch_id: int
) -> list[pb.PrefillRequest]:
    """The Prefill requests the router sends for `prompt` in chunks of `chunk` tokens."""
    blocks = list(range(1, 1 + math.ceil((len(prompt) + 1) / BLOCK)))
    calls = []
    for start in range(0, len(prompt), chunk):
        end = min(start + chunk, len(prompt))
        request = pb.Request(
            id=1, input_ids=prompt, blocks=blocks, prefill_logprobs=logprobs,
            cache_len=start, chunk_len=end - start if end < len(prompt) else 0,
            stopping_parameters=pb.StoppingCriteriaParameters(max_new_tokens=1),
        )  # fmt: skip
        calls.append(pb.PrefillRequest(batch=pb.Batch(id=batch_id, requests=[request], size=1)))
    return calls


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_case(model: Path, prompt_len: int, chunk: int, logprobs: bool, repeats: int) -> Case:
    """In this process: load, warm up small, then the prompt's prefill `repeats` times."""
    from pytgi_shard.service.startup import load_engine
    from pytgi_shard.settings import ShardSettings

    engine = load_engine(ShardSettings(model_path=model, block_size=BLOCK))
    engine.warmup(pb.WarmupRequest(max_prefill_tokens=16,
                                   max_batch_total_tokens=prompt_len + 4 * BLOCK))
    prompt = [(7 * i) % 1000 + 3 for i in range(prompt_len)]
    before = _peak_mib()
    best = math.inf
    for rep in range(repeats):
        start = time.perf_counter()
        for call in _prefill_calls(prompt, chunk, logprobs, batch_id=rep + 1):
            response = engine.prefill(call)
        best = min(best, time.perf_counter() - start)
        engine.clear(response.batch.id)
    vocab = int(engine.model.vocab_size)
    return Case(prompt_len, chunk, logprobs, best, _peak_mib() - before, chunk * vocab * 4 / 2**20)


def _child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    case = run_case(Path(args.model), args.prompt, args.chunk, args.logprobs, args.repeats)
    print(json.dumps(asdict(case)))


def _spawn(model: Path, args: argparse.Namespace, chunk: int, logprobs: bool) -> Case:
    argv = [sys.executable, "-m", "pytgi_bench.experiments.prefill_logprobs", "--child",
            "--model", str(model), "--prompt", str(args.prompt), "--chunk", str(chunk),
            "--threads", str(args.threads), "--repeats", str(args.repeats)]
    if logprobs:
        argv.append("--logprobs")
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    return Case(**json.loads(out.stdout.strip().splitlines()[-1]))


def table(cases: list[Case]) -> str:
    lines = ["| prompt | chunk | prompt logprobs | prefill s | peak MiB over load | "
             "chunk x vocab f32 MiB |", "|---|---|---|---|---|---|"]
    for c in cases:
        lines.append(f"| {c.prompt} | {c.chunk} | {'on' if c.logprobs else 'off'} | "
                     f"{c.seconds:.3f} | {c.peak_mib:.0f} | {c.logits_mib:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=REPO / "build" / "bench-models")
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--chunks", default="2048,512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
    p.add_argument("--logprobs", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(args)
        return
    model = build_random_llama(args.root / SHAPE.name, SHAPE, DEMO_MODEL)
    cases = [_spawn(model, args, int(chunk), logprobs)
             for chunk in args.chunks.split(",") for logprobs in (False, True)]
    print(" ".join(["python -m pytgi_bench.experiments.prefill_logprobs", *(argv or sys.argv[1:])]))
    print(table(cases))


if __name__ == "__main__":
    main()
