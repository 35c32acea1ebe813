"""Rotary position embeddings with the rope_scaling variants of the Llama family.

Supported `rope_scaling` types: default (none), linear (Code Llama style position interpolation),
dynamic (NTK-aware, base grows past max_position_embeddings), llama3 (per-frequency smoothing),
yarn (NTK-by-parts with attention temperature), longrope (Phi-3's per-frequency factors, `su`
and Phi-3's `yarn` being older names for it). cos/sin are computed for the batch's positions on
the fly: one outer product per forward, shared by every layer, with no table to outgrow.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

SUPPORTED = ("default", "linear", "dynamic", "llama3", "yarn", "longrope", "su")


def default_inv_freq(dim: int, base: float) -> torch.Tensor:
    """1 / base^(2i/dim), written exactly as the checkpoints were trained with (float32 pow)."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short kept, the band between blended."""
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(
    dim: int, base: float, max_position_embeddings: int, scaling: Mapping[str, Any]
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between; scale cos/sin."""
    factor = float(scaling["factor"])
    original = int(scaling.get("original_max_position_embeddings") or max_position_embeddings)
    attention_factor = scaling.get("attention_factor")
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength completes `rotations` turns over the original context.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention_factor)


def longrope_inv_freq(
    dim: int, base: float, max_position_embeddings: int, scaling: Mapping[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """LongRoPE (Phi-3): (short, long inverse frequencies, attention factor, original context).

    Each frequency is divided by its own factor: `short_factor` within the context the model was
    pretrained on, `long_factor` beyond it. The attention factor follows from the context growth
    max_position_embeddings / original, as transformers computes it.
    """
    original = scaling.get("original_max_position_embeddings")
    if original:
        factor = max_position_embeddings / int(original)
    else:
        original, factor = max_position_embeddings, float(scaling.get("factor") or 1.0)
    original = int(original)
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        )
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim

    def inv_freq(factors: Any) -> torch.Tensor:
        ext = torch.tensor(factors, dtype=torch.float32)
        if ext.shape != (dim // 2,):
            raise ValueError(f"longrope factors have {ext.numel()} entries for {dim // 2}")
        return 1.0 / (ext * base**shape)

    short, long = inv_freq(scaling["short_factor"]), inv_freq(scaling["long_factor"])
    return short, long, float(attention_factor), original


def rope_type_of(scaling: Mapping[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


class RotaryEmbedding:
    """cos/sin for positions, and their application to query/key heads (rotate-half layout)."""

    def __init__(
        self,
        dim: int,
        base: float,
        max_position_embeddings: int,
        scaling: Mapping[str, Any] | None,
        device: torch.device,
    ) -> None:
        rope_type = rope_type_of(scaling)
        if rope_type not in SUPPORTED:
            supported = ", ".join(SUPPORTED)
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported ({supported})")
        self.dim = dim
        self.base = base
        self.max_position_embeddings = max_position_embeddings
        self.attention_scaling = 1.0
        self.dynamic_factor: float | None = None
        # LongRoPE: the long-context frequencies, taken by positions at or past `long_from`.
        self.long_inv_freq: torch.Tensor | None = None
        self.long_from = 0
        try:
            self.inv_freq = self._inv_freq(rope_type, scaling or {}, device).to(device)
        except KeyError as e:
            raise ValueError(f"rope_scaling of type {rope_type!r} lacks the key {e}") from e

    def _inv_freq(
        self, rope_type: str, params: Mapping[str, Any], device: torch.device
    ) -> torch.Tensor:
        dim, base, max_position_embeddings = self.dim, self.base, self.max_position_embeddings
        inv_freq = default_inv_freq(dim, base)
        if rope_type == "linear":
            inv_freq = inv_freq / float(params["factor"])
        elif rope_type == "dynamic":
            self.dynamic_factor = float(params["factor"])
        elif rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, params)
        elif rope_type == "yarn":
            inv_freq, self.attention_scaling = yarn_inv_freq(
                dim, base, max_position_embeddings, params
            )
        elif rope_type in ("longrope", "su"):
            inv_freq, long, self.attention_scaling, self.long_from = longrope_inv_freq(
                dim, base, max_position_embeddings, params
            )
            self.long_inv_freq = long.to(device)
        return inv_freq

    def _dynamic_inv_freq(self, positions: torch.Tensor) -> torch.Tensor:
        """Per-token frequencies: position p uses the NTK base for a sequence of p + 1 tokens.

        Per token rather than per batch (as transformers does) so that a request's output never
        depends on which other requests share its batch; for one sequence decoding token by
        token the two agree.
        """
        assert self.dynamic_factor is not None
        factor, limit, dim = self.dynamic_factor, self.max_position_embeddings, self.dim
        # float32 throughout, the arithmetic the checkpoints' reference implementation does.
        seq = (positions + 1).float()
        base = self.base * ((factor * seq / limit) - (factor - 1)) ** (dim / (dim - 2))
        exponent = torch.arange(0, dim, 2, device=positions.device).float() / dim
        scaled = 1.0 / base.unsqueeze(-1) ** exponent
        beyond = (positions + 1 > limit).unsqueeze(-1)
        return torch.where(beyond, scaled, self.inv_freq.unsqueeze(0))

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin [num_tokens, dim / 2] (YaRN's temperature folded in)."""
        if self.long_inv_freq is not None:
            # Per token, as the dynamic scaling: a position past the original context rotates
            # with the long factors (transformers switches the whole sequence once it is longer,
            # which for one sequence decoding token by token is the same).
            beyond = (positions >= self.long_from).unsqueeze(-1)
            inv_freq = torch.where(beyond, self.long_inv_freq, self.inv_freq)
            freqs = positions.float().unsqueeze(-1) * inv_freq
        elif self.dynamic_factor is None:
            freqs = positions.float().unsqueeze(-1) * self.inv_freq
        else:
            freqs = positions.float().unsqueeze(-1) * self._dynamic_inv_freq(positions)
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos, sin


def rotation_tables(
    cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [num_tokens, dim / 2] as the two [num_tokens, 1, dim] factors apply_rotary takes:
    built once per forward, so that each layer's rotation is two multiplies, an add and a cat."""
    both_cos = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(dtype)
    signed_sin = torch.cat((-sin, sin), dim=-1).unsqueeze(1).to(dtype)
    return both_cos, signed_sin


def apply_rotary(x: torch.Tensor, both_cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [num_tokens, heads, dim] with rotation_tables' factors.

    Rotate-half layout: dimension i pairs with i + dim/2, as the Hugging Face checkpoints expect:
    [x1 * cos - x2 * sin, x2 * cos + x1 * sin], the same products and sums in the same order.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return x * both_cos + torch.cat((x2, x1), dim=-1) * signed_sin


def interleaved_rotation_tables(
    cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotation_tables for the interleaved layout (Cohere: dimension 2i pairs with 2i + 1)."""
    both_cos = cos.repeat_interleave(2, dim=-1).unsqueeze(1).to(dtype)
    signed_sin = torch.stack((-sin, sin), dim=-1).flatten(-2).unsqueeze(1).to(dtype)
    return both_cos, signed_sin


def apply_interleaved_rotary(
    x: torch.Tensor, both_cos: torch.Tensor, signed_sin: torch.Tensor
) -> torch.Tensor:
    """Rotates x [num_tokens, heads, dim] whose rotation pairs are adjacent dimensions:
    [x0 * cos - x1 * sin, x1 * cos + x0 * sin, ...] with interleaved_rotation_tables' factors."""
    swapped = torch.stack((x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return x * both_cos + swapped * signed_sin


def apply_partial_rotary(
    x: torch.Tensor, both_cos: torch.Tensor, signed_sin: torch.Tensor
) -> torch.Tensor:
    """Rotates only the first `both_cos.shape[-1]` dimensions of each head (Phi-4-mini's
    partial_rotary_factor); the rest pass through."""
    rotary_dim = both_cos.shape[-1]
    rotated = apply_rotary(x[..., :rotary_dim], both_cos, signed_sin)
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
