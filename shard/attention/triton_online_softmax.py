"""The score transform and online-softmax step shared by the Triton decode and prefill kernels.

Scores are kept in base 2 (multiplied by log2(e)) so the kernels use exp2, which is one hardware
instruction; the log-sum-exp a split writes is therefore in base 2 too. A running maximum that is
still -inf (a row that has seen no key yet, e.g. a padded query row under a sliding window) is
treated as 0 so that no NaN ever appears, and its probabilities stay exactly 0.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    """tanh from exp of a non-positive argument: no overflow, and no libdevice (interpreter-safe)."""
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def scaled_scores(qk, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """Raw q.k products -> base-2 logits: scale, then optionally softcap * tanh(s / softcap)."""
    if HAS_SOFTCAP:
        s = qk * scale
        s = softcap * _tanh(s / softcap)
        return s * 1.4426950408889634
    else:
        return qk * (scale * 1.4426950408889634)


@triton.jit
def online_softmax_step(acc, m_i, l_i, scores, v, PRECISION: tl.constexpr):
    """Folds one tile of masked base-2 scores [M, N] and values [N, D] into (acc, max, sum)."""
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


def dot_precision(dtype_is_fp32: bool) -> str:
    """fp32 inputs get exact ("ieee") products, matching the reference; halves use tensor cores."""
    return "ieee" if dtype_is_fp32 else "tf32"

