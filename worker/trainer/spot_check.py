"""Re-execution spot checks: the silent-data-corruption check of layouts without DP replicas
(docs/architecture.md, "Silent data corruption").

With ZeRO 2/3 or a single replica no two ranks hold the same state, so there is nothing to
compare fingerprints with. Instead, every `sdc.spot_every_steps` steps every rank runs one
microbatch (the first of the next step's local batch) forward and backward twice and compares
the two results bitwise: the loss, the logits, and the gradient of the loss with respect to
the token embedding's output, which flows back through every block and the head. The kernels
are deterministic (gloo on CPU; on CUDA the passes run under
`torch.use_deterministic_algorithms(True)` with errors, not warnings, for an op that has no
deterministic kernel, on SDPA's math backend, whose backward has no atomics, and with cuBLAS's
fixed workspace set before CUDA starts, worker/trainer/distributed.py), so a difference is a
transient compute fault. A difference is confirmed by a third pass before anyone is blamed: a
transient fault disturbs one pass, so the third agrees with the other one. A third pass that
agrees with neither means the kernels were not deterministic after all: that is reported on
the rank's log and blames nobody.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from services.spec import JobSpec, spot_checked
from worker.trainer.chaos import BitFlips, flip_bit
from worker.trainer.sdc import SilentCorruption, fingerprint
from worker.trainer.step import Trainer

# compared in this order; the first that differs names the mismatch
COMPARED = ("loss", "logits", "input gradient")


class SpotCheck:
    """One rank's side of the spot check. Every rank of the world calls `verify` at the same
    steps (the passes run the layout's collectives, and the verdict is a world all-reduce)."""

    def __init__(self, spec: JobSpec, trainer: Trainer, flips: BitFlips | None = None):
        self.every, self.steps = spec.sdc.spot_every_steps, spec.train.steps
        self.trainer, self.flips = trainer, flips
        self.model = trainer.parts[0]

    @staticmethod
    def applies(spec: JobSpec) -> bool:
        """sdc on, no DP replicas to compare (worker/trainer/sdc.py), one pipeline stage."""
        return spot_checked(spec)

    def due(self, step: int) -> bool:
        """At multiples of spot_every_steps, after a step that has a next one to protect."""
        return 0 < step < self.steps and step % self.every == 0

    def verify(self, step: int) -> None:
        """Every rank, after the state of `step` was snapshotted: returns when every rank's two
        passes agree bitwise, raises SilentCorruption (the same evidence on every rank) when
        one rank's do not."""
        t = self.trainer
        x, y = t.batches.local(step, t.ctx.coord.dp)
        n = t.spec.parallel.microbatches
        x, y = x.chunk(n)[0].to(t.ctx.device), y.chunk(n)[0].to(t.ctx.device)
        bit = self.flips.compute_fault(step) if self.flips else None
        with _deterministic(t.ctx.device):
            first = self._pass(x, y, step, bit)
            second = self._pass(x, y, step, None)
            differs = _differs(first, second)
            if not self._anywhere(differs):
                return
            # every rank runs the third pass: a pass runs the layout's collectives
            third = self._pass(x, y, step, None)
        if differs and _differs(first, third) and _differs(second, third):
            print(
                f"spot check at step {step}: three passes of one microbatch all differ "
                f"({', '.join(differs)}): the kernels are not deterministic on "
                f"{t.ctx.device}; nobody is blamed",
                file=sys.stderr,
                flush=True,
            )
            differs = []
        if not self._anywhere(differs):
            return
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, {"rank": t.ctx.rank, "mismatch": differs})
        raise SilentCorruption(evidence(step, every))

    def _anywhere(self, differs: list[str]) -> bool:
        """Whether any rank of the world found a difference (a world all-reduce)."""
        flag = torch.tensor([int(bool(differs))], device=self.trainer.ctx.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(int(flag))

    def _pass(self, x: torch.Tensor, y: torch.Tensor, step: int, bit: int | None) -> list[int]:
        """One forward and input-gradient backward of the microbatch: the fingerprints of its
        loss, logits and input gradient. `bit`: flip it in the embedding's output first."""
        captured: list[torch.Tensor] = []

        def hook(_module, _inputs, out: torch.Tensor) -> torch.Tensor:
            if bit is not None:
                out = out.clone()  # the flipped copy is what the blocks and the gradient see
                with torch.no_grad():
                    flip_bit(out, bit)
                self.flips.flipped(step, bit, "embed output (compute)")
            captured.append(out)
            return out

        handle = self.model.embed.register_forward_hook(hook)
        try:
            with self.trainer.loss_context():
                logits = self.model(x)
                loss = self.trainer.loss(logits, y)
                (grad,) = torch.autograd.grad(loss, captured)
        finally:
            handle.remove()
        named = zip(COMPARED, (loss.detach(), logits.detach(), grad), strict=True)
        return fingerprint([(n, v.contiguous()) for n, v in named]).tolist()


def _differs(a: list[int], b: list[int]) -> list[str]:
    """The compared values whose fingerprints differ between two passes."""
    return [name for name, x, y in zip(COMPARED, a, b, strict=True) if x != y]


def evidence(step: int, reports: list[dict]) -> dict:
    """The same evidence as the replica check's (RankReport.sdc), from every rank's {rank,
    mismatch: the compared values that differed between its passes}."""
    bad = [r for r in reports if r["mismatch"]]
    ranks = sorted(r["rank"] for r in bad)
    tensor = next(n for n in COMPARED if any(n in r["mismatch"] for r in bad))
    what = "; ".join(f"rank {r['rank']}: {', '.join(r['mismatch'])}" for r in bad)
    return {
        "check": "spot",  # the replica check's evidence has no `check`
        "step": step,
        "clean_step": step,  # the check reads the state, never writes it
        "tensor": tensor,
        "ranks": ranks,
        "suspects": ranks,
        "detail": (
            f"re-executing one microbatch at step {step} gave a different result on rank(s) "
            f"{ranks} ({what}); blamed by spot check: rank(s) {ranks}"
        ),
    }


@contextlib.contextmanager
def _deterministic(device: torch.device):
    """On CUDA, deterministic kernels for the checked passes: an op without one raises rather
    than warns (a warning let flash attention's atomic dQ accumulation through, and every
    healthy GPU failed the bitwise comparison), and attention runs on SDPA's math backend,
    which has no atomics. CPU kernels and gloo already are deterministic."""
    if device.type != "cuda":
        yield
        return
    was = torch.are_deterministic_algorithms_enabled()
    warn = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(was, warn_only=warn)
