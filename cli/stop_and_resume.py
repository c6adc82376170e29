"""Stopping `meshkeeper up` without costing its jobs anything (docs/architecture.md, "Running
it"): before the processes stop, every open job is suspended (it commits a step and frees its
workers: controller/suspending.py) and listed in `{run_dir}/suspended-by-up.json`; the next
`up` on that run dir resumes exactly those. A job resumed this way restores the step it
committed, with no restart counted and no re-plan. Jobs a user suspended stay suspended.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from services.client import ApiError, Client

LISTED = "suspended-by-up.json"
OPEN = ("Pending", "Running", "Recovering")
# past preemption.grace_s's default (120 s) the controller stops a job that has not committed
WAIT_S = 150.0


def suspend_open_jobs(c: Client, run_dir: Path, say: Callable[[str], None]) -> None:
    """Ask every open job to suspend, list them for the next `up`, and wait (at most WAIT_S)
    until each is Suspended or ended. A second Ctrl-C stops at once: the jobs then recover
    from their last commit."""
    try:
        jobs = [j.id for j in c.jobs(limit=1000) if j.phase in OPEN]
    except ApiError as e:
        say(f"meshkeeper up: could not list the jobs to suspend ({e}); stopping anyway")
        return
    if not jobs:
        return
    asked = []
    for jid in jobs:
        try:
            c.suspend(jid)
            asked.append(jid)
        except ApiError as e:  # it ended meanwhile
            say(f"meshkeeper up: {jid} not suspended: {e}")
    (run_dir / LISTED).write_text(json.dumps(asked))
    say(
        f"meshkeeper up: suspending {len(asked)} job(s) so that the next `meshkeeper up` resumes "
        "them where they stop (each commits a step first; Ctrl-C again stops at once)"
    )
    deadline = time.monotonic() + WAIT_S
    while waiting := [j for j in asked if c.job(j).phase in OPEN]:
        if time.monotonic() > deadline:
            say(
                f"meshkeeper up: {', '.join(waiting)} did not suspend in {WAIT_S:.0f} s: they "
                "resume from their last commit"
            )
            return
        time.sleep(0.5)
    say(f"meshkeeper up: suspended {', '.join(asked)}")


def resume_listed(c: Client, run_dir: Path, say: Callable[[str], None]) -> None:
    """Resume the jobs the last stop of `up` on this run dir suspended."""
    listed = run_dir / LISTED
    if not listed.exists():
        return
    resumed = []
    for jid in json.loads(listed.read_text()):
        try:
            c.resume(jid)
            resumed.append(jid)
        except ApiError as e:  # resumed, cancelled or deleted since
            say(f"meshkeeper up: {jid} not resumed: {e}")
    listed.unlink()
    if resumed:
        say(f"meshkeeper up: resumed {', '.join(resumed)}, suspended when it last stopped")
