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
GLOO_FLOOR_S = 60.0


def hang_bound_s(hang_after_s: float, stepping: bool) -> float:
    """The controller's bound on a rank's silence: `hang_after_s` once it has completed a
    step, the start-up grace (at least) before."""
    return hang_after_s if stepping else max(hang_after_s, STARTUP_GRACE_S)


def collective_timeout_s(hang_after_s: float, cuda: bool, stepping: bool) -> float:
    """Every process group's timeout: on CUDA half the controller's bound, so NCCL's watchdog
    acts first; on CPU beyond it."""
    if cuda:
        return hang_bound_s(hang_after_s, stepping) / 2
    return max(GLOO_FLOOR_S, hang_after_s)
