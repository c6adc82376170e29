"""services/procs.py with real processes: stop_all reaches a grandchild in a session of its own
(as torchrun's ranks are) that ignores SIGTERM and outlives its parent, and descendants sees it."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from services.procs import descendants, stop_all

# A leader that starts a grandchild in a session of its own, ignoring SIGTERM, prints its pid
# and waits; the leader itself exits on SIGTERM.
LEADER = """
import subprocess, sys, time
g = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True);"
    " time.sleep(600)"], stdout=subprocess.PIPE, text=True, start_new_session=True)
g.stdout.readline()  # its SIGTERM handler is in place
print(g.pid, flush=True)
time.sleep(600)
"""


def test_stop_all_kills_the_tree_beyond_the_process_group():
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    grandchild = psutil.Process(int(leader.stdout.readline()))
    try:
        assert grandchild.pid in descendants(leader.pid)
        t0 = time.monotonic()
        assert stop_all([leader], grace_s=0.5) == []
        assert leader.returncode is not None and time.monotonic() - t0 < 10
        # the leader went on SIGTERM; the grandchild ignored it, in a session no group signal
        # reaches: only the tree taken before the SIGTERM finds it
        _, alive = psutil.wait_procs([grandchild], timeout=5)
        assert not alive, f"grandchild {grandchild.pid} survived stop_all"
    finally:
        if grandchild.is_running():
            grandchild.kill()


def test_descendants_of_a_process_that_is_gone_is_empty():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert descendants(p.pid) == []
