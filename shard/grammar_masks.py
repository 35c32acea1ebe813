"""Token masks of constrained rows: llguidance's bitmask words to what sampling applies.

llguidance writes one bit per token (bit i of int32 word w: token 32 w + i allowed). Sampling
needs the banned tokens at -inf before anything else sees the logits. On the CPU a masked fill
by a [rows, vocab] bool is the slow way: torch's masked_fill_ and where run scalar loops there
(~9 ms for 64 x 128k on one core, measured in bench/grammar.py's breakdown), while adding a
float32 bias of 0 / -inf is vectorised (~1-2 ms). So on the CPU the grammar thread turns the
words into that bias (numpy unpacks the bits and multiplies them into the bit pattern of -inf,
in a reused buffer: a fresh 32 MB array would be mmapped and page-faulted each step), and the
engine's thread adds it. Adding 0.0 leaves every finite logit as it was (-0.0 becomes +0.0,
which no later operation can tell apart) and -inf + x is -inf: the same scores as the masked
fill for every finite logit (a NaN logit stays NaN, where the fill made a banned one -inf: a
model that emits NaN could then pick a banned token, which its matcher refuses, ending the
request with EOS as for any refused token). On an accelerator the words travel (32x smaller than the bias)
and are unpacked there into banned tokens, where masked_fill_ is fast.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

# float32 -inf as an int32 bit pattern (0xFF800000): banned (1) * this is -inf, allowed (0) 0.0.
NEG_INF_BITS = np.int32(-8388608)


class BiasBuffers:
    """Reused [rows, vocab] int32 buffers for the CPU's bias, handed back once applied.

    The grammar thread takes one per mask computation; the engine's thread gives it back when
    the step that applied it is over (BatchGrammar.advance). A buffer never given back (a batch
    dropped between steps) is simply collected.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, rows: int, vocab: int) -> np.ndarray:
        """A free [at least rows, vocab] int32 buffer, or a new one."""
        with self._lock:
            for i, buffer in enumerate(self._free):
                if buffer.shape[0] >= rows and buffer.shape[1] == vocab:
                    return self._free.pop(i)
        return np.empty((rows, vocab), dtype=np.int32)

    def give_back(self, buffer: np.ndarray) -> None:
        """`buffer` (from `take`) is no longer read by anyone."""
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buffer)


def bias_on_host(
    words: np.ndarray, vocab_size: int, buffers: BiasBuffers
) -> tuple[torch.Tensor, np.ndarray]:
    """([rows, vocab_size] float32: 0.0 where the words allow the token, -inf where they ban
    it; the buffer it lives in, to give back once applied)."""
    banned = np.unpackbits(np.invert(words).view(np.uint8), axis=1, count=vocab_size, bitorder="little")
    buffer = buffers.take(words.shape[0], vocab_size)
    out = buffer[: words.shape[0]]
    np.multiply(banned, NEG_INF_BITS, out=out, casting="unsafe")
    return torch.from_numpy(out.view(np.float32)), buffer


def unpack_with_torch(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmask words to [rows, vocab_size] bool, True where banned, on the words' device."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return (bits == 0).flatten(1)[:, :vocab_size]
