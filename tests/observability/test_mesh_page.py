"""The mesh page in headless Chromium against a real running job: every rank is drawn at its
(dp, pp, tp) cell; when a rank's trainer is killed its cell shows the fault until the
recovery trains (test_mesh_story.py follows a shrink frame by frame), the timeline shows the
failure and then the recovery, after which the cell is healthy again; the charts
(uPlot) show the job's whole history from GET /v1/jobs/{id}/history, marked with the
recovery and the checkpoints, however late the page was opened.
Screenshots land in the test's tmp dir (mesh-running.png, mesh-failed.png, mesh-recovered.png,
mesh-late.png)."""

from __future__ import annotations

import os
import signal

import pytest

from services import api
from tests.stack import tiny_spec, wait_until

SHAPE = {"dp": 2, "pp": 2, "tp": 1}
CELLS = """return [...document.querySelectorAll('#mesh .cell')].map(c => ({
    rank: c.dataset.rank, state: c.dataset.state, coord: c.dataset.coord,
    worker: c.dataset.worker}))"""
TIMELINE = """return [...document.querySelectorAll('#timeline li')].map(li => ({
    reason: li.dataset.reason, warning: li.classList.contains('warning'), text: li.textContent}))"""
# one rendering of the page: the job's phase and rank 3's cell, drawn in the same tick
RANK3 = """const c = document.querySelector('#mesh .cell[data-rank="3"]');
    return {phase: document.getElementById('job-meta').dataset.phase, state: c?.dataset.state,
    cause: c?.dataset.cause, coord: c?.dataset.coord}"""
# what the charts draw: their x (steps) and y series, and the marks over the loss chart
CHARTS = """const c = view.charts; return c.loss ? {steps: Array.from(c.loss.data[0]),
    loss: Array.from(c.loss.data[1]), tps: Array.from(c.tps.data[1]),
    marks: [...document.querySelectorAll('#loss-chart .mark')].filter(m => !m.hidden)
        .map(m => [m.dataset.kind, Number(m.dataset.step)])} : null"""
HISTORY_POINTS = 1000  # what the page asks for (mesh.js)
# the goodput bar: each segment's part and the seconds it stands for
GOODPUT = """return [...document.querySelectorAll('#goodput .seg')].map(s =>
    [s.dataset.part, Number(s.dataset.seconds)])"""


def test_mesh_page_follows_a_killed_rank_through_its_recovery(obs, browser, tmp_path):
    spec = tiny_spec(
        "obs-mesh",
        parallel={**SHAPE, "microbatches": 2},
        train={"steps": 2000},
        checkpoint={"every_steps": 5},
        fault_tolerance={"spares": 1},
    )
    job = obs.client.submit(spec).id
    try:
        status = wait_until(
            lambda: (
                (j := obs.client.job(job)).mesh.ranks
                and all(r.state == "running" for r in j.mesh.ranks)
                and j
            ),
            120,
            "all 4 ranks running",
        )
        # the viewer token in the fragment, as a user is given the page; the page keeps it in
        # sessionStorage and drops it from the address bar
        browser.get(
            f"{obs.controller.url}/ui/?interval=250#/jobs/{job}&token={obs.secrets.viewer_token}"
        )

        # every rank at its coordinate, healthy, and the spare drawn apart
        def healthy_mesh():
            cells = browser.execute_script(CELLS)
            ranks = [c for c in cells if c["rank"]]
            return (
                cells if len(ranks) == 4 and all(c["state"] == "healthy" for c in ranks) else None
            )

        cells = wait_until(healthy_mesh, 30, "4 healthy rank cells on the page")
        want = {
            (str(r.rank), f"{r.coord.dp},{r.coord.pp},{r.coord.tp}", r.worker)
            for r in status.mesh.ranks
        }
        assert {(c["rank"], c["coord"], c["worker"]) for c in cells if c["rank"]} == want
        assert [c["worker"] for c in cells if c["state"] == "spare"] == status.mesh.spares
        browser.save_screenshot(str(tmp_path / "mesh-running.png"))

        # a checkpoint to come back to, then kill rank 3's trainer
        wait_until(lambda: obs.client.job(job).last_checkpoint, 120, "a committed checkpoint")
        victim = next(r for r in obs.client.job(job).mesh.ranks if r.rank == 3)
        os.kill(victim.pid, signal.SIGKILL)

        def victim_state():
            return next(
                (c["state"] for c in browser.execute_script(CELLS) if c["rank"] == "3"), None
            )

        # while the job recovers (a new generation rendezvousing and restoring on the spare),
        # the killed rank's cell stays red in its place, named by its cause
        seen = wait_until(
            lambda: (s := browser.execute_script(RANK3))["phase"] == "Recovering" and s,
            30,
            "the page to show the job Recovering",
        )
        assert seen == {
            "phase": "Recovering",
            "state": "dead",
            "cause": "TrainerKilled",
            "coord": f"{victim.coord.dp},{victim.coord.pp},{victim.coord.tp}",
        }, seen
        wait_until(
            lambda: [
                e
                for e in browser.execute_script(TIMELINE)
                if e["warning"] and "rank 3 " in e["text"]
            ],
            30,
            "a warning about rank 3 in the timeline",
        )
        browser.save_screenshot(str(tmp_path / "mesh-failed.png"))

        wait_until(
            lambda: any(e["reason"] == "Recovered" for e in browser.execute_script(TIMELINE)),
            180,
            "the Recovered event in the timeline",
        )
        wait_until(lambda: victim_state() == "healthy", 30, "rank 3's cell healthy again")
        browser.save_screenshot(str(tmp_path / "mesh-recovered.png"))

        # stopped, the history holds still: the charts draw exactly it, with the recovery
        # marked where its fault struck and every checkpoint the pointer lists
        obs.client.cancel(job)
        wait_until(lambda: obs.client.job(job).phase == "Cancelled", 60, "the job cancelled")
        hist = history(obs, job)
        assert len(hist.recoveries) == 1 and hist.checkpoints, hist
        want_marks = sorted(
            [["recovery", hist.recoveries[0].last_step]]
            + [["checkpoint", c.step] for c in hist.checkpoints]
        )
        wait_until(
            lambda: (
                (c := browser.execute_script(CHARTS))
                and sorted(c["marks"]) == want_marks
                and c["steps"] == drawn_steps(hist)
            ),
            30,
            f"the charts drawn with the whole history, marked with {want_marks}",
        )
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, f"the page logged errors: {errors}"
    finally:
        if obs.client.job(job).phase not in ("Cancelled", "Succeeded", "Failed"):
            obs.client.cancel(job)


