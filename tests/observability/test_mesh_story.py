"""The mesh page tells a failure's story, in headless Chromium against a real job: dp2 x tp2
with no spare and no idle worker, a worker of replica dp 0 SIGKILLed (agent and trainer), so
the job shrinks to dp 1 and, once the worker returns, grows back at a checkpoint.

- From the fault's recovery until the new generation trains, the page draws the layout the
  fault struck: the killed rank's cell red at its old coordinate, named by its cause; the
  surviving replica keeps its label "dp 1" then and after (the shrink renumbers it dp 0).
- The event list holds one line per generation for the agents' start and stop events, the
  fault's warning on a line of its own.
- The loss chart's marks name cause and action, the fault's red and the grow's another
  colour and shape (a real grow, not a styling call).

A MutationObserver records every distinct drawing of the mesh, so "until the new generation
trains" is checked on every frame the page drew, not on the few a poll happened to see.
Screenshots: story-shrunk.png and story-done.png in the test's tmp dir."""

from __future__ import annotations

import re

from tests.chaos.chaos import (
    DP_TP,
    EVERY,
    at_step,
    mesh_spec,
    metrics_path,
    pool_cut_to,
    rank,
    start,
    wait_record,
)
from tests.stack import wait_until

RED = "rgb(198, 40, 40)"  # --dead in mesh.css
# every distinct drawing of the mesh, with the job's phase drawn in the same tick
RECORD = """window.story = [];
const snap = () => JSON.stringify({phase: document.getElementById('job-meta').dataset.phase,
  replicas: [...document.querySelectorAll('#mesh .replica:not(.spares)')].map(r => ({
    dp: r.dataset.dp, title: r.querySelector('h4').textContent,
    cells: [...r.querySelectorAll('.cell')].map(c => ({rank: c.dataset.rank,
      state: c.dataset.state, coord: c.dataset.coord, worker: c.dataset.worker,
      cause: c.dataset.cause, text: c.textContent, title: c.title}))}))});
new MutationObserver(() => { const s = snap();
  if (s !== window.story[window.story.length - 1]) window.story.push(s); })
  .observe(document.getElementById('mesh'), {childList: true});"""
STORY = "return window.story.slice(arguments[0]).map(s => JSON.parse(s))"
TIMELINE = """return [...document.querySelectorAll('#timeline li')].map(li => ({
    reason: li.dataset.reason, generation: li.dataset.generation, folded: li.dataset.folded,
    warning: li.classList.contains('warning'),
    message: li.querySelector('.message').textContent}))"""
MARKS = """return [...document.querySelectorAll('#loss-chart .mark')].map(m => ({
    kind: m.dataset.kind, step: Number(m.dataset.step), hidden: m.hidden,
    label: m.querySelector('.mark-label')?.textContent ?? null,
    color: getComputedStyle(m).borderLeftColor,
    head: getComputedStyle(m, '::after').borderRadius}))"""
FOLDED = ("TrainerStarted", "TrainerKept", "TrainerStopped", "TrainerExited")


