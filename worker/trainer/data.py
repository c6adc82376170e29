"""Training data as a pure function of (seed, global sample index).

Global step s consumes samples [s*G, (s+1)*G); data-parallel rank r takes the r-th
contiguous slice, then splits it into microbatches. Every mesh therefore sees the same
global batch, and resuming at any dp needs only the step number.
"""

from __future__ import annotations

import os
import stat

import numpy as np
import torch

from services.spec import DataSpec, ModelSpec


class DataError(ValueError):
    pass


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


class FileTokens:
    """Windows of a token array (bytes of a text file, or a uint16/uint32 memmap)."""

    def __init__(self, path: str, dtype: str, vocab: int):
        # The agent hands over the path it resolved under its data roots (services/paths.py);
        # O_NOFOLLOW refuses a link swapped in since, and fstat checks what was really opened.
        refused = DataError(
            f"data.source: {path} does not exist or is not a readable, non-empty "
            "regular file (links are not followed); fix the path"
        )
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            raise refused from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
            os.close(fd)
            raise refused
        with os.fdopen(fd, "rb") as f:  # the map keeps its own reference to the file
            self.tokens = np.memmap(f, dtype=np.dtype(dtype), mode="r")
        self.vocab = vocab

    def samples(self, seed: int, indices: range, length: int) -> np.ndarray:
        n = len(self.tokens) - length
        if n < 0:
            raise DataError(
                f"data.source: the file holds {len(self.tokens)} tokens, fewer than "
                f"seq_len+1 = {length}; use a longer file or a shorter model.seq_len"
            )
        starts = [int(_rng(seed, i).integers(0, n + 1)) for i in indices]
        out = np.stack([np.asarray(self.tokens[s : s + length], dtype=np.int64) for s in starts])
        if out.max(initial=0) >= self.vocab:
            raise DataError(
                f"data.source: token id {int(out.max())} >= model.vocab {self.vocab}; "
                "raise model.vocab or check data.token_dtype"
            )
        return out


class Batches:
    """Global batches for a job; `local(step, dp_rank)` is what one DP rank trains on."""

    def __init__(self, data: DataSpec, model: ModelSpec, global_batch: int, dp: int):
        self.seed, self.seq_len, self.global_batch, self.dp = (
            data.seed,
            model.seq_len,
            global_batch,
            dp,
        )
        if data.kind == "synthetic":
            self.source = SyntheticMarkov(model.vocab, data.seed)
        elif data.kind == "text":
            self.source = FileTokens(data.path, "uint8", model.vocab)
        else:
            self.source = FileTokens(data.path, data.token_dtype, model.vocab)

    def entropy_floor(self) -> float | None:
        return self.source.entropy_floor() if isinstance(self.source, SyntheticMarkov) else None

    def local(self, step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of shape (global_batch/dp, seq_len) for `step`."""
        per = self.global_batch // self.dp
        first = step * self.global_batch + dp_rank * per
        seq = self.source.samples(self.seed, range(first, first + per), self.seq_len + 1)
        t = torch.from_numpy(seq)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()
