"""GPTQ (v1 and v2, act-order or not, symmetric or not, 4 and 8 bits) and AWQ GEMM layers written
as real safetensors from known integers read back exactly: each rank's dequantized weight equals
the slice of the float64 oracle bit for bit (float32 model), through every kernel that takes it,
and the matmuls agree to float tolerance; on 1 and 2 ranks (fused q|k|v column slices with KV
parts, row slices), and once over gloo where the row shards' partial products are summed."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import save_file

from pytgi_shard.device.distributed import Dist, init_distributed, single_process
from pytgi_shard.quantization.awq import AWQLoader
from pytgi_shard.quantization.errors import QuantizationError
from pytgi_shard.quantization.gptq import GPTQLoader
from pytgi_shard.quantization.group_quantized import GroupQuantized
from pytgi_shard.quantization.int4pack_layout import int4pack_layout
from pytgi_shard.quantization.int4pack_weight import Int4PackWeight, int4pack_fits
from pytgi_shard.quantization.int8pack_groups_weight import Int8PackGroupsWeight, even_groups
from pytgi_shard.quantization.int_kernel_choice import IntKernel, build_int_weight
from pytgi_shard.quantization.linear_weight import QuantizedWeight
from pytgi_shard.weights.reader import Weights
from tests.int_quantized_checkpoints import IntLayer, awq_tensors, gptq_tensors, random_layer

CPU = torch.device("cpu")
IN, GROUP = 128, 32
# Output features of the fused projections and of the row-parallel one.
Q_OUT, KV_OUT, O_OUT = 64, 32, 32
PREFIXES = ["q", "k", "v"]


def write_layers(path: Path, method: str, fmt: str, bits: int, act_order: bool, sym: bool,
                 with_g_idx: bool = True) -> dict[str, IntLayer]:  # fmt: skip
    zero_min = 1 if fmt == "gptq" else 0  # v1 stores zero - 1: a zero of 0 is not storable
    sizes = {"q": Q_OUT, "k": KV_OUT, "v": KV_OUT}
    layers = {
        name: random_layer(IN, out, bits, GROUP, act_order, sym, seed, zero_min)
        for seed, (name, out) in enumerate(sizes.items())
    }
    if act_order:  # q, k and v read one input: GPTQ orders them alike
        layers = {n: IntLayer(lay.q, lay.zeros, lay.scales, layers["q"].g_idx, bits)
                  for n, lay in layers.items()}  # fmt: skip
    layers["o"] = random_layer(IN, O_OUT, bits, GROUP, act_order, sym, 9, zero_min)
    tensors: dict[str, torch.Tensor] = {}
    for name, layer in layers.items():
        if method == "awq":
            tensors |= awq_tensors(layer, name)
        else:
            tensors |= gptq_tensors(layer, name, fmt, with_g_idx)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return layers


def loader_for(
    method: str, fmt: str, bits: int, kernel: IntKernel | None
) -> GPTQLoader | AWQLoader:
    if method == "awq":
        return AWQLoader(bits, GROUP, kernel=kernel)
    return GPTQLoader(bits, GROUP, desc_act=False, checkpoint_format=fmt, kernel=kernel)


def expected_column(layers: dict[str, IntLayer], rank: int, world: int) -> torch.Tensor:
    """q split over ranks, k and v by KV part (2 KV heads: one per rank), fused."""
    return torch.cat([
        layers[n].dequantized().chunk(world, dim=0)[rank] for n in PREFIXES
    ])  # fmt: skip


def expected_row(layers: dict[str, IntLayer], rank: int, world: int) -> torch.Tensor:
    return layers["o"].dequantized().chunk(world, dim=1)[rank]


def check(weight: object, expected: torch.Tensor) -> None:
    """The kernel's weight is exactly the dequantized one, and so is its matmul up to float32
    summation order; PyTorch's int4/int8 ops compute in bfloat16 as served, so there only to
    bfloat16's precision."""
    assert isinstance(weight, QuantizedWeight)
    assert (weight.out_features, weight.in_features) == tuple(expected.shape)
    x = torch.randn(3, 5, expected.shape[1], generator=torch.Generator().manual_seed(0))
    bf16 = (
        isinstance(weight, Int4PackWeight)
        and weight.scales_and_zeros.dtype == torch.bfloat16
        or isinstance(weight, Int8PackGroupsWeight)
        and weight.scales.dtype == torch.bfloat16
    )
    if not bf16:
        assert torch.equal(weight.dequantize().float(), expected)
        torch.testing.assert_close(weight(x), x @ expected.t(), rtol=1e-5, atol=1e-5)
        return
    # Scales, offsets and the result each rounded to bfloat16 (2**-9).
    bound = 2**-7 * float(expected.abs().max())
    torch.testing.assert_close(weight.dequantize().float(), expected, rtol=0, atol=bound)
    reference = x.bfloat16().float() @ weight.dequantize().float().t()
    size = float(reference.abs().max())
    torch.testing.assert_close(weight(x), reference, rtol=1e-2, atol=1e-2 * size)


