"""Synthetic data: a seeded Markov chain whose best achievable loss is known exactly, so a
run's final loss says how close training got (docs/data.md, "Sources")."""

from __future__ import annotations

import numpy as np


def _rng(seed: int, index: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64([seed, index]))


def _cdf(p: np.ndarray) -> np.ndarray:
    c = np.cumsum(p, axis=-1)
    c[..., -1] = 1.0  # no sample may fall past the last bin through rounding
    return c


class SyntheticMarkov:
    """A seeded first-order Markov chain over the vocabulary, in O(vocab x fanout) memory.

    Token i moves to successors[i, j] with probability weights[j]: the transition matrix is
    a mixture of `fanout` random permutation matrices, so it is doubly stochastic and the
    uniform distribution is stationary by construction (no vocab x vocab matrix, no solve:
    the 1b presets' vocab of 128,256 costs 4 MB). Sequences start uniform, so every
    predicted position has the same conditional entropy H(X_{t+1} | X_t): the best loss any
    model can reach, computed exactly in `entropy_floor`.
    """

    def __init__(self, vocab: int, seed: int, fanout: int = 4):
        rng = _rng(seed, 2**62)
        fanout = min(fanout, vocab)
        self.vocab = vocab
        self.successors = np.stack([rng.permutation(vocab) for _ in range(fanout)], axis=1)
        self.weights = rng.dirichlet(np.full(fanout, 0.5))
        self.weight_cdf = _cdf(self.weights)

    def probability(self, prev: np.ndarray, nxt: np.ndarray) -> np.ndarray:
        """P(X_{t+1} = nxt | X_t = prev), elementwise. Two permutations may send a token to
        the same successor: their weights add."""
        hits = self.successors[prev] == np.asarray(nxt)[..., None]
        return hits.astype(np.float64) @ self.weights

    def entropy_floor(self) -> float:
        """H(X_{t+1} | X_t) in nats under the (uniform) stationary distribution."""
        p = self.probability(np.arange(self.vocab)[:, None], self.successors)  # (vocab, fanout)
        return float(-(self.weights * np.log(p)).sum(axis=1).mean())

    def samples(self, seed: int, indices: range, length: int) -> np.ndarray:
        u = np.stack([_rng(seed, i).random(length) for i in indices])
        out = np.empty(u.shape, dtype=np.int64)
        out[:, 0] = np.minimum((u[:, 0] * self.vocab).astype(np.int64), self.vocab - 1)
        for t in range(1, length):
            branch = np.searchsorted(self.weight_cdf, u[:, t], side="right")
            out[:, t] = self.successors[out[:, t - 1], branch]
        return out