def test_the_page_keeps_a_killed_cell_in_place_folds_events_and_labels_marks(
    obs, browser, tmp_path
):
    # paced: the job must still be training when the killed worker's agent is back, for the
    # grow-back (on a loaded CI host 20 unpaced steps took 6 s, less than an agent's restart)
    spec = {
        **mesh_spec("obs-story", steps=25, parallel=DP_TP, spares=0),
        "chaos": {"min_step_s": 0.4},
    }
    with pool_cut_to(obs, 4):
        w, j1 = start(obs, spec)
        job = j1.id
        browser.get(
            f"{obs.controller.url}/ui/?interval=250#/jobs/{job}&token={obs.secrets.viewer_token}"
        )
        wait_until(
            lambda: len(browser.find_elements("css selector", "#mesh .cell.state-healthy")) == 4,
            30,
            "4 healthy cells on the page",
        )
        browser.execute_script(RECORD)
        victim = rank(j1, 1)  # dp 0, tp 1: replica dp 1 survives and is renumbered dp 0
        survivors = {rank(j1, 2).worker, rank(j1, 3).worker}
        wait_record(
            metrics_path(obs, j1, 1), at_step(EVERY + 1), 180, f"rank 1 at step {EVERY + 1}"
        )
        w.until(lambda j: j.last_checkpoint, 60, "a committed checkpoint")
        obs.kill_worker(victim.worker, [victim.pid])

        def trained_shrunk():
            story = browser.execute_script(STORY, 0)
            last = story[-1] if story else None
            return (
                last
                and last["phase"] == "Running"
                and len(last["replicas"]) == 1
                and all(c["state"] == "healthy" for c in last["replicas"][0]["cells"])
                and story
            )

        story = wait_until(trained_shrunk, 120, "the page to draw the shrunk job training")
        browser.save_screenshot(str(tmp_path / "story-shrunk.png"))
        shrunk = obs.client.job(job)
        obs.restart_agent(victim.worker)  # at once: what follows judges what was recorded
        rec = shrunk.recoveries[0]
        assert (rec.cause, rec.action, rec.to_shape) == ("WorkerDead", "shrink", [1, 1, 2]), rec
        assert rec.faults[0].coord == {"dp": 0, "pp": 0, "tp": 1}, rec.faults
        assert shrunk.mesh.dp_labels == [1]  # the REST status names it too

        # the killed cell, red and named by its cause, from the recovery's first frame on
        def dead_cell(s):
            return next(
                (c for r in s["replicas"] for c in r["cells"] if c.get("cause") == "WorkerDead"),
                None,
            )

        first = next((i for i, s in enumerate(story) if dead_cell(s)), None)
        assert first is not None, f"no frame showed the killed cell with its cause: {story}"
        trained = next(i for i in range(first, len(story)) if story[i]["phase"] != "Recovering")
        assert story[trained]["phase"] == "Running", story[trained]
        for s in story[first:trained]:
            assert s["phase"] == "Recovering", s
            assert [r["dp"] for r in s["replicas"]] == ["0", "1"], s
            cell = dead_cell(s)
            assert (cell["coord"], cell["rank"], cell["worker"], cell["state"]) == (
                "0,0,1",
                "1",
                victim.worker,
                "dead",
            ), cell
            assert "WorkerDead" in cell["text"] and "WorkerDead" in cell["title"], cell
            assert s["replicas"][0]["cells"][cell_index(cell)] == cell  # in its old place
            assert {c["worker"] for c in s["replicas"][1]["cells"]} == survivors, s
        # never a frame where the survivors are named dp 0
        for s in story:
            for r in s["replicas"]:
                if r["dp"] == "0":
                    assert not survivors & {c["worker"] for c in r["cells"]}, s
        after = story[trained]
        assert [(r["dp"], r["title"].split(" ·")[0]) for r in after["replicas"]] == [("1", "dp 1")]
        assert {c["worker"] for c in after["replicas"][0]["cells"]} == survivors
        assert not any(dead_cell(s) for s in story[trained:]), "the dead cell outlived recovery"
        j = w.finish(400)
    assert j.phase == "Succeeded", j.conditions
    assert [(r.cause, r.action) for r in j.recoveries] == [
        ("WorkerDead", "shrink"),
        ("CapacityReturned", "grow"),
    ]
    assert j.mesh.dp_labels == [1, 0]  # the returned replica takes the free label

    # the events: the agents' start/stop lines fold per generation, nothing else does
    events = obs.client.events(job, limit=1000)
    groups: dict[tuple[str, str], int] = {}
    for e in events:
        if e.reason in FOLDED and e.type == "Normal":
            groups[(e.reason, str(e.generation))] = groups.get((e.reason, str(e.generation)), 0) + 1
    assert groups[("TrainerStarted", "1")] >= 2  # one per worker: folding has work to do
    want_lines = len(events) - sum(groups.values()) + len(groups)
    lines = wait_until(
        lambda: len(t := browser.execute_script(TIMELINE)) == want_lines and t,
        30,
        f"{want_lines} lines in the event list ({len(events)} events)",
    )
    folded = {(li["reason"], li["generation"]): li for li in lines if li["folded"]}
    assert {k: int(li["folded"]) for k, li in folded.items()} == groups
    world = {"1": 4, "2": 2, "3": 4}  # dp2 x tp2, shrunk to dp1, grown back
    for gen, n in world.items():
        # each rank of a generation started afresh or kept its process (worker/trainer/handoff.py)
        ranks = 0
        for reason, verb in (("TrainerStarted", "started"), ("TrainerKept", "kept")):
            if (reason, gen) not in folded:
                continue
            line = folded[(reason, gen)]["message"]
            got = re.fullmatch(rf"generation {gen}: (\d+) ranks? {verb} on (\d+) workers?", line)
            assert got and got[1] == got[2], line  # one rank per worker here
            ranks += int(got[1])
        assert ranks == n, (gen, folded)
    assert ("TrainerStarted", "1") in folded and ("TrainerKept", "3") in folded, folded
    faults = [li for li in lines if li["warning"] and f"rank {victim.rank} " in li["message"]]
    assert any(li["reason"] == "RecoveryStarted" for li in faults), lines

    # the chart's marks: cause and action, the fault red and round, the grow not
    marks = wait_until(
        lambda: (
            len(m := [m for m in browser.execute_script(MARKS) if m["kind"] != "checkpoint"]) == 2
            and m
        ),
        30,
        "the two recovery marks on the loss chart",
    )
    by_kind = {m["kind"]: m for m in marks}
    assert sorted(by_kind) == ["grow", "recovery"] and len(marks) == 2, marks
    fault, grow = by_kind["recovery"], by_kind["grow"]
    assert (fault["label"], fault["step"]) == ("WorkerDead → shrink", j.recoveries[0].last_step)
    assert (grow["label"], grow["step"]) == ("CapacityReturned → grow", j.recoveries[1].last_step)
    assert not fault["hidden"] and not grow["hidden"]
    assert fault["color"] == RED and grow["color"] != RED, marks
    assert fault["head"] != grow["head"], marks
    browser.save_screenshot(str(tmp_path / "story-done.png"))
    errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, f"the page logged errors: {errors}"


def cell_index(cell: dict) -> int:
    """Where a cell sits in its dp2 x tp2 replica's grid: row pp, column tp."""
    _, pp, tp = (int(x) for x in cell["coord"].split(","))
    return pp * 2 + tp