def kernels_of(quantized: GroupQuantized) -> list[QuantizedWeight]:
    """Every kernel that takes the weight (the int4/int8 ops also in exact float32 mode), and
    the one the loader chooses."""
    built = [build_int_weight(quantized, CPU, torch.float32, k) for k in
             (None, IntKernel.DEQUANT, IntKernel.TRITON)]  # fmt: skip
    layout = int4pack_layout(quantized.g_idx)
    if int4pack_fits(CPU, torch.float32, quantized.out_features, layout, quantized.bits):
        built += [
            Int4PackWeight(quantized, layout, torch.float32),
            Int4PackWeight(quantized, layout),
        ]
    if quantized.bits == 8 and even_groups(quantized.g_idx) is not None:
        built += [Int8PackGroupsWeight(quantized, torch.float32), Int8PackGroupsWeight(quantized)]
    return built


GPTQ_CASES = [
    (fmt, bits, act_order, sym)
    for fmt in ("gptq", "gptq_v2") for bits in (4, 8)
    for act_order in (False, True) for sym in (True, False)
]  # fmt: skip
CASES = [("gptq", *case) for case in GPTQ_CASES] + [
    ("awq", "gemm", 4, False, False), ("awq", "gemm", 4, False, True)
]  # fmt: skip


@pytest.mark.parametrize(("method", "fmt", "bits", "act_order", "sym"), CASES)
def test_layers_read_back_exactly_on_one_and_two_ranks(
    tmp_path: Path, method: str, fmt: str, bits: int, act_order: bool, sym: bool
) -> None:
    layers = write_layers(tmp_path, method, fmt, bits, act_order, sym)
    for world in (1, 2):
        for rank in range(world):
            dist = Dist(rank=rank, world_size=world, device=CPU, group=None)
            weights = Weights(tmp_path, torch.float32, dist)
            loader = loader_for(method, fmt, bits, None)
            column = loader.read_column(weights, PREFIXES, [(rank, world)] * 3)
            row = loader.read_row(weights, "o")
            assert torch.equal(column.dequantize(), expected_column(layers, rank, world))
            assert torch.equal(row.dequantize(), expected_row(layers, rank, world))
            for weight in kernels_of(column):
                check(weight, expected_column(layers, rank, world))
            for weight in kernels_of(row):
                check(weight, expected_row(layers, rank, world))
            # column() / row() are read_* handed to the chosen kernel.
            check(loader.column(weights, PREFIXES, [(rank, world)] * 3),
                  expected_column(layers, rank, world))  # fmt: skip
            check(loader.row(weights, "o"), expected_row(layers, rank, world))


