"""The trainer zygote (worker/agent/zygote.py) forks every trainer it is asked for, and each
one runs as the agent's own child."""

from __future__ import annotations

import os
import subprocess
import time

from worker.agent.launcher import Launcher

RANKS = 32


def test_every_forked_trainer_runs_even_when_its_middle_child_is_gone_first(tmp_path):
    """The middle child exits as soon as it has forked; a trainer scheduled after that already
    has the agent as its parent. Each must still start: about one in eight once waited forever
    for a re-parenting that had already happened, and its rank never reached the rendezvous."""
    launcher, kids = Launcher(tmp_path, 1, dict(os.environ)), []
    try:
        launcher.refill()
        assert launcher.ready(timeout_s=60), (tmp_path / "zygote.log").read_text()
        for r in range(RANKS):  # `--help`: the trainer's main prints its usage and exits 0
            kids.append(launcher.launch(["--help"], {"RANK": str(r)}, tmp_path / f"rank{r}.log"))
        deadline = time.monotonic() + 60  # a loaded 2-core host forks 32 in a few seconds
        while any(k.poll() is None for k in kids) and time.monotonic() < deadline:
            time.sleep(0.05)
        stuck = [r for r, k in enumerate(kids) if k.poll() is None]
        assert not stuck, f"ranks {stuck} never started"
        assert [k.returncode for k in kids] == [0] * RANKS
        for r in range(RANKS):
            assert f"forked for rank {r}\n" in (tmp_path / f"rank{r}.log").read_text()
    finally:
        for k in kids:
            if k.poll() is None:
                os.kill(k.pid, 9)
                k.wait()
        launcher.close()


def test_a_rank_launched_while_the_zygote_still_imports_starts_cold(tmp_path):
    """A fresh agent's zygote takes seconds to import torch; a launch in that window must not
    wait for it (the agent's loop would stop: beats at the wrong interval, withdrawals
    ignored). The rank starts as its own interpreter, and once the zygote is ready the next
    one is forked."""
    launcher = Launcher(tmp_path, 1, dict(os.environ))
    try:
        first = launcher.launch(["--help"], {"RANK": "0"}, tmp_path / "rank0.log")
        assert isinstance(first, subprocess.Popen), "the launch waited for the zygote"
        assert first.wait(timeout=60) == 0
        assert "forked for rank" not in (tmp_path / "rank0.log").read_text()
        assert launcher.ready(timeout_s=60), (tmp_path / "zygote.log").read_text()
        second = launcher.launch(["--help"], {"RANK": "1"}, tmp_path / "rank1.log")
        assert not isinstance(second, subprocess.Popen)
        deadline = time.monotonic() + 30
        while second.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert second.returncode == 0
        assert "forked for rank 1\n" in (tmp_path / "rank1.log").read_text()
    finally:
        launcher.close()
