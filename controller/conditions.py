"""Kubernetes-style job conditions and the phase derived from them.

A condition is {type, status "True"/"False", reason (CamelCase), message, lastTransitionTime};
the time moves only when the status flips, as in Kubernetes.
"""

from __future__ import annotations

TYPES = (
    "Admitted",
    "Running",
    "Recovering",
    "Suspended",
    "Preempted",  # it stopped for a higher-priority job; history, not a phase
    "Succeeded",
    "Failed",
    "Cancelled",
)
TERMINAL = ("Succeeded", "Failed", "Cancelled")
PHASES = ("Pending", "Running", "Recovering", "Suspended", *TERMINAL)


def set_condition(
    conds: list[dict], type_: str, status: bool, reason: str, message: str, now: float
) -> bool:
    """Set one condition in place; returns whether anything changed."""
    assert type_ in TYPES, type_
    st = "True" if status else "False"
    for c in conds:
        if c["type"] == type_:
            if (c["status"], c["reason"], c["message"]) == (st, reason, message):
                return False
            if c["status"] != st:
                c["lastTransitionTime"] = now
            c.update(status=st, reason=reason, message=message)
            return True
    conds.append(
        {
            "type": type_,
            "status": st,
            "reason": reason,
            "message": message,
            "lastTransitionTime": now,
        }
    )
    return True


def condition(conds: list[dict], type_: str) -> dict | None:
    return next((c for c in conds if c["type"] == type_), None)


def phase_of(conds: list[dict]) -> str:
    def true(t: str) -> dict | None:
        c = condition(conds, t)
        return c if c and c["status"] == "True" else None

    if true("Succeeded"):
        return "Succeeded"
    if true("Cancelled"):
        return "Cancelled"
    failed = true("Failed")
    if failed:
        # a job cancelled before `Cancelled` was a condition of its own, as Redis still holds it
        return "Cancelled" if failed["reason"] == "Cancelled" else "Failed"
    if true("Suspended"):  # holds no workers until resumed (controller/suspending.py)
        return "Suspended"
    if true("Recovering"):
        return "Recovering"
    if true("Running"):
        return "Running"
    return "Pending"
