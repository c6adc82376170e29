"""Training data as a pure function of (data seed, global sample index), for torch.

Global step s consumes samples [s*G, (s+1)*G); data-parallel rank r takes the r-th
contiguous slice, then splits it into microbatches. Every mesh therefore sees the same
global batch, and resuming at any dp needs only the step number. Validation batch k is
held-out samples [k*G, (k+1)*G), the same at every measurement. Which samples those are is
the dataset package's business (dataset/sources.py).
"""

from __future__ import annotations

import numpy as np
import torch

from dataset.sources import open_source
from services.spec import DataSpec, ModelSpec


class Batches:
    """Global batches for a job; `local(step, dp_rank)` is what one DP rank trains on."""

    def __init__(self, data: DataSpec, model: ModelSpec, global_batch: int, dp: int):
        self.global_batch, self.dp = global_batch, dp
        self.source = open_source(
            data.source, data.token_dtype, model.vocab, data.seed, model.seq_len + 1
        )

    def entropy_floor(self) -> float | None:
        return self.source.entropy_floor()

    def epoch(self, step: int) -> int | None:
        """The epoch step `step` (0-based) starts in; None for unbounded synthetic data."""
        return self.source.epoch_of(step * self.global_batch)

    def _slice(self, batch: int, dp_rank: int) -> range:
        per = self.global_batch // self.dp
        first = batch * self.global_batch + dp_rank * per
        return range(first, first + per)

    def local(self, step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of shape (global_batch/dp, seq_len) for `step`."""
        return _pair(self.source.train(self._slice(step, dp_rank)))

    def held_out(self, batch: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Validation batch `batch`'s (inputs, targets) for one DP rank."""
        return _pair(self.source.held_out(self._slice(batch, dp_rank)))


def _pair(seq: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.from_numpy(seq)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()
