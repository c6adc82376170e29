"""A trainer's peak memory and whether the kernel's OOM killer ended it.

Memory comes from psutil. OOM-kill evidence comes from the trainer's memory cgroup, which
psutil does not read: its kill counter is sampled while the trainer runs (after it dies,
/proc no longer says which group it was in) and compared when it exits with SIGKILL.
- cgroup v1: `memory.oom_control` (its `oom_kill` counts this group only),
  `memory.limit_in_bytes`, `memory.max_usage_in_bytes`;
- cgroup v2: `memory.events.local` (this group only: a kill in a sibling group must not
  count), `memory.max`, `memory.peak`;
- no memory cgroup: /proc/vmstat `oom_kill`, host-wide, the weakest evidence.

`limited_group` makes a group of the agent's own for one rank (the spec's
`chaos.memory_limit`): the trainer joins it as it starts (worker/agent/zygote.py), so the
OOM killer can pick nothing else there, and a kill counted there is that rank's.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from worker.peak_rss import high_water_mark

V1_ROOT = Path("/sys/fs/cgroup/memory")
V2_ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
# file names per cgroup version: (kill counter, limit, peak)
FILES = {
    False: ("memory.oom_control", "memory.limit_in_bytes", "memory.max_usage_in_bytes"),
    True: ("memory.events.local", "memory.max", "memory.peak"),
}
VMSTAT = Path("/proc/vmstat")


def _number(path: Path, key: str | None = None) -> int | None:
    """The file's first number, or the N of its `key N` line."""
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if key is None:
                return int(k)
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return None


def memory_cgroup(pid: int) -> tuple[Path | None, bool]:
    """The directory of `pid`'s memory cgroup and whether it is cgroup v2."""
    try:
        lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    except OSError:
        return None, False
    entries = [line.split(":", 2) for line in lines]
    # v1 first: where a v1 memory hierarchy is mounted, it is the one that limits
    for _, controllers, path in entries:
        if (
            "memory" in controllers.split(",")
            and (V1_ROOT / path.lstrip("/") / FILES[False][0]).exists()
        ):
            return V1_ROOT / path.lstrip("/"), False
    for hierarchy, _, path in entries:
        for root in V2_ROOTS if hierarchy == "0" else ():
            if (root / path.lstrip("/") / FILES[True][0]).exists():
                return root / path.lstrip("/"), True
    return None, False


def limited_group(name: str, limit: int) -> tuple[Path, bool]:
    """A new memory cgroup `name` under this process's own, limited to `limit` bytes with no
    swap beyond it (so the limit ends in an OOM kill, not in swapping), and whether it is v2.
    OSError where none can be made: no memory controller here, or not ours to write."""
    parent, v2 = memory_cgroup(os.getpid())
    if parent is None:
        raise OSError("this host has no memory cgroup controller")
    group = parent / name
    group.mkdir(exist_ok=True)
    if not (group / FILES[v2][1]).exists():
        group.rmdir()
        raise OSError(f"{parent} does not delegate the memory controller to its children")
    (group / FILES[v2][1]).write_text(str(limit))
    # v1 wants memory+swap >= memory, v2 swap alone; absent where the kernel has no swap
    # accounting, and then there is nothing to turn off
    swap = ("memory.swap.max", "0") if v2 else ("memory.memsw.limit_in_bytes", str(limit))
    with contextlib.suppress(OSError):
        (group / swap[0]).write_text(swap[1])
    return group, v2


@dataclass
class MemoryWatch:
    peak: int = 0  # bytes: the process's own high-water mark; the cgroup's peak after an OOM kill
    group: Path | None = None
    v2: bool = False
    kills_at_start: int | None = None  # the group's (or host's) OOM kills when first seen
    limit: int | None = None
    pinned: bool = False  # the group was made for this rank alone: never re-baselined

    def pin(self, group: Path, v2: bool) -> None:
        """Count the OOM kills of `group` (`limited_group`), which the trainer joins as it
        starts: a sample taken before that, with the trainer still in the group it was forked
        in, must not replace it."""
        self._count_from(group, v2)
        self.pinned = True

    def release(self) -> None:
        """Remove a pinned group once its trainer is gone (a group with a process in it, or
        one already gone, stays as it is)."""
        if self.pinned and self.group is not None:
            with contextlib.suppress(OSError):
                self.group.rmdir()

    def sample(self, process: psutil.Process) -> None:
        # The kernel's high-water mark catches a spike between two of the agent's ticks that
        # a sampled RSS would miss, and less the pages shared with the zygote it is the
        # trainer's own (psutil's RSS counts those: 8x a small rank's); an OOM kill in a
        # limited group reads the group's own peak instead.
        try:
            # a zombie (dead, not yet reaped) may no longer show its group: re-baselining on
            # it would hide the OOM kill that just ended it
            if process.status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.Error:
            return
        self.peak = max(self.peak, high_water_mark(process.pid) or 0)
        self.baseline(process.pid)

    def baseline(self, pid: int) -> None:
        """Count the OOM kills of `pid`'s memory cgroup from now on. Called with the process
        a trainer is about to be forked from (it starts in that group), since a forked
        trainer can allocate, and be killed, before the agent first sees it."""
        if self.pinned:
            return
        group, v2 = memory_cgroup(pid)
        if group is not None and group != self.group:  # first seen, or moved into another group
            self._count_from(group, v2)
        elif self.group is None and self.kills_at_start is None:
            self.kills_at_start = self._kills()

    def _count_from(self, group: Path, v2: bool) -> None:
        self.group, self.v2 = group, v2
        self.kills_at_start = self._kills()
        limit = _number(group / FILES[v2][1])  # v1 "no limit" is a huge number, v2 "max"
        self.limit = limit if limit and limit < 1 << 60 else None

    def _kills(self) -> int | None:
        if self.group is None:
            return _number(VMSTAT, "oom_kill")
        return _number(self.group / FILES[self.v2][0], "oom_kill")

    def oom_killed(self) -> dict[str, Any] | None:
        """The evidence of an OOM kill since the first sample (RankReport.oom), or None."""
        now = self._kills()
        if now is None or self.kills_at_start is None or now <= self.kills_at_start:
            return None
        if self.group is not None and self.limit:
            self.peak = max(self.peak, _number(self.group / FILES[self.v2][2]) or 0)
        return {
            "peak_rss": self.peak or None,
            "limit": self.limit,
            "cgroup": str(self.group) if self.group else None,
            "evidence": "memory cgroup oom_kill" if self.group else "host /proc/vmstat oom_kill",
        }
