"""A process's own resident pages, at their peak and now, read by the agent for each trainer
(its memory watch, its /metrics) and by the trainer for its own step records
(docs/architecture.md, "Records")."""

from __future__ import annotations


def _kib_fields(path: str, keys: tuple[str, ...]) -> dict[str, int] | None:
    """Those `Key:  N kB` lines of a /proc file, in bytes; None where it cannot be read."""
    try:
        with open(path) as f:
            got = {
                k: int(v.split()[0]) * 1024
                for k, _, v in (ln.partition(":") for ln in f)
                if k in keys
            }
    except (OSError, ValueError, IndexError):
        return None
    return got if len(got) == len(keys) else None


def high_water_mark(pid: int | str = "self") -> int | None:
    """Bytes: the process's own peak resident set; None where /proc cannot say.

    The kernel's high-water mark (VmHWM in /proc/{pid}/status) less the resident pages the
    process shares with others now (Shared_Clean + Shared_Dirty in smaps_rollup). A trainer
    forked from the zygote starts with the zygote's resident pages (torch, ~200 MiB) counted
    in its RSS, and so in VmHWM: a rank that allocated 30 MiB read 230 MiB, about 8x. Pages
    still shared (the zygote's, the libraries') were never its own; a page it wrote is a
    private copy and counts. After the fork shared pages mostly become private, not the other
    way, so what is shared now was shared at the peak too: the difference is the peak of the
    process's own pages (an upper bound where that does not hold).

    Not getrusage's ru_maxrss: Linux carries that across execve, so a trainer started by a
    bigger process reports its parent's peak (a 13 MiB child of an 800 MiB Python process
    read 810 MiB).
    """
    status = _kib_fields(f"/proc/{pid}/status", ("VmHWM",))
    shared = _kib_fields(f"/proc/{pid}/smaps_rollup", ("Shared_Clean", "Shared_Dirty"))
    if status is None or shared is None:
        return None
    return max(0, status["VmHWM"] - shared["Shared_Clean"] - shared["Shared_Dirty"])


def own_resident(pid: int | str = "self") -> int | None:
    """Bytes: the process's own resident pages now (Rss less Shared_Clean and Shared_Dirty in
    smaps_rollup: its private pages, psutil's "uss"), what `high_water_mark` peaks at; None
    where /proc cannot say (the process exited). Its RSS would count the zygote's pages in
    every rank forked from it."""
    got = _kib_fields(f"/proc/{pid}/smaps_rollup", ("Rss", "Shared_Clean", "Shared_Dirty"))
    if got is None:
        return None
    return max(0, got["Rss"] - got["Shared_Clean"] - got["Shared_Dirty"])
