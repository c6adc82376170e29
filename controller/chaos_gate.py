"""Who may submit fault injection (docs/security.md, "Fault injection").

A spec's `chaos` section corrupts training on purpose (bit flips in a rank's state,
docs/fault-tolerance.md, "Silent data corruption"). It is admitted only when both hold:
  - the controller was started with `--allow-chaos` (a test cluster's operator opted in;
    otherwise 422: no token can make this controller accept it);
  - the caller's token has role admin (otherwise 403: a submitter could corrupt the jobs of
    a shared pool's workers, and quarantine healthy ones through the blame that follows).
The role is judged first, as for every route: a non-admin learns nothing about the
controller's flags.
"""

from __future__ import annotations

from dataclasses import dataclass

from controller.auth import Principal
from services.spec import JobSpec, Problem


@dataclass(frozen=True)
class Refusal:
    status: int  # 403 or 422
    detail: str
    problem: Problem


def chaos_refusal(spec: JobSpec, who: Principal, allowed: bool) -> Refusal | None:
    """Why `who` may not submit `spec` to a controller with `--allow-chaos` = `allowed`;
    None when the spec has no `chaos` or both conditions hold."""
    if spec.chaos is None:
        return None
    if not who.admin:
        return Refusal(
            403,
            f"token {who.name!r} (role {who.role}) may not inject faults",
            Problem(
                "chaos",
                "fault injection needs an admin token; remove chaos from the spec, or submit "
                "it with an admin token",
            ),
        )
    if not allowed:
        return Refusal(
            422,
            "this controller does not accept fault injection",
            Problem(
                "chaos",
                "the controller was started without --allow-chaos; remove chaos from the "
                "spec, or run a controller meant for such tests with --allow-chaos "
                "(`meshkeeper up --allow-chaos`)",
            ),
        )
    return None
