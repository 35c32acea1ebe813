"""/info's `quantize` (a pytgi field: TGI's launcher only logs it): what the shards' Info says
their linear weights run as, null for float weights."""

from __future__ import annotations

from pytgi_proto import generate_pb2
from pytgi_router.core.capacity import derive_info
from pytgi_router.core.infer_settings import InferSettings

WARMUP = generate_pb2.WarmupResponse(
    max_supported_total_tokens=1024, max_input_tokens=255, max_total_tokens=256, num_blocks=65,
    block_size=16,
)


def info(quantize: str) -> generate_pb2.InfoResponse:
    return generate_pb2.InfoResponse(
        dtype="bfloat16", device_type="cuda", attention_impl="triton", block_size=16,
        model_type="llama", world_size=2, quantize=quantize,
    )


def test_the_shards_quantization_reaches_the_router() -> None:
    settings = InferSettings(max_batch_prefill_tokens=512)
    assert derive_info(settings, info("gptq"), WARMUP, 2).quantize == "gptq"
    assert derive_info(settings, info(""), WARMUP, 2).quantize == ""