def test_the_chosen_cpu_kernel_is_int4pack_where_it_fits(tmp_path: Path) -> None:
    layers = write_layers(tmp_path, "gptq", "gptq", 4, act_order=True, sym=False)
    weights = Weights(tmp_path, torch.float32, single_process(CPU))
    column = GPTQLoader(4, GROUP, desc_act=True).column(weights, PREFIXES, [(0, 1)] * 3)
    assert isinstance(column, Int4PackWeight) and column.perm is not None  # act-order: permuted
    out = Q_OUT + 2 * KV_OUT
    # 4 bits a weight, a bfloat16 (scale, offset) per group and output, the int32 permutation.
    assert column.nbytes() == IN * out // 2 + (IN // GROUP) * out * 2 * 2 + IN * 4
    check(column, expected_column(layers, 0, 1))


def test_gptq_without_g_idx_groups_consecutive_inputs(tmp_path: Path) -> None:
    layers = write_layers(tmp_path, "gptq", "gptq", 4, act_order=False, sym=True, with_g_idx=False)
    weights = Weights(tmp_path, torch.float32, single_process(CPU))
    check(GPTQLoader(4, GROUP).row(weights, "o"), expected_row(layers, 0, 1))
    with pytest.raises(QuantizationError, match="act-order .* stores no g_idx"):
        GPTQLoader(4, GROUP, desc_act=True).row(weights, "o")


def test_a_row_split_that_cuts_a_group_names_the_shard_counts_that_work(tmp_path: Path) -> None:
    write_layers(tmp_path, "gptq", "gptq_v2", 4, act_order=False, sym=True)
    rank0 = Dist(rank=0, world_size=8, device=CPU, group=None)  # 16 inputs a rank, groups of 32
    with pytest.raises(QuantizationError, match=r"--num-shard 8 .* --num-shard 1, 2, 4 work"):
        GPTQLoader(4, GROUP, checkpoint_format="gptq_v2").row(
            Weights(tmp_path, torch.float32, rank0), "o"
        )


def test_act_order_rows_split_anywhere_on_whole_words(tmp_path: Path) -> None:
    layers = write_layers(tmp_path, "gptq", "gptq", 4, act_order=True, sym=False)
    for rank in range(8):  # 16 inputs a rank: every group cut, each rank keeps all scales
        weights = Weights(tmp_path, torch.float32, Dist(rank, 8, CPU, None))
        check(GPTQLoader(4, GROUP, desc_act=True).row(weights, "o"), expected_row(layers, rank, 8))


def test_a_column_split_that_cuts_packed_zeros_is_refused(tmp_path: Path) -> None:
    write_layers(tmp_path, "awq", "gemm", 4, act_order=False, sym=False)
    weights = Weights(tmp_path, torch.float32, single_process(CPU))
    with pytest.raises(QuantizationError, match="cut its packed words of 8 outputs"):
        AWQLoader(4, GROUP).column(weights, ["k"], [(0, 8)])  # 4 of 32 outputs


def test_fused_projections_must_share_their_grouping(tmp_path: Path) -> None:
    layers = {
        n: random_layer(IN, 32, 4, GROUP, True, False, seed, 1) for seed, n in enumerate("qk")
    }
    save_file(gptq_tensors(layers["q"], "q", "gptq") | gptq_tensors(layers["k"], "k", "gptq"),
              str(tmp_path / "model.safetensors"))  # fmt: skip
    weights = Weights(tmp_path, torch.float32, single_process(CPU))
    with pytest.raises(ValueError, match="k groups its input features"):
        GPTQLoader(4, GROUP, desc_act=True).column(weights, ["q", "k"], [(0, 1), (0, 1)])


