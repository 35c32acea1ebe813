"""pytgi's benchmarks, in three parts that differ in who runs them and whether they ship.

- this package's top level: the `pytgi-benchmark` load tool users run (`run` against any
  TGI/OpenAI endpoint, `shards` against the gRPC shards) and `requirements_check`; the only part
  in the wheel.
- `compare/`: the comparisons this repository tracks (`make bench`, `bench/gpu.sh`): pytgi side
  by side with transformers, the engine's step timing, the models they build, gpu.sh's summary.
- `experiments/`: one-off measurements behind a design decision (kernels, grammar, MoE,
  quantization, KV scheduling...), each cited by the README or the code it decided.

`compare` and `experiments` are repository-only: pyproject's `packages` leaves them out, and
the editable install (`make install`, `pip install -e .`) still imports them from the source
tree. Imports go one way: experiments -> compare -> the load tool, never back.
"""
