"""Qwen2-VL's and Qwen2.5-VL's vision tower: patches -> ViT blocks with 2-D rotary -> patch
merger -> one embedding per image token, in the language model's hidden size.

    x = patch_embed(pixel_values)              # conv3d with stride = kernel: a linear per patch
    for each block:  x = x + proj(attention(rope2d(q), rope2d(k), v))   on layer_norm(x)
                     x = x + fc2(act(fc1(x)))                           on layer_norm(x)
    tokens = mlp(layer_norm(x).view(-1, 4 * embed_dim))                 # merge 2 x 2 patches

Split over the tensor-parallel ranks as the decoder's (models/vision_sharding.py): each rank
holds its share of every block's heads (the fused qkv cut by heads, column-parallel; proj
row-parallel) and MLP features (fc1 / gate+up column-, fc2 / down row-parallel), and of the
merger's hidden features (mlp.0 column-, mlp.2 row-parallel): two all-reduces per block and one
for the merger; the output is whole on every rank. A head count the ranks do not divide
replicates the tower. The patch embedding and norms are small and replicated.

Attention is full (not causal) within one image; every image is encoded on its own (t == 1 for
images, so an image is one attention sequence), in float32 rotary arithmetic as trained.

Qwen2.5-VL (`windowed`) differs in three places: RMSNorms instead of LayerNorms, a gated
(SwiGLU) MLP with biases, and windowed attention: the merged patches are reordered window by
window (window_size pixels square), every block but `fullatt_block_indexes` attends within its
window only, and the merger's output is put back in the image's order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pytgi_shard.layers.fused_qkv import HeadShape, load_stacked_qkv
from pytgi_shard.layers.layernorm import LayerNorm, RMSNorm
from pytgi_shard.layers.linear import ColumnParallelLinear, RowParallelLinear
from pytgi_shard.layers.mlp import GatedMLP, PlainMLP
from pytgi_shard.models.vision_sharding import tower_weights
from pytgi_shard.weights.reader import Weights


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def patch_positions(grid: Sequence[int], merge: int, device: torch.device) -> torch.Tensor:
    """[t * h * w, 2] (row, column) of each patch, in the processor's order: merge x merge
    blocks, block-major (transformers' get_vision_position_ids)."""
    t, h, w = (int(v) for v in grid)
    rows = torch.arange(h, device=device).unsqueeze(1).expand(h, w)
    cols = torch.arange(w, device=device).unsqueeze(0).expand(h, w)
    shape = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(shape).transpose(1, 2).flatten()
    cols = cols.reshape(shape).transpose(1, 2).flatten()
    return torch.stack([rows, cols], dim=-1).repeat(t, 1)


class VisionAttention(nn.Module):
    def __init__(self, weights: Weights, prefix: str, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        head_dim = embed_dim // num_heads
        # The checkpoint's qkv is [q heads | k heads | v heads]: this rank's heads of each.
        self.qkv = load_stacked_qkv(weights, f"{prefix}.qkv",
                                    HeadShape(num_heads, num_heads, head_dim), bias=True)
        self.proj = RowParallelLinear.load(weights, f"{prefix}.proj", bias=True)
        self.num_heads = num_heads // weights.dist.world_size  # this rank's
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                windows: list[int] | None = None) -> torch.Tensor:
        """Full attention over x's rows, or within each window of `windows` rows (contiguous
        after the reordering); one projection (one all-reduce) for all of them."""
        n = x.shape[0]
        q, k, v = self.qkv(x).reshape(n, 3, self.num_heads, self.head_dim).unbind(1)
        # Rotated in float32, as transformers' apply_rotary_pos_emb_vision.
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q = (q.float() * c + rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + rotate_half(k.float()) * s).to(x.dtype)
        sizes = [n] if windows is None else windows
        out = torch.cat([
            F.scaled_dot_product_attention(
                qw.transpose(0, 1), kw.transpose(0, 1), vw.transpose(0, 1), is_causal=False
            ).transpose(0, 1)
            for qw, kw, vw in zip(q.split(sizes), k.split(sizes), v.split(sizes), strict=True)
        ])
        return self.proj(out.reshape(n, -1))


def _norm(weights: Weights, prefix: str, config: VisionConfig) -> nn.Module:
    if config.windowed:
        return RMSNorm.load(weights, prefix, 1e-6)
    return LayerNorm.load(weights, prefix, 1e-6)


class VisionBlock(nn.Module):
    def __init__(self, weights: Weights, prefix: str, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = _norm(weights, f"{prefix}.norm1", config)
        self.norm2 = _norm(weights, f"{prefix}.norm2", config)
        self.attn = VisionAttention(weights, f"{prefix}.attn", config.embed_dim, config.num_heads)
        self.mlp: nn.Module
        if config.windowed:  # gate and up fused in one column-parallel matmul
            self.mlp = GatedMLP.load(weights, f"{prefix}.mlp", config.hidden_act, bias=True)
        else:
            self.mlp = PlainMLP.load(weights, f"{prefix}.mlp.fc1", f"{prefix}.mlp.fc2",
                                     config.hidden_act)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                windows: list[int] | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, windows)
        return x + self.mlp(self.norm2(x))


class VisionConfig:
    """vision_config's fields the tower reads (transformers' Qwen2VLVisionConfig defaults, or
    Qwen2_5_VLVisionConfig's with `windowed`)."""

    def __init__(self, raw: Mapping[str, Any], windowed: bool = False) -> None:
        self.windowed = windowed
        self.depth = int(raw.get("depth", 32))
        # Qwen2.5-VL names the tower's width hidden_size (Qwen2-VL's hidden_size is its output).
        self.embed_dim = int(raw["hidden_size"] if windowed else raw.get("embed_dim", 1280))
        self.num_heads = int(raw.get("num_heads", 16))
        self.hidden_act = str(raw.get("hidden_act", "silu" if windowed else "quick_gelu"))
        self.window_size = int(raw.get("window_size", 112))
        self.full_blocks = frozenset(int(i) for i in raw.get("fullatt_block_indexes", ()))
        self.patch_size = int(raw.get("patch_size", 14))
        self.temporal_patch_size = int(raw.get("temporal_patch_size", 2))
        self.in_channels = int(raw.get("in_channels", 3))
        self.spatial_merge_size = int(raw.get("spatial_merge_size", 2))
        rope = raw.get("rope_parameters") or {}
        self.rope_theta = float(rope.get("rope_theta", 10000.0))
        if self.embed_dim % self.num_heads:
            raise ValueError(f"vision embed_dim {self.embed_dim} is not a multiple of "
                             f"num_heads {self.num_heads}")


class VisionTower(nn.Module):
    """Pixel values of one image -> its image tokens' embeddings [t*h*w / merge^2, hidden]."""

    def __init__(self, weights: Weights, prefix: str, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        conv = weights.get_tensor(f"{prefix}.patch_embed.proj.weight")
        # Stride equal to the kernel: the conv3d is one linear over each flattened patch.
        self.patch_weight = nn.Parameter(conv.reshape(conv.shape[0], -1), requires_grad=False)
        self.patch_dim = self.patch_weight.shape[1]
        mlp = f"{prefix}.blocks.0.mlp.{'up_proj' if config.windowed else 'fc1'}.weight"
        widths = [weights.shape(mlp)[0], weights.shape(f"{prefix}.merger.mlp.0.weight")[0]]
        split = tower_weights(weights, "Qwen2-VL", config.num_heads, widths)
        self.blocks = nn.ModuleList(
            VisionBlock(split, f"{prefix}.blocks.{i}", config) for i in range(config.depth)
        )
        self.ln_q = _norm(weights, f"{prefix}.merger.ln_q", config)
        self.merge_in = ColumnParallelLinear.load(split, f"{prefix}.merger.mlp.0", bias=True)
        self.merge_out = RowParallelLinear.load(split, f"{prefix}.merger.mlp.2", bias=True)
        spatial = (config.embed_dim // config.num_heads) // 2
        exponents = torch.arange(0, spatial, 2, dtype=torch.float) / spatial
        self.inv_freq = (1.0 / config.rope_theta**exponents).to(conv.device)
        self.dtype = conv.dtype
        self.unit = config.spatial_merge_size**2

    def rotary(self, grid: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos/sin [patches, head_dim]: the row's angles, then the column's, twice."""
        pos = patch_positions(grid, self.config.spatial_merge_size, self.inv_freq.device)
        freqs = pos.unsqueeze(-1).float() * self.inv_freq  # [patches, 2, spatial / 2]
        half = torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1)
        both = torch.cat([half, half], dim=-1)
        return both.cos(), both.sin()

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid: Sequence[int]) -> torch.Tensor:
        t, h, w = (int(v) for v in grid)
        if pixel_values.shape != (t * h * w, self.patch_dim):
            raise ValueError(f"pixel values of shape {list(pixel_values.shape)} for a grid "
                             f"{[t, h, w]} of patches of {self.patch_dim} values")
        x = F.linear(pixel_values.to(self.dtype), self.patch_weight)
        cos, sin = self.rotary(grid)
        order, windows = None, None
        if self.config.windowed:
            order, windows = window_order(grid, self.config)
            x, cos, sin = (_by_unit(v, order, self.unit) for v in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            full = windows is None or i in self.config.full_blocks
            x = block(x, cos, sin, None if full else windows)
        merged = self.ln_q(x).reshape(-1, x.shape[-1] * self.unit)
        out = self.merge_out(F.gelu(self.merge_in(merged)))
        return out if order is None else out[torch.argsort(order)]


def _by_unit(x: torch.Tensor, order: torch.Tensor, unit: int) -> torch.Tensor:
    """x's rows in groups of `unit` (one merged token's patches), the groups in `order`."""
    return x.reshape(-1, unit, x.shape[-1])[order].reshape(x.shape)


def window_order(grid: Sequence[int], config: VisionConfig) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows: the merged tokens' order window by window (row-major windows of
    window_size / patch_size / merge tokens a side, cut at the image's edges) and each
    window's patch count (transformers' get_vision_window_index, for one image)."""
    t, h, w = (int(v) for v in grid)
    merge = config.spatial_merge_size
    side = config.window_size // merge // config.patch_size
    gh, gw = h // merge, w // merge
    index = torch.arange(t * gh * gw).reshape(t, gh, gw)
    order, windows = [], []
    for frame in range(t):
        for top in range(0, gh, side):
            for left in range(0, gw, side):
                window = index[frame, top : top + side, left : left + side].flatten()
                order.append(window)
                windows.append(window.numel() * merge * merge)
    return torch.cat(order), windows