def test_unquantized_projections_load_dense_and_mixed_fusions_are_refused(tmp_path: Path) -> None:
    layer = random_layer(IN, 32, 4, GROUP, False, True, 0)
    dense = torch.randn(32, IN)
    save_file(gptq_tensors(layer, "q", "gptq") | {"head.weight": dense},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    weights = Weights(tmp_path, torch.float32, single_process(CPU))
    assert torch.equal(GPTQLoader(4, GROUP).column(weights, ["head"], [(0, 1)]), dense)
    with pytest.raises(QuantizationError, match="only some are quantized"):
        GPTQLoader(4, GROUP).column(weights, ["q", "head"], [(0, 1), (0, 1)])


def test_unsupported_settings_are_refused_in_one_line() -> None:
    for make, match in [
        (lambda: GPTQLoader(3, 128), "GPTQ with 3 bits is not supported"),
        (lambda: GPTQLoader(4, 128, checkpoint_format="marlin"), "checkpoint_format 'marlin'"),
        (lambda: AWQLoader(4, 128, version="gemv"), "AWQ version 'gemv'"),
        (lambda: AWQLoader(4, 128, zero_point=False), "zero_point false"),
        (lambda: AWQLoader(8, 128), "AWQ with 8 bits"),
    ]:
        with pytest.raises(QuantizationError, match=match) as info:
            make()
        assert "\n" not in str(info.value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, port: int, path: Path, out_dir: Path) -> None:
    torch.set_num_threads(1)
    dist = init_distributed(rank, 2, "127.0.0.1", port, CPU)
    try:
        weights = Weights(path, torch.float32, dist)
        x = torch.randn(4, IN, generator=torch.Generator().manual_seed(1))
        out = {}
        for method, loader in [("gptq", GPTQLoader(4, GROUP, desc_act=True)),
                               ("awq", AWQLoader(4, GROUP))]:  # fmt: skip
            prefix = "o" if method == "gptq" else "awq_o"
            row = loader.row(weights, prefix)
            local = x.chunk(2, dim=-1)[rank]
            out[method] = dist.all_reduce(row(local))
        torch.save(out, out_dir / f"rank{rank}.pt")
    finally:
        dist.close()


def test_row_shards_sum_to_the_whole_matmul_over_gloo(tmp_path: Path) -> None:
    """Two processes, each reading only its inputs' slice, summed by all_reduce; both through
    the chosen int4pack (act-order GPTQ rows hit groups unevenly: padded), in bfloat16."""
    gptq = random_layer(IN, O_OUT, 4, GROUP, True, False, 3, 1)
    awq = random_layer(IN, O_OUT, 4, GROUP, False, False, 4)
    save_file(gptq_tensors(gptq, "o", "gptq") | awq_tensors(awq, "awq_o"),
              str(tmp_path / "model.safetensors"))  # fmt: skip
    mp.spawn(_rank_main, args=(_free_port(), tmp_path, tmp_path), nprocs=2, join=True)
    x = torch.randn(4, IN, generator=torch.Generator().manual_seed(1))
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["gptq"], x @ gptq.dequantized().t(), rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got["awq"], x @ awq.dequantized().t(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models_round_each_weight_once(tmp_path: Path, dtype: torch.dtype) -> None:
    """Scales are kept as stored (float16): scale * (q - zero) is formed exactly and rounded
    once to the model dtype, as a float copy of the checkpoint in that dtype holds it."""
    layers = write_layers(tmp_path, "gptq", "gptq_v2", 4, act_order=True, sym=False)
    weights = Weights(tmp_path, dtype, single_process(CPU))
    expected = layers["o"].dequantized().to(dtype)
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(0)).to(dtype)
    for kernel in (IntKernel.DEQUANT, IntKernel.INT4PACK):
        row = GPTQLoader(4, GROUP, checkpoint_format="gptq_v2", kernel=kernel).row(weights, "o")
        assert isinstance(row, QuantizedWeight)
        if kernel is IntKernel.DEQUANT:
            assert torch.equal(row.dequantize(), expected)
        # int4pack forms (q - 8) * scale + scale * (8 - zero) in bfloat16: close, and its
        # products accumulate in float32.
        torch.testing.assert_close(row.dequantize().float(), expected.float(), rtol=1e-2, atol=1e-3)
        reference = (x.float() @ expected.float().t()).to(dtype)
        assert row(x).dtype == dtype
        torch.testing.assert_close(row(x), reference, rtol=2e-2, atol=2e-2)
