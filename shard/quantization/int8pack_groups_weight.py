"""8-bit group-quantized weights (GPTQ's 8-bit) on CPU through PyTorch's int8 weight-only matmul,
`_weight_int8pack_mm`, once per group of inputs.

That op multiplies by int8 weights with one scale per output row; a GPTQ weight has one per
group and output, plus zero points. With w = q - 128 (int8) and groups g of the inputs:

    y = sum_g s_g * (x_g @ w_g^T) + (sum of x over g) @ (s_g * (128 - z_g))

the first term one op call per group (scale s_g per output row), the second one small matmul.
Like int4pack it computes in bfloat16 (COMPUTE_DTYPE): its float32 path is as slow a fallback
(4096 x 4096, one thread: 24.7 ms in float32, 0.9 ms in bfloat16 for a single call). Taken for
equal groups (sorted, or act-order permuted once at load); a row shard of an act-order weight,
whose groups are uneven, is dequantized per call instead.
"""

from __future__ import annotations

import torch

from pytgi_shard.quantization.group_quantized import GroupQuantized
from pytgi_shard.quantization.int4pack_weight import COMPUTE_DTYPE
from pytgi_shard.quantization.linear_weight import QuantizedWeight


def even_groups(g_idx: torch.Tensor) -> tuple[torch.Tensor | None, int] | None:
    """(the order that sorts inputs by group, None when they are sorted; the group size) when
    every group holds as many inputs, else None."""
    sorted_groups, order = torch.sort(g_idx.long(), stable=True)
    _, counts = torch.unique_consecutive(sorted_groups, return_counts=True)
    if bool((counts != counts[0]).any()):
        return None
    identity = torch.equal(order, torch.arange(g_idx.numel(), device=g_idx.device))
    return (None if identity else order), int(counts[0])


class Int8PackGroupsWeight(QuantizedWeight):
    """Per group: int8 weights [groups, out, group_size] and bfloat16 scales [groups, out]; the
    zero points folded into offsets [groups, out] (float32) applied to the groups' input sums."""

    w8: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor
    order: torch.Tensor | None

    def __init__(self, weight: GroupQuantized, compute_dtype: torch.dtype = COMPUTE_DTYPE) -> None:
        super().__init__()
        grouping = even_groups(weight.g_idx)
        if weight.bits != 8 or grouping is None:
            raise ValueError("int8 groups take 8-bit weights whose groups are equal in size")
        order, self.group_size = grouping
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        q = weight.int_weight()  # [in, out]
        g = weight.g_idx.long()
        if order is not None:
            q, g = q[order], g[order]
        groups = g[:: self.group_size]
        w8 = (q - 128).to(torch.int8).reshape(groups.numel(), self.group_size, -1)
        self.register_buffer("w8", w8.transpose(1, 2).contiguous())
        scales = weight.scales[groups].float()
        self.register_buffer("scales", scales.to(compute_dtype))
        self.register_buffer("offsets", scales * (128 - weight.zeros[groups].float()))
        self.register_buffer("order", None if order is None else order.to(torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, self.in_features)
        if self.order is not None:
            x2d = x2d.index_select(-1, self.order)
        grouped = x2d.reshape(x2d.shape[0], -1, self.group_size)
        out = grouped.float().sum(-1) @ self.offsets
        low = grouped.to(self.scales.dtype)
        for g in range(self.w8.shape[0]):
            part = torch.ops.aten._weight_int8pack_mm(
                low[:, g].contiguous(), self.w8[g], self.scales[g]
            )
            out += part.float()
        return out.to(x.dtype).reshape(*x.shape[:-1], -1)

    def dequantize(self) -> torch.Tensor:
        """The weight as the kernel forms it: scale * w + scale * (128 - zero), in float32."""
        w = self.w8.float()  # [groups, out, size]
        per_group = self.scales.float()[..., None] * w + self.offsets[..., None]
        dense = per_group.permute(1, 0, 2).reshape(self.out_features, self.in_features)
        if self.order is None:
            return dense
        unpermuted = torch.empty_like(dense)
        unpermuted[:, self.order.long()] = dense
        return unpermuted
