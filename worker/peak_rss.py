"""A process's peak resident set: the kernel's high-water mark, read by the agent for each
trainer and by the trainer for its own step records (docs/architecture.md, "Records")."""

from __future__ import annotations


def high_water_mark(pid: int | str = "self") -> int | None:
    """Bytes: VmHWM in /proc/{pid}/status (kB there); None where it cannot be read.

    Not getrusage's ru_maxrss: Linux carries that across execve, so a trainer started by a
    bigger process reports its parent's peak (a 13 MiB child of an 800 MiB Python process
    read 810 MiB), while VmHWM belongs to the process's own address space.
    """
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
