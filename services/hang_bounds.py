"""How long a rank may make no progress before the controller calls it hung, and how long a
collective may wait before its process group gives up: one source for the controller
(controller/health.py) and the trainer (worker/trainer/main.py).

On a GPU, NCCL's watchdog aborts a rank whose collective outlives the group's timeout
(SIGABRT), and the controller blames the rank the aborted ones waited on
(controller/aborts.py). That evidence must arrive before the controller's own hang bound
expires, or the result is a blameless stall: so on CUDA every group's timeout is half the
controller's bound, leaving the other half for the time between the rank's last progress
and the collective's start, and for the abort's report. Before the first step the bound is
the start-up grace (the first collectives form NCCL's communicators); after it, the groups
are shortened to the steady bound, as torchtitan does.

On CPU, gloo raises in the waiting ranks instead, which blames nobody: there the groups
keep `max(60 s, hang_after_s)`, beyond the controller's bound, so the controller finds the
hung rank itself (by its collective counters and process state)."""

from __future__ import annotations

STARTUP_GRACE_S = 300.0  # per start-up milestone (import, rendezvous, restore): slow hosts
# More per billion parameters: what grows with the model before its first step and writes no
# `io` progress line of its own (allocating and laying out the shards, the first step's
# all-gathers of every layer, NCCL's buffers). Weight init, import, restore and saves tick
# progress while they run (worker/trainer/io_progress.py), so this need not cover them.
GRACE_PER_BILLION_S = 5.0
GLOO_FLOOR_S = 60.0


def startup_grace_s(params: int) -> float:
    """The start-up grace for a model of `params` parameters: 300 s, plus 5 s per billion
    (a 70B model gets 650 s)."""
    return STARTUP_GRACE_S + GRACE_PER_BILLION_S * params / 1e9


def hang_bound_s(hang_after_s: float, stepping: bool, params: int) -> float:
    """The controller's bound on a rank's silence: `hang_after_s` once it has completed a
    step, the start-up grace for the model's size (at least) before."""
    return hang_after_s if stepping else max(hang_after_s, startup_grace_s(params))


def collective_timeout_s(hang_after_s: float, cuda: bool, stepping: bool, params: int) -> float:
    """Every process group's timeout: on CUDA half the controller's bound, so NCCL's watchdog
    acts first; on CPU beyond it."""
    if cuda:
        return hang_bound_s(hang_after_s, stepping, params) / 2
    return max(GLOO_FLOOR_S, hang_after_s)
