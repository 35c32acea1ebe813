"""A sampling request's random numbers as a function of (seed, token index), not of how many a
generator has handed out.

Each generated token's draws come from a generator seeded with `token_seed(seed, index)`, index
the number of tokens the request generated before it. So a seeded request draws the same numbers
for its i-th token however it got there: one token per step, several per step (speculative
decoding verifies drafted positions with their own indexes' draws and keeps the drafts only where
those draws choose them: shard/engine/verification.py), resumed after preemption (its index
starts at the generated tokens it brings), or in any batch. A generator consumed in order could
not give that: a step that verified k positions would use k steps' numbers, or one step's, and
the tokens after it would depend on whether the step drafted.

The mix is SplitMix64's finaliser over the seed, then over the seed's mix plus the index, so
nearby seeds and indexes (seed s at index i + 1, seed s + 1 at index i) get unrelated streams;
the result fits torch.Generator.manual_seed (below 2**63).
"""

from __future__ import annotations

import torch

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _splitmix(x: int) -> int:
    """SplitMix64's output function: a bijection of 64-bit ints that scatters every input bit."""
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def token_seed(seed: int, index: int) -> int:
    """The generator seed of a request's `index`-th generated token (0-based)."""
    return _index_seed(_splitmix(seed & _MASK), index)


def _index_seed(base: int, index: int) -> int:
    """token_seed given the seed's mix (computed once per request)."""
    return _splitmix((base + index) & _MASK) >> 1


class TokenDraws:
    """One sampling request's draws: its seed and the index of the next token it samples.

    Carried with the request across a shard's batches (filter, concatenate) like the generator it
    replaces; `index` moves on by one per token the request emits."""

    __slots__ = ("seed", "index", "_base", "_generators")

    def __init__(self, seed: int, index: int = 0) -> None:
        self.seed = seed
        self.index = index
        self._base = _splitmix(seed & _MASK)
        # One generator per device, reseeded for each token (making one costs ~2 us).
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device, offset: int = 0) -> torch.Generator:
        """The generator of token `index + offset`, freshly seeded: the same numbers every
        time. Valid until the next call (it is reused)."""
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = torch.Generator(device=device)
        return generator.manual_seed(_index_seed(self._base, self.index + offset))

    def at(self, offset: int) -> TokenDraws:
        """The draws of the token `offset` after the next one (a drafted position)."""
        return TokenDraws(self.seed, self.index + offset)
