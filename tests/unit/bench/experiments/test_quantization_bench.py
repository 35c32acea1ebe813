"""pytgi_bench.experiments.quantization's plumbing on the tiny Llama (the numbers themselves come from
`python -m pytgi_bench.experiments.quantization`): modes loaded through --quantize, their weight bytes, the
kernel table's candidates, and the GPU summary's line."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from pytgi_bench.compare.gpu_summary import quantization_result
from pytgi_bench.compare.model_builder import LlamaShape
from pytgi_bench.experiments.on_load_kernels import layer_shapes, measure_kernels
from pytgi_bench.experiments.quantization import QUANT_20M, run_modes


def test_the_bench_model_has_about_20m_parameters_in_its_linears() -> None:
    per_layer = sum(o * i for o, i in layer_shapes(QUANT_20M))
    assert per_layer * QUANT_20M.num_hidden_layers == 18_874_368


def test_modes_are_loaded_quantized_and_measured(tiny_model: Callable[..., Path]) -> None:
    results = run_modes(tiny_model("llama"), ["float", "eetq", "nonsense"], "float32", [1, 2],
                        rounds=2, steps=2)  # fmt: skip
    by = {r.mode: r for r in results}
    assert "nonsense" in by["nonsense"].error
    for mode in ("float", "eetq"):
        assert not by[mode].error
        assert len(by[mode].rounds[2]) == 2 and by[mode].best(2) > 0
    # int8 values and a float32 scale per row against float32 weights.
    assert 3.5 < by["float"].linear_bytes / by["eetq"].linear_bytes < 4.0
    saved = by["float"].linear_bytes - by["eetq"].linear_bytes
    assert by["float"].weight_bytes - by["eetq"].weight_bytes == saved


def test_every_candidate_kernel_is_timed() -> None:
    tiny = LlamaShape("tiny", 64, 128, 1, 4, 2)
    times = measure_kernels(tiny, torch.device("cpu"), torch.float32, [1, 3], rounds=1, reps=2)
    names = {t.candidate for t in times}
    assert {"float", "eetq int_mm (W8A8)", "bnb int8 (LLM.int8)"} <= names
    assert len(times) == 2 * len(names) and all(t.us > 0 for t in times)
    assert all(t.speedup == 1.0 for t in times if t.candidate == "float")


def test_the_gpu_summary_line() -> None:
    report = {"modes": [
        {"mode": "float", "error": "", "best": {"1": 100.0, "64": 2000.0}},
        {"mode": "bitsandbytes", "error": "QuantizationError: needs bitsandbytes", "best": {}},
    ]}  # fmt: skip
    assert quantization_result(report) == "float b1 100, b64 2,000 tok/s; bitsandbytes not run"
    assert quantization_result(None) == "no quantization JSON"
