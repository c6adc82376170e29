"""The next step's batch, read on a thread while this step trains, for a rank on a GPU.

A batch is a host-side job (gather windows from a memory-mapped dataset, or generate the
synthetic chain's samples), and on the training thread it keeps the GPU idle until done.
Here it runs one step ahead and lands in page-locked memory, so the copy to the device is
asynchronous (`non_blocking`), queued behind the step's other work. CPU ranks read in line:
the thread would compete for the core the step runs on, for nothing.

Batches are a pure function of the step (worker/trainer/data.py), so a prefetched batch is the
one the step would have read; a step other than the one prefetched (a restart, the spot
check's re-reads go to `Batches` itself) is read now, and a read error surfaces in the step
that needs the batch.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from worker.trainer.data import Batches


class Prefetcher:
    def __init__(self, batches: Batches, dp_rank: int) -> None:
        self.batches, self.dp_rank = batches, dp_rank
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch")
        self._ahead: tuple[int, Future] | None = None

    def _read(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.batches.local(step, self.dp_rank)
        return x.pin_memory(), y.pin_memory()

    def local(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Step `step`'s (inputs, targets), page-locked; starts reading step + 1's."""
        if self._ahead is not None and self._ahead[0] == step:
            pending = self._ahead[1]
        else:
            pending = self._pool.submit(self._read, step)
        self._ahead = (step + 1, self._pool.submit(self._read, step + 1))
        return pending.result()
