"""Loss and gradient-norm anomalies: a robust z-score over a sliding window
(docs/architecture.md, "Silent data corruption"). An extra signal, never a fault: a loss spike
is not proof of corruption, so it is reported and training goes on."""

from __future__ import annotations

import statistics
from collections import deque

MAD_TO_SIGMA = 1.4826  # the MAD of a normal distribution is 0.6745 sigma


def robust_z(window: deque[float], x: float) -> float | None:
    """How many robust sigmas `x` lies from the window's median; None while the window's
    spread is zero (a constant signal has no scale to measure against)."""
    med = statistics.median(window)
    mad = statistics.median(abs(v - med) for v in window)
    return None if mad == 0 else (x - med) / (MAD_TO_SIGMA * mad)


class AnomalyWatch:
    def __init__(self, window: int, z: float):
        self.z = z
        self.windows = {"loss": deque(maxlen=window), "grad_norm": deque(maxlen=window)}

    def observe(self, step: int, loss: float, grad_norm: float) -> list[dict]:
        """The anomaly lines for this step (empty on an ordinary one); a full window first."""
        out = []
        for signal, x in (("loss", loss), ("grad_norm", grad_norm)):
            w = self.windows[signal]
            if len(w) == w.maxlen and (z := robust_z(w, x)) is not None and abs(z) > self.z:
                out.append({"event": "anomaly", "step": step, "signal": signal, "value": x, "z": z})
            w.append(x)
        return out
