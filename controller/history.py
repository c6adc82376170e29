"""A job's training history: one `HistoryPoint` per step the reconcile pass saw completed,
kept in a Redis stream next to the job (docs/architecture.md, "Redis keys"), read back
downsampled with the job's recoveries and checkpoint commits for the mesh page's charts
(`GET /v1/jobs/{id}/history`, docs/architecture.md, "Observability").

The stream shares the job's hash tag ({jid}), so it lives in the job's Cluster slot and a
fenced transaction may write it together with the job's hash.
"""

from __future__ import annotations

from controller.jobs import Job
from services.records import HistoryPoint
from services.store import Keys, Store, Tx, loads

MAXLEN = 100_000  # about this many points per job (XADD MAXLEN ~): ~10 MB of Redis at most
READ_CHUNK = 5_000  # entries per XRANGE round trip while reading


def key(keys: Keys, jid: str) -> str:
    return f"{keys.job(jid)}:history"


def append(tx: Tx, keys: Keys, jid: str, point: HistoryPoint) -> None:
    """Add `point` to job `jid`'s history as part of `tx` (the caller commits it fenced)."""
    # not Tx.event: that trims to the events' length; the history needs its own bound
    tx.xadd(key(keys, jid), point.model_dump(), MAXLEN)


def read(store: Store, jid: str, max_points: int) -> tuple[list[HistoryPoint], int]:
    """The whole stored history of `jid`, downsampled to at most `max_points` (>= 2) points,
    and how many points are stored.

    Downsampling keeps the first and the last point; the points between are cut into
    `max_points - 2` buckets of consecutive steps, and each bucket is shown by its LAST point.
    Every point returned is a real measurement (nothing averaged or invented); a spike narrower
    than a bucket may be hidden. Fewer stored points than `max_points`: all of them, exactly.
    Read in chunks, so memory stays O(max_points) however long the job ran.
    """
    if max_points < 2:
        raise ValueError(f"max_points must be at least 2 (first and last), not {max_points}")
    k = key(store.keys, jid)
    pipe = store.r.pipeline(transaction=True)  # the length and the newest id, at one instant
    pipe.xlen(k)
    pipe.xrevrange(k, count=1)
    n, newest = pipe.execute()
    if not n:
        return [], 0
    buckets, inner = max_points - 2, n - 2  # inner points 1 .. n-2

    def bucket(i: int) -> int:
        return (i - 1) * buckets // inner

    def shown(i: int) -> bool:  # the first point, and the last point of each inner bucket
        return (
            i == 0
            or n <= max_points
            or (buckets > 0 and i < n - 1 and (i == n - 2 or bucket(i) != bucket(i + 1)))
        )

    kept: list[HistoryPoint] = []
    i, start, last, last_shown = 0, "-", None, False
    while True:
        rows = store.r.xrange(k, min=start, max=newest[0][0], count=READ_CHUNK)
        for _, fields in rows:
            last, last_shown = fields, shown(i)
            if last_shown:
                kept.append(HistoryPoint.model_validate(fields))
            i += 1
        if len(rows) < READ_CHUNK:
            break
        start = f"({rows[-1][0]}"
    if last is not None and not last_shown:  # the newest point is always shown
        kept.append(HistoryPoint.model_validate(last))
    return kept, i


def recent(store: Store, jid: str, n: int) -> list[HistoryPoint]:
    """The newest `n` points of job `jid`'s history, newest first (one XREVRANGE)."""
    return [
        HistoryPoint.model_validate(f) for _, f in store.r.xrevrange(key(store.keys, jid), count=n)
    ]


def job_history(store: Store, job: Job, max_points: int) -> dict:
    """The `api.JobHistory` document of `job`: its history downsampled to `max_points`, its
    recoveries (oldest first) and the checkpoint commits its pointer still lists."""
    points, total = read(store, job.id, max_points)
    return {
        "id": job.id,
        "points": points,
        "total_points": total,
        "recoveries": job.recoveries,
        "checkpoints": checkpoint_marks(store.checkpoint(job.id)),
    }


def checkpoint_marks(pointer: dict[str, str]) -> list[dict]:
    """The commits in a checkpoint pointer's `history` (services/scripts.py, CHECKPOINT_CAS),
    newest first, as {step, generation, time}. The script stamps the pointer's own `time`,
    which is its newest commit's; an older entry has a time only if the script recorded one."""
    marks = [
        {"step": int(e["step"]), "generation": int(e["generation"]), "time": e.get("time")}
        for e in loads(pointer.get("history"), [])
    ]
    if marks and marks[0]["time"] is None and pointer.get("time"):
        marks[0]["time"] = float(pointer["time"])
    return marks
