"""Launch the real trainer (its ranks started by tests/rankrun.py, the torchrun environment
without torchrun's launcher) and read back its per-step metrics.

Runs that are waited for (`run_ranks`, `run_trainer`, `train`) are forked by one rankrun
server per test process (`RankServer`), which imported the trainer once; a run that a test
kills as a node failure would (`start_trainer`) is a launcher process of its own."""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from services.procs import descendants

ROOT = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    "OMP_NUM_THREADS": "1",
}
# What decides the numbers (`eval` those it reports). Not `checkpoint`: saving never changes
# what is trained, and the tests hold it to that (a job that saved, was killed and resumed
# matches a run that never saved).
TRAINING = ("model", "data", "parallel", "train", "eval")


def training_key(spec: dict) -> str:
    """Runs with equal keys train the same numbers."""
    return json.dumps({k: spec.get(k) for k in TRAINING}, sort_keys=True)


def write_spec(spec: dict, directory: Path, name: str = "job.yaml") -> Path:
    path = directory / name
    path.write_text(yaml.safe_dump(spec))
    return path


class RankServer:
    """`python -m tests.rankrun --serve -m worker.trainer`, started on first use and stopped
    with the test process: every waited-for run of the session is forked from it, so the
    session imports torch and the trainer once instead of once per run."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.log = Path(tempfile.mkdtemp(prefix="rankrun-")) / "server.log"

    def _started(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.rankrun", "--serve", "-m", "worker.trainer"],
                cwd=ROOT,
                env=ENV,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.log.open("a"),
                text=True,
            )
            atexit.register(self.proc.kill)
            self._reply("ready", 120)
        return self.proc

    def _reply(self, key: str, timeout: float) -> int | None:
        """The server's next answer's `key`; None once `timeout` passed without one."""
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"the rankrun server exited:\n{self.log.read_text()[-4000:]}")
        return json.loads(line)[key]

    def run(
        self, world: int, module: str, args: Sequence[str], timeout: float
    ) -> subprocess.CompletedProcess:
        """`world` ranks of `python -m module args`, waited for; a run past `timeout` is
        killed and raises subprocess.TimeoutExpired, as subprocess.run would."""
        proc = self._started()
        out = Path(tempfile.mkdtemp(prefix="rankrun-"))
        order = {"world": world, "module": module, "args": list(args), "cwd": str(ROOT)}
        order |= {"out": str(out / "stdout"), "err": str(out / "stderr")}
        proc.stdin.write(json.dumps(order) + "\n")
        proc.stdin.flush()
        launcher = self._reply("pid", 30)
        code = self._reply("code", timeout)
        if code is None:  # the launcher's session: its ranks die with it (PDEATHSIG)
            os.killpg(launcher, signal.SIGKILL)
            self._reply("code", 30)
            raise subprocess.TimeoutExpired(module, timeout)
        return subprocess.CompletedProcess(
            [module, *args], code, (out / "stdout").read_text(), (out / "stderr").read_text()
        )


_server = RankServer()


def run_ranks(
    world: int, module: str, args: Sequence[str] = (), timeout: float = 300
) -> subprocess.CompletedProcess:
    """`world` local ranks of `python -m module args` (tests/rankrun.py), run to the end."""
    return _server.run(world, module, args, timeout)


def scenario_lines(proc: subprocess.CompletedProcess) -> dict[str, list[dict]]:
    """The JSON lines a rank-side test module printed (`scenario`, `rank`, ...): scenario ->
    its rows in rank order."""
    out: dict[str, list[dict]] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            out.setdefault(r["scenario"], []).append(r)
    for rows in out.values():
        rows.sort(key=lambda r: r["rank"])
    return out


def rank_scenarios(
    world: int, module: str, expected: Sequence[str], args: Sequence[str] = (), timeout=120.0
) -> dict[str, list[dict]]:
    """A rank-side test module run on `world` ranks to the end: its scenario lines, which must
    name exactly the `expected` scenarios."""
    proc = run_ranks(world, module, args, timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = scenario_lines(proc)
    assert sorted(out) == sorted(expected), proc.stdout[-2000:]
    return out


def trainer_args(spec: dict, directory: Path, extra: Sequence[str] = ()) -> tuple[int, list[str]]:
    """(world size, the trainer's arguments): rank 0's metrics go to directory/steps.jsonl."""
    directory.mkdir(parents=True, exist_ok=True)
    p = spec.get("parallel", {})
    world = p.get("dp", 1) * p.get("pp", 1) * p.get("tp", 1)
    metrics = str(directory / "steps.jsonl")
    spec_file = str(write_spec(spec, directory))
    return world, ["--spec", spec_file, "--metrics-out", metrics, "--quiet", *extra]


def trainer_command(spec: dict, directory: Path, extra: Sequence[str] = ()) -> list[str]:
    """The trainer's ranks as a launcher process of their own (tests/rankrun.py, torchrun's
    argument order)."""
    world, args = trainer_args(spec, directory, extra)
    rankrun = [sys.executable, "-m", "tests.rankrun", f"--nproc-per-node={world}"]
    return [*rankrun, "-m", "worker.trainer", *args]


def run_trainer(
    spec: dict, directory: Path, *, extra: list[str] = (), timeout: float = 300, fresh: bool = True
) -> subprocess.CompletedProcess:
    if fresh:
        (directory / "steps.jsonl").unlink(missing_ok=True)
    world, args = trainer_args(spec, directory, extra)
    proc = run_ranks(world, "worker.trainer", args, timeout)
    if proc.returncode != 0:
        # the launcher names the first rank that failed; its own lines get lost behind the others'
        first = "\n".join(line for line in proc.stderr.splitlines() if line.startswith("[rank0]"))[
            -3000:
        ]
        raise AssertionError(
            f"trainer failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
            f"rank 0:\n{first}\nlast lines:\n{proc.stderr[-6000:]}"
        )
    return proc


def train(
    spec: dict, directory: Path, *, extra: list[str] = (), timeout: float = 300
) -> list[dict]:
    """Run the spec to the end; return rank 0's step records."""
    run_trainer(spec, directory, extra=extra, timeout=timeout)
    # one metrics file for every rank: no shared collective-counter file (each rank truncating
    # the one the others had mapped killed ranks with SIGBUS; worker/trainer/main.py)
    assert not (directory / "steps.jsonl.collectives").exists()
    return step_records(directory)


def start_trainer(spec: dict, directory: Path, extra: list[str] = ()) -> subprocess.Popen:
    """Start in its own session, so `kill_all` can SIGKILL every rank at once."""
    directory.mkdir(parents=True, exist_ok=True)
    log = (directory / "run.log").open("a")
    return subprocess.Popen(
        trainer_command(spec, directory, extra),
        cwd=ROOT,
        env=ENV,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def kill_all(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher and every rank at once, as a node failure would."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def wait_for(
    what: str, predicate: Callable[[], bool], proc: subprocess.Popen, timeout: float = 240
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"trainer exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            kill_all(proc)
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def read_records(directory: Path) -> list[dict]:
    path = directory / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def step_records(directory: Path) -> list[dict]:
    return [r for r in read_records(directory) if "step" in r and "event" not in r]


def summary(directory: Path) -> dict:
    return next(r for r in read_records(directory) if r.get("event") == "done")
