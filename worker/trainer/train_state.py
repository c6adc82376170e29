"""How far training got in its data stream, and what a resume must match.

Data is a pure function of (data seed, global sample index), and step s consumes global
samples [s*G, (s+1)*G) (worker/trainer/data.py). A checkpoint therefore records the steps
completed, the samples consumed (step * G, a global count: a resume onto another dp reads
the same samples) and the seed. Resuming with another seed or global batch would train on
data the checkpoint never saw while claiming its step: it is refused, naming the field.
No torch here: the check is a pure function.
"""

from __future__ import annotations

from dataclasses import dataclass


class ResumeRefused(ValueError):
    """The newest checkpoint does not match this spec; resuming would change the data."""


@dataclass(frozen=True)
class DataStream:
    """The data a job trains on, as far as a checkpoint must match it."""

    seed: int  # data.seed
    global_batch: int  # train.global_batch
    source: str | None = None  # a prepared dataset's content id (dataset/format.py)

    def train_state(self, step: int) -> dict:
        """What a checkpoint taken after `step` completed steps records."""
        state = {"step": step, "consumed_samples": step * self.global_batch, "data_seed": self.seed}
        return state | ({"data_source": self.source} if self.source else {})

    def check_resume(self, saved: dict) -> None:
        """Raise ResumeRefused unless `saved` (a checkpoint's train state) continues this stream."""
        step, seed, consumed = saved["step"], saved["data_seed"], saved["consumed_samples"]
        if self.source and saved.get("data_source", self.source) != self.source:
            raise ResumeRefused(
                f"checkpoint step {step} was trained on another dataset (content id "
                f"{saved['data_source']}) than data.source holds now ({self.source}): resume "
                "with the dataset it trained on, or start a new job"
            )
        if seed != self.seed:
            raise ResumeRefused(
                f"checkpoint step {step} was trained with data.seed={seed}; this spec has "
                f"data.seed={self.seed}: resume with the original seed or start a new job"
            )
        if consumed != step * self.global_batch:
            was = (
                f"train.global_batch={consumed // step}"
                if step and consumed % step == 0
                else ("another train.global_batch")
            )
            raise ResumeRefused(
                f"checkpoint step {step} consumed {consumed} samples ({was}); this spec has "
                f"train.global_batch={self.global_batch}, which makes {step * self.global_batch}: "
                f"resume with the original global batch or start a new job"
            )
