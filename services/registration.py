"""The typed fields of a worker's registration hash `worker:<wid>` (docs/architecture.md,
"Redis keys"). The controller writes them at join, but the hash is the agent's too (its state
and last beat live there), so a compromised or broken agent can put anything in any field. The
controller reads them only through `problems`: a malformed field makes that worker unusable,
never a reconcile pass fail (docs/security.md, "What an authenticated agent can still do")."""

from __future__ import annotations

import json

from services.planner.hardware import FABRICS


def _int_at_least(low: int):
    def check(text: str) -> str | None:
        try:
            ok = int(text) >= low
        except ValueError:
            ok = False
        return None if ok else f"not an integer >= {low}"

    return check


def _labels(text: str) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return "not JSON"
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        return "not a JSON object of strings"
    return None


def _number(text: str) -> str | None:
    try:
        float(text)
    except ValueError:
        return "not a number"
    return None


def _fabric(text: str) -> str | None:
    return None if text in FABRICS else f"not one of {', '.join(FABRICS)}"


CHECKS = {
    "devices": _int_at_least(1),
    "fabric": _fabric,
    "memory_bytes": _int_at_least(0),
    "snapshot_bytes": _int_at_least(0),
    "labels": _labels,
    "joined_at": _number,
}


def problems(fields: dict[str, str]) -> dict[str, str]:
    """field -> what is wrong with it, for each typed field present and malformed."""
    out = {}
    for name, check in CHECKS.items():
        if name in fields and (why := check(fields[name])):
            out[name] = why
    return out
