"""Compiles the paged-KV Triton kernels (cache write, split-K decode, varlen prefill) to cubin for
CUDA targets without a GPU, for each cache format (FP8 0: the model's dtype, 1: fp8_e4m3fn,
2: fp8_e5m2): what the interpreter cannot show, that the kernels lower and assemble for the
architectures and the Triton release at hand.

    python -m pytgi_bench.experiments.kv_kernels_compile [--arch 80 --arch 90]

Run it with another Triton release first on PYTHONPATH (an unpacked wheel) to check that one too:
the FP8 paths were compiled so for sm_80 and sm_90 under Triton 3.6.0 and 3.9.0.
"""

from __future__ import annotations

import argparse
import time

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pytgi_shard.attention.triton_cache import _write_kv_kernel
from pytgi_shard.attention.triton_decode import _decode_split_kernel
from pytgi_shard.attention.triton_prefill import _prefill_kernel

# Pointer types by parameter name (bf16 activations, a uint8 cache for FP8, int32 tables).
POINTERS = {
    "slot_ptr": "*i64", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
    "block_tables_ptr": "*i32", "seqlens_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
    "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "alibi_ptr": "*fp32",
}
FLOATS = {"scale", "softcap"}
FLAGS: dict[str, object] = {"HAS_WINDOW": False, "HAS_SOFTCAP": False, "HAS_ALIBI": False, "PRECISION": "tf32"}
KERNELS: list[tuple[triton.runtime.JITFunction, dict[str, object]]] = [
    (_write_kv_kernel, {"BLOCK_H": 8, "BLOCK_D": 128}),
    (_decode_split_kernel, {"BLOCK_SIZE": 16, "GROUP": 4, "NUM_SPLITS": 4, "BLOCK_G": 16,
                            "BLOCK_N": 64, "BLOCK_D": 128, **FLAGS}),
    (_prefill_kernel, {"BLOCK_SIZE": 16, "GROUP": 4, "BLOCK_M": 64, "BLOCK_N": 64,
                       "BLOCK_D": 128, **FLAGS}),
]


def signature(fn: triton.runtime.JITFunction, fp8: int) -> dict[str, str]:
    """Each parameter's type: constexprs, pointers by name (the caches as bytes when FP8)."""
    cache = "*u8" if fp8 else "*bf16"
    out = {}
    for param in fn.params:
        name = param.name
        if param.is_constexpr:
            out[name] = "constexpr"
        elif name in ("key_cache_ptr", "value_cache_ptr"):
            out[name] = cache
        elif name.endswith("_ptr"):
            out[name] = POINTERS.get(name, "*bf16")
        else:
            out[name] = "fp32" if name in FLOATS else "i32"
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, action="append", help="compute capability (default 80, 90)")
    args = p.parse_args(argv)
    print(f"triton {triton.__version__}")
    for arch in args.arch or [80, 90]:
        for fn, constants in KERNELS:
            for fp8 in (0, 1, 2):
                consts = {**constants, "FP8": fp8}
                start = time.perf_counter()
                kernel = triton.compile(
                    ASTSource(fn=fn, signature=signature(fn, fp8), constexprs=consts),
                    target=GPUTarget("cuda", arch, 32),
                    options={"num_warps": 4, "num_stages": 2},
                )
                print(f"sm_{arch} {fn.__name__} FP8={fp8}: {len(kernel.asm['cubin'])} bytes of "
                      f"cubin, {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
