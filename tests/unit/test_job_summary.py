"""The job list shows the mesh a job runs now, and the spec's beside it only when they differ
(a shrink or a re-plan; controller/status.py, cli/render.py)."""

from __future__ import annotations

from rich.console import Console

from cli.render import job_detail, jobs_table, summary
from controller.jobs import Job
from controller.status import job_summary
from services import api
from services.spec import parse_spec

SPEC = parse_spec(
    {
        "name": "j",
        "model": {"preset": "tiny"},
        "parallel": {"dp": 2, "tp": 2},
        "train": {"steps": 10, "global_batch": 4},
    }
)


def shown(job: Job) -> str:
    console = Console(width=200, record=True)
    console.print(jobs_table([job_summary(job)]))
    return console.export_text()


def test_a_shrunk_job_shows_the_mesh_it_runs_and_the_one_it_will_grow_back_to():
    job = Job(id="j-1", name="j", spec=SPEC, generation=2)
    job.current = {"dp": 1, "pp": 1, "tp": 2, "microbatches": 4}  # after a shrink
    s = job_summary(job)
    assert (s.mesh_shape.dp, s.mesh_shape.tp) == (1, 2)
    assert (s.target_shape.dp, s.target_shape.tp) == (2, 2)
    assert "dp1·pp1·tp2 (of dp2·pp1·tp2)" in shown(job)


def test_a_job_at_its_target_shows_one_mesh():
    job = Job(id="j-2", name="j", spec=SPEC, generation=1)
    assert job_summary(job).target_shape is None
    assert "dp2·pp1·tp2" in shown(job) and "(of" not in shown(job)


def status_of(job: Job, mesh: api.Mesh) -> api.JobStatus:
    fields = job_summary(job).model_dump()
    return api.JobStatus(**fields, mesh=mesh, conditions=[], spec=job.spec.model_dump())


def printed(renderable) -> str:
    console = Console(width=200, record=True)
    console.print(renderable)
    return console.export_text()


def test_status_and_the_final_summary_show_both_meshes_and_the_replica_labels():
    """After dp 0 was lost, the survivor is replica 0 of the new world but still dp 1 of the
    submitted layout: the status table names it 1, as the mesh page does."""
    job = Job(id="j-3", name="j", spec=SPEC, generation=2)
    job.current = {"dp": 1, "pp": 1, "tp": 2, "microbatches": 4}
    ranks = [
        api.RankStatus(
            rank=t, coord=api.Coordinate(dp=0, pp=0, tp=t), worker=f"w{2 + t}", local_rank=0
        )
        for t in range(2)
    ]
    mesh = api.Mesh(shape=api.Coordinate(dp=1, pp=1, tp=2), ranks=ranks, dp_labels=[1])
    j = status_of(job, mesh)
    detail = printed(job_detail(j))
    assert "mesh dp1·pp1·tp2 (of dp2·pp1·tp2)" in detail
    row = next(line for line in detail.splitlines() if "r0@w2" in line)
    assert row.split()[0] == "1", row
    assert "mesh dp1·pp1·tp2 (of dp2·pp1·tp2)" in printed(summary(j))
