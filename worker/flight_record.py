"""A rank's flight-recorder dump: where its trainer has torch write it, and what its agent reads
from it for the controller's blame (controller/aborts.py).

torch's flight recorder keeps each rank's last collectives (TORCH_FR_BUFFER_SIZE entries, 2000
by default) with their sequence number in their process group and their state: `scheduled`
(queued by the host), `started` (its kernel began on the device), `completed`. On CUDA the
trainer sets TORCH_NCCL_DUMP_ON_TIMEOUT=1 and the dump's path (worker/trainer/distributed.py),
so the NCCL watchdog writes the entries, pickled, to `flight-rank<global rank>` in the rank's
run directory before it aborts the process on a timeout. The agent of a rank that died of that
abort reads it (`summarize`): per process group, the last collective that completed and the
first that did not, with its state. Host-side collective counters cannot tell a rank whose GPU
is stuck in a kernel from its peers: its host queued the same collectives. The dump can: that
rank's next collective never started on its device, the others' did and waited for it.

Only collectives are summarized; point-to-point sends and receives (the pipeline's) count per
pair, not per group. The dump is read with an unpickler that builds plain containers and
scalars only, so a file in the run directory cannot run code in the agent. This module imports
neither torch nor anything that does: the agent never imports torch.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

DUMP_NAME = "flight-rank"  # torch appends the global rank
MAX_DUMP_BYTES = 64 << 20  # 2000 entries with their stack frames are a few MB


def dump_prefix(metrics: Path) -> Path:
    """What TORCH_FR_DUMP_TEMP_FILE names for the rank whose metrics file is `metrics`."""
    return metrics.parent / DUMP_NAME


def dump_path(metrics: Path, rank: int) -> Path:
    return metrics.parent / f"{DUMP_NAME}{rank}"


class _PlainData(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name} is not plain data")


def summarize(path: Path) -> dict[str, dict[str, Any]] | None:
    """Per process group (its name, the same on every rank): `completed` (the last collective
    sequence number that completed, 0 for none), `pending` (the first that did not, or None),
    `state` and `op` (that one's state and torch's name for it), `desc` (the group's
    description). None when there is no dump or it cannot be read."""
    try:
        if path.stat().st_size > MAX_DUMP_BYTES:
            return None
        dump = _PlainData(io.BytesIO(path.read_bytes())).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError):
        return None
    entries = dump.get("entries") if isinstance(dump, dict) else None
    if not isinstance(entries, list):
        return None
    groups: dict[str, dict[str, Any]] = {}
    for e in sorted(
        (e for e in entries if isinstance(e, dict) and not e.get("is_p2p")),
        key=lambda e: e.get("collective_seq_id", 0),
    ):
        name, desc = (list(e.get("process_group") or ("?", "")) + [""])[:2]
        g = groups.setdefault(
            str(name), {"desc": str(desc), "completed": 0, "pending": None, "state": None}
        )
        seq = int(e.get("collective_seq_id", 0))
        if e.get("retired") or e.get("state") == "completed":
            g["completed"] = max(g["completed"], seq)
        elif g["pending"] is None:
            g.update(pending=seq, state=e.get("state"), op=e.get("profiling_name"))
    return groups
