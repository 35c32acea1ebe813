"""Issue 17: which quantization a checkpoint declares (config.json and the side files of older
exporters), how --quantize reconciles with it, and which model families and builds can serve it;
every refusal is one line naming what is refused."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from pytgi_shard.models.quantized_families import check_model_family
from pytgi_shard.quantization.dense_loader import DenseLoader
from pytgi_shard.quantization.detection import detect_quantization, spec_from_description
from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.kernel_table import linear_format
from pytgi_shard.quantization.linear_format import DENSE
from pytgi_shard.quantization.method import parse_quantize, served_method
from pytgi_shard.quantization.resolution import reconcile, resolve_quantization
from pytgi_shard.quantization.spec import QuantizationSpec
from tests.unit.shard.quantized_double import RowInt8

SOURCE = "config.json `quantization_config`"
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True}
FP8_CHANNEL = {
    "quant_method": "compressed-tensors", "format": "float-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                    "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "dynamic": True},
    }},
    "ignore": ["lm_head"], "kv_cache_scheme": None, "quantization_status": "compressed",
}  # fmt: skip


def ct(weights: dict[str, Any], activations: dict[str, Any] | None = None,
       **top: Any) -> dict[str, Any]:
    """A compressed-tensors description with one group."""
    group: dict[str, Any] = {"targets": ["Linear"], "weights": weights}
    if activations is not None:
        group["input_activations"] = activations
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": group}, **top}


FLOAT8 = {"num_bits": 8, "type": "float", "strategy": "tensor"}
STATIC8 = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}

# description -> the spec's distinguishing fields
DETECTED: list[tuple[dict[str, Any], dict[str, Any]]] = [
    (GPTQ, {"method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True,
            "checkpoint_format": "gptq"}),
    ({"quant_method": "gptq", "bits": 8, "group_size": -1, "desc_act": True, "sym": False,
      "checkpoint_format": "gptq_v2"},
     {"bits": 8, "group_size": None, "desc_act": True, "sym": False,
      "checkpoint_format": "gptq_v2"}),
    ({"quant_method": "gptq", "bits": 4, "format": "gptq_v2"}, {"checkpoint_format": "gptq_v2",
                                                               "group_size": 128}),
    ({"quant_method": "awq", "bits": 4, "group_size": 64, "zero_point": True,
      "version": "GEMM"},
     {"method": "awq", "group_size": 64, "zero_point": True, "checkpoint_format": "gemm"}),
    ({"quant_method": "fp8", "activation_scheme": "static"},
     {"method": "fp8", "weight_strategy": "tensor", "activation_scheme": "static",
      "checkpoint_format": "fp8"}),
    ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
     {"method": "fp8", "weight_strategy": "channel", "checkpoint_format": "fbgemm_fp8"}),
    (FP8_CHANNEL, {"method": "fp8", "weight_strategy": "channel", "activation_scheme": "dynamic",
                   "checkpoint_format": "compressed-tensors", "not_converted": ("lm_head",)}),
    (ct(FLOAT8, STATIC8), {"weight_strategy": "tensor", "activation_scheme": "static"}),
    (ct(FLOAT8), {"weight_strategy": "tensor", "activation_scheme": ""}),  # weight-only
]  # fmt: skip

# description -> a piece of its one-line refusal
REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"quant_method": "gptq", "bits": 3}, "gptq 3-bit .* not supported: pytgi serves 4- and 8-bit"),
    ({"quant_method": "gptq", "bits": 2}, "gptq 2-bit"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"},
     "checkpoint_format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "is_marlin_format": True}, "Marlin's repacked layout"),
    ({"quant_method": "gptq", "bits": 4, "lm_head": True}, "quantized lm_head"),
    ({"quant_method": "gptq", "bits": "4"}, "`bits` must be an integer, got '4'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0}, "group_size must be -1 or positive"),
    ({"quant_method": "gptq"}, "has no `bits`"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq version 'gemv'"),
    ({"quant_method": "awq", "bits": 8}, "awq 8-bit"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128]}, "block-wise weight scales"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "fp8 in format e5m2"),
    (ct({"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128},
        format="pack-quantized"), "compressed-tensors format 'pack-quantized'"),
    (ct({"num_bits": 8, "type": "int", "strategy": "channel"},
        {"num_bits": 8, "type": "int", "dynamic": True}), "compressed-tensors int 8-bit weights"),
    (ct({"num_bits": 8, "type": "float", "strategy": "block"}), "FP8 weights with block scales"),
    (ct(FLOAT8, sparsity_config={"format": "sparse-24-bitmask"}), "sparsity 'sparse-24-bitmask'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True},
     "pre-quantized bitsandbytes .* --quantize bitsandbytes"),
    ({"load_in_8bit": True}, "pre-quantized bitsandbytes"),
    ({"quant_method": "hqq"}, "hqq checkpoints .* are not supported: pytgi serves gptq, awq, fp8"),
    ({"quant_method": "exl2"}, "exl2 checkpoints"),
    ({"bits": 4}, "unknown method checkpoints"),
]  # fmt: skip


@pytest.mark.parametrize(("description", "expected"), DETECTED)
def test_a_declared_quantization_becomes_a_spec(
    tmp_path: Path, description: dict[str, Any], expected: dict[str, Any]
) -> None:
    spec = detect_quantization(tmp_path, {"model_type": "llama", "quantization_config": description})
    assert spec is not None and spec.pre_quantized and spec.source == SOURCE
    for name, value in expected.items():
        assert getattr(spec, name) == value, name


@pytest.mark.parametrize(("description", "refusal"), REFUSED)
def test_what_pytgi_cannot_serve_is_refused_in_one_line(
    description: dict[str, Any], refusal: str
) -> None:
    with pytest.raises(QuantizationError, match=refusal) as caught:
        spec_from_description(description, SOURCE)
    assert "\n" not in str(caught.value)


def test_where_a_quantization_is_declared(tmp_path: Path) -> None:
    assert detect_quantization(tmp_path, {"model_type": "llama"}) is None
    # Early compressed-tensors exports: compression_config, config groups nested.
    early = {"compression_config": {"quantization_config": FP8_CHANNEL}}
    spec = detect_quantization(tmp_path, early)
    assert spec is not None and spec.method == "fp8"
    assert spec.source == "config.json `compression_config`"
    # AutoGPTQ's and AutoAWQ's side files.
    (tmp_path / "quantize_config.json").write_text(json.dumps(
        {"bits": 4, "group_size": 32, "desc_act": True, "sym": False}))
    spec = detect_quantization(tmp_path, {"model_type": "llama"})
    assert spec == QuantizationSpec("gptq", True, "quantize_config.json", bits=4, group_size=32,
                                    desc_act=True, sym=False, checkpoint_format="gptq")
    (tmp_path / "quantize_config.json").unlink()
    (tmp_path / "quant_config.json").write_text(json.dumps(
        {"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"}))
    spec = detect_quantization(tmp_path, {"model_type": "llama"})
    assert spec is not None and (spec.method, spec.group_size) == ("awq", 128)
    # config.json wins over a side file.
    assert detect_quantization(tmp_path, {"quantization_config": GPTQ}).method == "gptq"  # type: ignore[union-attr]


def test_describe() -> None:
    spec = spec_from_description({**GPTQ, "desc_act": True}, SOURCE)
    assert spec.describe() == (
        "gptq 4-bit, group size 128, act-order, symmetric, format gptq (pre-quantized, declared "
        "by config.json `quantization_config`)"
    )


# --- --quantize ---------------------------------------------------------------------------------


def test_parse_quantize() -> None:
    for value in ("awq", "compressed-tensors", "eetq", "gptq", "marlin", "bitsandbytes",
                  "bitsandbytes-nf4", "bitsandbytes-fp4", "fp8"):
        assert parse_quantize(value) == value
    assert parse_quantize("GPTQ") == "gptq"
    with pytest.raises(argparse.ArgumentTypeError, match="unknown quantization 'int3'; valid "
                       "values: awq, compressed-tensors, eetq, gptq, marlin, bitsandbytes"):
        parse_quantize("int3")
    with pytest.raises(argparse.ArgumentTypeError, match="exl2 .* is not supported by pytgi"):
        parse_quantize("exl2")
    assert served_method("marlin") == "gptq"


def _spec(description: dict[str, Any]) -> QuantizationSpec:
    return spec_from_description(description, SOURCE)


def test_a_flag_confirms_the_checkpoint_or_contradicts_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    gptq = _spec(GPTQ)
    assert reconcile(None, gptq, tmp_path) is gptq
    assert reconcile("gptq", gptq, tmp_path) == QuantizationSpec(
        **{**gptq.__dict__, "requested": "gptq"})
    with caplog.at_level(logging.INFO):
        marlin = resolve_quantization(tmp_path, {"quantization_config": GPTQ}, "marlin")
    assert marlin is not None and (marlin.method, marlin.requested) == ("gptq", "marlin")
    assert "no Marlin kernel; the GPTQ checkpoint runs on pytgi's GPTQ kernels" in caplog.text
    fp8 = _spec(FP8_CHANNEL)
    for flag in ("fp8", "compressed-tensors"):
        assert reconcile(flag, fp8, tmp_path) is not None
    with pytest.raises(QuantizationError, match=r"^--quantize eetq contradicts the checkpoint at "
                       r".*, which is gptq \(declared by config.json `quantization_config`\)"):
        reconcile("eetq", gptq, tmp_path)
    with pytest.raises(QuantizationError, match="--quantize compressed-tensors contradicts"):
        reconcile("compressed-tensors", _spec({"quant_method": "fp8"}), tmp_path)
    with pytest.raises(QuantizationError, match="--quantize awq contradicts"):
        reconcile("awq", fp8, tmp_path)


def test_a_flag_on_a_float_checkpoint_quantizes_on_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for flag in ("bitsandbytes", "bitsandbytes-nf4", "bitsandbytes-fp4", "eetq", "fp8"):
        spec = reconcile(flag, None, tmp_path)
        assert spec == QuantizationSpec(flag, False, "--quantize", requested=flag)
    for flag in ("gptq", "awq", "marlin", "compressed-tensors"):
        with pytest.raises(QuantizationError, match=f"--quantize {flag} needs a .* checkpoint, "
                           "but .* declares no quantization"):
            reconcile(flag, None, tmp_path)
    with caplog.at_level(logging.WARNING):
        resolve_quantization(tmp_path, {}, "bitsandbytes")
    assert "eetq is int8 weight-only too, and faster" in caplog.text


# --- families and kernels -----------------------------------------------------------------------


def test_model_families() -> None:
    own = ["llama", "phi3", "gpt2", "falcon", "mixtral", "opt"]
    gptq, eetq = _spec(GPTQ), QuantizationSpec("eetq", False, "--quantize")
    for model_type in ("llama", "opt"):
        check_model_family(model_type, gptq, own)
    for model_type in own:  # quantize-on-load: any of pytgi's own families
        check_model_family(model_type, eetq, own)
    for model_type in ("phi3", "gpt2", "falcon", "mixtral"):
        with pytest.raises(QuantizationError, match=f"^gptq checkpoints of {model_type} are not "
                           "supported: its linear layers are stored fused"):
            check_model_family(model_type, gptq, own)
    with pytest.raises(QuantizationError, match="gptj runs through the transformers fallback, "
                       r"which pytgi does not quantize \(eetq\)"):
        check_model_family("gptj", eetq, own)
    check_model_family("gptj", None, own)


def test_the_kernel_table() -> None:
    assert linear_format(None) is DENSE
    eetq = QuantizationSpec("eetq", False, "--quantize")
    with pytest.raises(QuantizationError, match=r"--quantize eetq \(on load\) cannot be served: "
                       r"this build has no kernel for it \(available: none\)"):
        linear_format(eetq, on_load={})
    with pytest.raises(QuantizationError, match="gptq checkpoints cannot be served"):
        linear_format(_spec(GPTQ), pre_quantized={"awq": lambda s: DenseLoader()})
    on_load = linear_format(eetq, on_load={"eetq": RowInt8.from_float})
    assert on_load.name == "eetq" and on_load.from_float == RowInt8.from_float
    loader = DenseLoader()
    read = linear_format(_spec(GPTQ), pre_quantized={"gptq": lambda s: loader})
    assert read.name == "gptq" and read.loader is loader


def test_the_flag_and_its_environment_form(capsys: pytest.CaptureFixture[str]) -> None:
    from pytgi_launcher.cli import parse_settings
    from pytgi_launcher.commands import shard_argv
    from pytgi_shard.service.cli import build_parser, settings_from_args

    def shard(argv: list[str], env: dict[str, str]) -> str | None:
        args = build_parser().parse_args(["serve", "/m", *argv])
        return settings_from_args(args, env).quantize

    assert shard([], {}) is None
    assert shard([], {"QUANTIZE": "AWQ"}) == "awq"
    assert shard(["--quantize", "eetq"], {"QUANTIZE": "awq"}) == "eetq"  # the flag wins
    with pytest.raises(ValueError, match="QUANTIZE: unknown quantization 'int3'"):
        shard([], {"QUANTIZE": "int3"})
    launcher = parse_settings([], environ={"QUANTIZE": "bitsandbytes-nf4"})
    assert launcher.quantize == "bitsandbytes-nf4"
    argv = shard_argv(launcher, Path("/m"), 0, 1, "float32")
    assert argv[argv.index("--quantize") + 1] == "bitsandbytes-nf4"
    assert "--quantize" not in shard_argv(parse_settings([], environ={}), Path("/m"), 0, 1,
                                          "float32")
    with pytest.raises(SystemExit):
        parse_settings(["--quantize", "int3"], environ={})
    assert "unknown quantization 'int3'; valid values:" in capsys.readouterr().err
