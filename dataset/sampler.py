"""Which window each global sample index reads (docs/data.md, "Sampling").

A finite source is cut into packed windows of seq_len + 1 tokens that overlap by one token,
so every token after the first is a target exactly once per epoch. Global sample g reads
window `order(seed, epoch)[g % windows]` of epoch g // windows, where the order is a keyed
Feistel bijection on [0, windows): a pure function of (seed, epoch, index) that holds nothing
of size `windows` in memory. Step s trains on samples [s*G, (s+1)*G), so, as for synthetic
data, a batch is a function of the step alone, whatever the layout or the recovery.
"""

from __future__ import annotations

import hashlib

import numpy as np

from dataset.tokens import TokenStream

ROUNDS = 4  # Luby-Rackoff: four rounds make a keyed Feistel network a strong permutation
MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finalizer: a cheap, well-spread 64-bit hash."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & MASK64
    return x ^ (x >> 31)


class Permutation:
    """A bijection on [0, n) keyed by (seed, stream): a balanced Feistel network on the
    smallest even number of bits that covers n, cycle-walked back into range (each walk step
    lands in range with probability > 1/4 at worst, so the expected cost is a few rounds)."""

    def __init__(self, n: int, seed: int, stream: int):
        if n <= 0:
            raise ValueError("a permutation needs n >= 1")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        digest = hashlib.sha256(f"{seed}:{stream}".encode()).digest()
        self.keys = [int.from_bytes(digest[8 * r : 8 * r + 8], "little") for r in range(ROUNDS)]

    def _feistel(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << self.half) | right

    def __getitem__(self, i: int) -> int:
        if not 0 <= i < self.n:
            raise IndexError(i)
        x = self._feistel(i)
        while x >= self.n:
            x = self._feistel(x)
        return x


class PackedWindows:
    """Windows of `length` tokens over a stream, consecutive ones sharing one token."""

    def __init__(self, stream: TokenStream, length: int):
        self.stream, self.length = stream, length
        self.count = max(0, (len(stream) - 1) // (length - 1))

    def window(self, i: int) -> np.ndarray:
        return self.stream.read(i * (self.length - 1), self.length)


class EpochSampler:
    """Global sample index -> (epoch, window), every window once per epoch."""

    def __init__(self, windows: PackedWindows, seed: int):
        self.windows, self.seed = windows, seed
        self._order: tuple[int, Permutation] | None = None

    def order(self, epoch: int) -> Permutation:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, Permutation(self.windows.count, self.seed, epoch))
        return self._order[1]

    def epoch_of(self, index: int) -> int:
        return index // self.windows.count

    def window_index(self, index: int) -> int:
        epoch, position = divmod(index, self.windows.count)
        return self.order(epoch)[position]

    def samples(self, indices: range) -> np.ndarray:
        return np.stack([self.windows.window(self.window_index(i)) for i in indices])