def history(obs, job: str) -> api.JobHistory:
    """The job's history as the page asks for it."""
    r = obs.client.http.get(f"/v1/jobs/{job}/history", params={"max_points": HISTORY_POINTS})
    r.raise_for_status()
    return api.JobHistory.model_validate(r.json())


def drawn_steps(hist: api.JobHistory) -> list[int]:
    """The steps a chart draws: each step once (a step redone after a restore is drawn with
    its later generation's point), ascending."""
    return sorted({p.step for p in hist.points})


def test_a_page_opened_late_charts_the_whole_history(obs, browser, tmp_path):
    """Opened when the job is well on its way, the charts start at the job's first recorded
    step, not at the first step the page itself saw, and end with the whole run."""
    spec = tiny_spec("obs-late", train={"steps": 60}, checkpoint={"every_steps": 20})
    job = obs.client.submit(spec).id
    try:
        opened_at = wait_until(
            lambda: (s := obs.client.job(job).step) >= 30 and s, 180, "the job past step 30"
        )
        browser.get(
            f"{obs.controller.url}/ui/?interval=250#/jobs/{job}&token={obs.secrets.viewer_token}"
        )
        first = history(obs, job).points[0].step
        assert first < opened_at  # recorded before the page was opened
        charts = wait_until(lambda: browser.execute_script(CHARTS), 30, "the charts drawn")
        assert charts["steps"][0] == first, charts["steps"]

        wait_until(lambda: obs.client.job(job).phase == "Succeeded", 180, "the job to succeed")
        hist = history(obs, job)
        assert hist.total_points == len(hist.points)  # fewer than the page asks for: all of them
        assert hist.points[-1].step == 60 and hist.recoveries == []
        want_marks = sorted(["checkpoint", c.step] for c in hist.checkpoints)
        # The page re-reads the history at most every few seconds, so one drawing can hold
        # step 60 before the step-60 checkpoint's mark: wait for the whole final history.
        charts = wait_until(
            lambda: (
                (c := browser.execute_script(CHARTS))
                and c["steps"][-1] == 60
                and sorted(c["marks"]) == want_marks
                and c
            ),
            30,
            f"the charts drawn to step 60, marked with {want_marks}",
        )
        assert charts["steps"] == drawn_steps(hist) and charts["steps"][0] == first
        assert charts["loss"] == [p.loss for p in hist.points]
        assert charts["tps"] == [p.tokens_per_s for p in hist.points]
        # the goodput bar: the ended job's ledger, a segment for each part it has, in order
        ledger = obs.client.job(job).goodput.parts.model_dump()
        want = [[p.removesuffix("_s"), pytest.approx(s)] for p, s in ledger.items() if s > 0]
        wait_until(lambda: browser.execute_script(GOODPUT) == want, 30, f"the goodput bar {want}")
        assert want[0][0] == "productive"
        browser.save_screenshot(str(tmp_path / "mesh-late.png"))
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert not errors, f"the page logged errors: {errors}"
    finally:
        if obs.client.job(job).phase not in ("Cancelled", "Succeeded", "Failed"):
            obs.client.cancel(job)


def test_mesh_page_asks_for_a_token_and_keeps_it_out_of_the_url(obs, browser):
    """Without a token the page shows nothing but a token field; a pasted viewer token is sent
    as a bearer token (the job appears); a token given in the fragment leaves the address bar."""
    job = obs.client.submit(tiny_spec("obs-token", train={"steps": 2000})).id
    try:
        from selenium.webdriver.common.by import By

        listed = "return [...document.querySelectorAll('#job-list li')].map(li => li.dataset.job)"
        browser.get(f"{obs.controller.url}/ui/?interval=250")
        form = wait_until(
            lambda: (f := browser.find_element(By.ID, "login")).is_displayed() and f,
            30,
            "the token field",
        )
        assert browser.execute_script(listed) == []
        assert "token" in browser.find_element(By.ID, "status").text
        browser.find_element(By.ID, "token").send_keys(obs.secrets.viewer_token)
        form.submit()
        wait_until(
            lambda: job in browser.execute_script(listed),
            30,
            "the job listed with the pasted token",
        )
        assert not browser.find_element(By.ID, "login").is_displayed()

        browser.execute_script("sessionStorage.clear()")
        browser.get(
            f"{obs.controller.url}/ui/?interval=250#/jobs/{job}&token={obs.secrets.viewer_token}"
        )
        wait_until(
            lambda: job in browser.execute_script(listed),
            30,
            "the job listed with the fragment token",
        )
        assert obs.secrets.viewer_token not in browser.current_url
        assert browser.current_url.endswith(f"#/jobs/{job}")
        assert (
            browser.execute_script("return sessionStorage.getItem('meshkeeper-token')")
            == obs.secrets.viewer_token
        )
    finally:
        obs.client.cancel(job)
