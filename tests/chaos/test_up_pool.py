"""`meshkeeper up` behaves like a pool (cli/local_stack.py; docs/architecture.md, "Running
it"; issue 15): a real Prometheus finds every agent through the controller's HTTP service
discovery, and an agent SIGKILLed together with its trainers, as a lost host, never stops the
stack: the controller recovers its rank onto the spare, the job finishes with the exact loss,
and `up` starts a fresh agent under a new worker id, which joins the free pool.

The chaos suite's one `up --workers 3` (tests/chaos/conftest.py) serves both tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import httpx
import psutil
import pytest
import yaml

from cli.local_stack import snapshot_root
from services.procs import descendants, free_port
from tests.chaos.chaos import (
    assert_curve,
    at_step,
    mesh_spec,
    metrics_path,
    rank,
    start,
    succeeded,
    wait_record,
)
from tests.chaos.conftest import UP_WORKERS
from tests.chaos.upstack import UpStack
from tests.stack import ROOT, wait_until

pytestmark = pytest.mark.slow

PROMETHEUS = ROOT / ".tools" / "bin" / "prometheus"  # scripts/install-promtool.sh


def prometheus_config(up: UpStack) -> dict:
    """Workers only, found through the controller with the scrape token (as
    deploy/prometheus/prometheus.yml), refreshed every second instead of every 15."""
    return {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [
            {
                "job_name": "meshkeeper-worker",
                "http_sd_configs": [
                    {
                        "url": f"{up.url}/v1/sd/workers",
                        "refresh_interval": "1s",
                        "authorization": {
                            "type": "Bearer",
                            "credentials_file": str(up.scrape_token_file),
                        },
                    }
                ],
            }
        ],
    }


def test_prometheus_finds_every_agent_of_up_through_http_sd(up, tmp_path):
    assert PROMETHEUS.exists(), "run scripts/install-promtool.sh (make test does)"
    config = tmp_path / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(up)))
    port = free_port()
    with open(tmp_path / "prometheus.log", "wb") as log:
        prom = subprocess.Popen(
            [
                str(PROMETHEUS),
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        agents = {w.id for w in up.client.workers() if w.alive}
        assert len(agents) == UP_WORKERS

        def healthy_targets() -> set[str] | None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/api/v1/targets?state=active", timeout=2)
            except httpx.TransportError:
                return None  # not listening yet
            if r.status_code != 200:  # listening, not ready yet: "Service Unavailable", no JSON
                return None
            targets = r.json()["data"]["activeTargets"]
            up_ = {t["labels"]["worker"] for t in targets if t["health"] == "up"}
            return up_ if up_ == agents else None

        wait_until(
            healthy_targets,
            60,
            f"Prometheus to scrape every agent {sorted(agents)} "
            f"(log: {tmp_path / 'prometheus.log'})",
        )
    finally:
        prom.terminate()
        prom.wait(10)


def test_agent_killed_with_its_trainers_is_replaced_by_a_fresh_spare(up, uninterrupted):
    spec = mesh_spec("up-agent", parallel={"dp": 2})  # one spare: the third worker
    want = uninterrupted(spec)
    before = {w.id for w in up.client.workers()}
    w, j1 = start(up, spec)
    victim, spare = rank(j1, 1), j1.mesh.spares[0]
    wait_record(metrics_path(up, j1, 1), at_step(8), 120, "rank 1 at step 8")
    agent = up.agent_pid(victim.worker)
    assert agent, f"no agent {victim.worker} under meshkeeper up:\n{up.logs()}"
    for pgid in (agent, victim.pid):  # the host is lost: its agent and trainers at once
        os.killpg(pgid, signal.SIGKILL)

    j = w.finish()
    succeeded(up, j)
    assert [(r.cause, r.action) for r in j.recoveries] == [("WorkerDead", "replace")], j.recoveries
    assert j.recoveries[0].replaced == [{"old": victim.worker, "new": spare}]
    assert_curve(up, j, want, exact=True)

    fresh = wait_until(
        lambda: [x for x in up.client.workers() if x.alive and x.id not in before] or None,
        60,
        "a fresh agent to join",
    )
    assert [(x.id, x.state, x.job) for x in fresh] == [(f"w{len(before)}", "idle", None)], fresh
    assert f"{victim.worker} exited (code -9)" in up.log.read_text(), up.logs()
    assert up.proc.poll() is None, up.logs()  # the stack lives on


def test_a_failed_ranks_own_words_reach_the_jobs_status(up):
    """A trainer that exits 2 (its token file is too short for one sample) fails the job;
    the job's status carries what the trainer printed before it died (the tail of its log,
    read by its agent), not only where that log lies on the worker; the agent's own output
    carries every line the trainer printed, and `meshkeeper logs` shows them to a viewer."""
    short = up.work / "data" / "short.bin"
    short.write_bytes(b"abcd")  # 2 uint16 tokens
    spec = mesh_spec("short-data", parallel={"dp": 1}, spares=0) | {
        "data": {"source": f"tokens:{short}"}
    }
    jid = up.client.submit(spec).id
    j = wait_until(
        lambda: (j := up.client.job(jid)).phase in ("Failed", "Succeeded") and j, 120, "the end"
    )
    assert j.phase == "Failed", j.conditions
    said = "data.source: the training data holds 2 tokens, fewer than seq_len+1"
    assert said in j.condition("Failed").message, j.condition("Failed")
    [r] = j.mesh.ranks
    assert r.exit_code == 2 and said in (r.error or ""), r
    # and on its agent's own output, prefixed, as `kubectl logs` would show it
    agent_log = up.work / "logs" / f"worker-{r.worker}.log"
    echoed = f"[{jid} g1 rank 0] meshkeeper: {said}"
    wait_until(lambda: echoed in agent_log.read_text(), 10, f"{echoed!r} in {agent_log}")
    # and through the controller to anyone with the viewer role: `meshkeeper logs`
    env = {
        **os.environ,
        "MESHKEEPER_URL": up.url,
        "MESHKEEPER_TOKEN_FILE": str(up.work / "secrets" / "viewer-token"),
    }
    env.pop("MESHKEEPER_TOKEN", None)

    def logs(*extra: str) -> str:
        cli = subprocess.run(
            [sys.executable, "-m", "cli", "logs", jid, "--rank", "0", *extra],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr
        return cli.stdout

    line = f"[rank 0 g1] meshkeeper: {said}"
    wait_until(lambda: line in logs(), 20, f"{line!r} from meshkeeper logs")
    tail = logs("--tail", "1").splitlines()  # its last words alone
    assert len(tail) == 1 and tail[0].startswith(line), tail


def test_each_up_keeps_its_snapshots_in_host_memory_of_its_own(up, tmp_path):
    """Two stacks on one host name their workers alike (w0, w1, ...) and an agent prunes what
    is not its own under its snapshot root: each stack's agents get a root of their own."""

    def cmdline(pid: int) -> list[str]:
        with contextlib.suppress(psutil.Error):  # a trainer exiting meanwhile
            return psutil.Process(pid).cmdline()
        return []

    agents = [
        argv for pid in descendants(up.proc.pid) if (argv := cmdline(pid))[1:3] == ["-m", "worker"]
    ]
    assert len(agents) == UP_WORKERS, agents
    roots = {argv[argv.index("--snapshot-dir") + 1] for argv in agents}
    assert roots == {str(snapshot_root(up.work))}, roots
    assert snapshot_root(tmp_path / "another-run") != snapshot_root(up.work)
