"""Recovery records -> histograms: fault detection, total recovery time, and each phase.

The recovery loop appends one record per recovery to the job's `recoveries` field
(cause, detected_at, action, replaced, steps_lost, durations {detect_s, decide_s,
rendezvous_s, restore_s, first_step_s, total_s}). Each record is observed once, when it is
complete (has durations.total_s), and only by the lease holder, so two replicas never
count one recovery twice. Histograms carry the cause or the phase, never a job or a rank.
"""

from __future__ import annotations

from prometheus_client import Histogram

from services.records import RecoveryRecord

DETECT_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120)
RECOVERY_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)  # alert bound: 120
PHASES = ("decide", "rendezvous", "restore", "first_step")


class RecoveryFeed:
    def __init__(self):
        self.detect = Histogram(
            "meshkeeper_fault_detection_seconds",
            "From a fault to its detection, per recovery",
            ["cause"],
            registry=None,
            buckets=DETECT_BUCKETS,
        )
        self.total = Histogram(
            "meshkeeper_recovery_duration_seconds",
            "From the fault to the first step of the new generation (the record's total_s)",
            ["cause"],
            registry=None,
            buckets=RECOVERY_BUCKETS,
        )
        self.phase = Histogram(
            "meshkeeper_recovery_phase_duration_seconds",
            "Each phase of a recovery (decide, rendezvous, restore, first_step)",
            ["phase"],
            registry=None,
            buckets=RECOVERY_BUCKETS,
        )
        self._seen: dict[str, set[str]] = {}  # job id -> keys of the records observed

    @property
    def tracked(self) -> set[str]:
        return set(self._seen)

    def feed(self, records: dict[str, list[RecoveryRecord]], still_open: set[str]) -> None:
        """Observe new complete records; stop tracking jobs that are no longer open (their
        last records are fed here once more, so a job that ended between scrapes loses none)."""
        for jid, recs in records.items():
            seen = self._seen.setdefault(jid, set())
            for rec in recs:
                key, durations = str(rec.detected_at), rec.durations
                if key in seen or durations is None or _sec(durations, "total_s") is None:
                    continue  # seen already, or not complete yet
                seen.add(key)
                self._observe(rec.cause, durations)
        for jid in set(self._seen) - still_open:
            del self._seen[jid]

    def _observe(self, cause: str, d: dict[str, float]) -> None:
        self.total.labels(cause).observe(_sec(d, "total_s"))
        if (v := _sec(d, "detect_s")) is not None:
            self.detect.labels(cause).observe(v)
        for phase in PHASES:
            if (v := _sec(d, f"{phase}_s")) is not None:
                self.phase.labels(phase).observe(v)

    def collect(self):
        for h in (self.detect, self.total, self.phase):
            yield from h.collect()


def _sec(d: dict[str, float], key: str) -> float | None:
    v = d.get(key)
    return float(v) if v is not None and v >= 0 else None
