"""Real scrapes of a running agent and a running controller: promtool's linter passes, the
job's series are there while it runs (per rank only on gauges, never on histograms), and
they are gone once it ends."""

from __future__ import annotations

import json
import subprocess

import psutil

from tests.observability.exposition import check_metrics, families, samples, value
from tests.stack import tiny_spec, wait_until

AGENT_RANK_GAUGES = (
    "meshkeeper_rank_step_seconds",
    "meshkeeper_rank_compute_seconds",
    "meshkeeper_rank_collective_wait_seconds",
    "meshkeeper_rank_resident_memory_bytes",
    "meshkeeper_train_mfu_ratio",
)


def test_running_job_scrapes_pass_promtool_and_drop_the_job_when_it_ends(obs, promtool):
    job = obs.client.submit(
        tiny_spec("obs-scrape", train={"steps": 40}, checkpoint={"every_steps": 10})
    ).id
    status = wait_until(lambda: (j := obs.client.job(job)).mesh.ranks and j, 60, "ranks placed")
    worker = next(r.worker for r in status.mesh.ranks if r.rank == 0)

    def rank_gauges():
        text = obs.scrape(worker)
        step = samples(text, "meshkeeper_train_step_duration_seconds_count", job_id=job)
        gauges = all(samples(text, n, job_id=job, rank="0") for n in AGENT_RANK_GAUGES)
        # the gauges read the rank's last step as the scrape runs, the histogram when the
        # agent's loop has passed it on: one scrape may see the first without the second
        return text if gauges and step else None

    agent = wait_until(rank_gauges, 90, f"rank 0's gauges on {worker}")

    def both_running():
        text = obs.scrape_controller()
        running = samples(text, "meshkeeper_ranks", job_id=job, state="running")
        return text if running and running[0].value == 2 else None

    ctl = wait_until(both_running, 60, "the controller to count both ranks running")
    check_metrics(promtool, agent)
    check_metrics(promtool, ctl)

    # the agent: per-rank gauges, job-level histograms; MFU a fraction, memory a real process's
    assert 0 < value(agent, "meshkeeper_train_mfu_ratio", job_id=job, rank="0") < 1
    # memory: the trainer's own pages, as psutil counts them (its "uss"), not its RSS, which
    # holds the zygote's torch in every rank forked from it
    # holds the zygote's torch in every rank forked from it; read around a fresh scrape
    pid = next(r.pid for r in obs.client.job(job).mesh.ranks if r.rank == 0)
    assert pid, "rank 0 runs, its pid must be in the status"  # psutil.Process(None) is us
    trainer = psutil.Process(pid)
    before = trainer.memory_full_info()
    own = value(obs.scrape(worker), "meshkeeper_rank_resident_memory_bytes", job_id=job, rank="0")
    after = trainer.memory_full_info()
    low, high = 0.98 * min(before.uss, after.uss), 1.02 * max(before.uss, after.uss)
    assert high < min(before.rss, after.rss), (before, after)  # its RSS would be out of range
    assert low <= own <= high, (own, before, after)
    assert value(agent, "meshkeeper_train_step_duration_seconds_count", job_id=job) >= 1
    for f in families(agent).values():
        if f.type == "histogram":
            assert all("rank" not in s.labels for s in f.samples), f"{f.name} has a rank label"
    # the controller: the job's phase, ranks and progress, read from Redis
    assert value(ctl, "meshkeeper_job_phase", job_id=job, phase="Running") == 1
    assert value(ctl, "meshkeeper_job_target_steps", job_id=job) == 40
    assert value(ctl, "meshkeeper_train_loss", job_id=job) > 0
    assert value(ctl, "meshkeeper_worker_heartbeat_age_seconds", worker=worker) < 3
    # the ETTR: 0 until a pass has charged a trained stretch, then a fraction
    ettr = wait_until(
        lambda: value(obs.scrape_controller(), "meshkeeper_goodput_ratio", job_id=job) or None,
        30,
        "a trained stretch in the goodput ledger",
    )
    assert 0 < ettr <= 1

    wait_until(lambda: obs.client.job(job).phase == "Succeeded", 180, f"job {job} to succeed")
    wait_until(
        lambda: f'job_id="{job}"' not in obs.scrape_controller(),
        10,
        "the controller to drop the ended job's series",
    )
    wait_until(
        lambda: f'job_id="{job}"' not in obs.scrape(worker),
        20,
        "the agent to drop the ended job's series",
    )


def test_http_service_discovery_lists_every_agent_for_prometheus(obs, promtool, tmp_path):
    """promtool runs Prometheus' own HTTP SD against the controller, with the scrape token as
    deployed: every agent is a target, with its worker id, at the port it serves metrics on."""
    config = tmp_path / "prometheus.yml"
    config.write_text(
        json.dumps(
            {
                "scrape_configs": [
                    {
                        "job_name": "meshkeeper-worker",
                        "http_sd_configs": [
                            {
                                "url": f"{obs.controller.url}/v1/sd/workers",
                                "refresh_interval": "5s",
                                "authorization": {
                                    "type": "Bearer",
                                    "credentials": obs.secrets.scrape_token,
                                },
                            }
                        ],
                    }
                ]
            }
        )
    )
    out = subprocess.run(
        [promtool, "check", "service-discovery", str(config), "meshkeeper-worker", "--timeout=3s"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    found = {t["labels"]["worker"]: t["labels"]["__address__"] for t in json.loads(out.stdout)}
    assert found == {w: f"127.0.0.1:{p}" for w, p in obs.metrics_ports.items()}
