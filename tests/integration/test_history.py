"""A job's training history (controller/history.py) against a real redis-server, and its
endpoint `GET /v1/jobs/{id}/history` on a real controller process: points appended in a
fenced transaction, read back downsampled (first and last kept, never more than asked, every
point exactly when fewer are stored), the checkpoint commits beside them, and the endpoint's
auth and input checks."""

from __future__ import annotations

from itertools import pairwise

import httpx
import pytest
from redis.crc import key_slot

from controller import history
from services import api
from services.records import HistoryPoint
from services.store import Fenced, Store, Tx
from tests.stack import ApiStack, tiny_spec, wait_until


def point(step: int, generation: int = 1) -> HistoryPoint:
    return HistoryPoint(
        step=step,
        time=1_700_000_000 + step * 0.5,
        loss=10 / step,
        tokens_per_s=1000.0 + step,
        step_s=0.5,
        generation=generation,
    )


def append(
    store: Store, lease: str, jid: str, steps: range, per_tx: int = 500
) -> list[HistoryPoint]:
    """Append a point per step, `per_tx` to a fenced transaction, as the reconcile pass does."""
    points = [point(s) for s in steps]
    for i in range(0, len(points), per_tx):
        tx = Tx()
        for p in points[i : i + per_tx]:
            history.append(tx, store.keys, jid, p)
        store.commit(tx, lease)
    return points


@pytest.fixture
def lease(store) -> str:
    return store.acquire_lease("test-controller", ttl_s=60)


def test_the_history_lives_in_the_jobs_cluster_slot(store):
    assert key_slot(history.key(store.keys, "j-1").encode()) == key_slot(
        store.keys.job("j-1").encode()
    )


def test_fewer_points_than_asked_come_back_exactly(store, lease):
    stored = append(store, lease, "j", range(1, 8))
    assert history.read(store, "j", 8) == (stored, 7)
    assert history.read(store, "j", 1000) == (stored, 7)
    assert history.read(store, "unknown-job", 10) == ([], 0)


def test_a_long_history_is_downsampled_to_real_points_keeping_first_and_last(store, lease):
    stored = append(store, lease, "j", range(1, 1201))
    by_step = {p.step: p for p in stored}
    points, total = history.read(store, "j", 50)
    assert total == 1200
    steps = [p.step for p in points]
    # 1198 inner points into 48 buckets: every bucket has points, so exactly 50 come back
    assert len(points) == 50 and steps[0] == 1 and steps[-1] == 1200
    assert steps == sorted(set(steps))
    assert all(p == by_step[p.step] for p in points)  # measured points, none averaged
    # each bucket is shown by its last point: no gap is wider than a bucket (ceil(1198 / 48))
    assert max(b - a for a, b in pairwise(steps)) <= 25
    assert [p.step for p in history.read(store, "j", 2)[0]] == [1, 1200]
    with pytest.raises(ValueError, match="max_points must be at least 2"):
        history.read(store, "j", 1)


def test_a_fenced_out_controller_appends_nothing(store, lease):
    append(store, lease, "j", range(1, 4))
    store.release_lease(lease)
    with pytest.raises(Fenced):
        append(store, lease, "j", range(4, 6))
    assert history.read(store, "j", 10)[1] == 3


# -- the endpoint, on a real controller ---------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = ApiStack(tmp_path_factory.mktemp("history-api"))
    yield s
    s.close()


@pytest.fixture(scope="module")
def admin_store(stack):
    s = Store(stack.redis.url)
    yield s
    s.close()


@pytest.fixture(scope="module")
def job(stack, admin_store) -> str:
    """A job (no agents run it) with 30 points of history and one committed checkpoint."""
    with stack.controller.client() as c:
        jid = c.submit(tiny_spec("history-target")).id
    # the controller holds the lease; its token is what a fenced write must present
    lease = wait_until(admin_store.lease_holder, 30, "the controller to take the lease")
    append(admin_store, lease, jid, range(1, 31))
    # a checkpoint commit through the real CAS script, from a worker assigned to the job
    admin_store.r.hset(
        admin_store.keys.worker_assignment("w-ck"), mapping={"job": jid, "role": "rank"}
    )
    assert admin_store.commit_checkpoint(jid, 0, 20, "/ck/step-20", keep=3, wid="w-ck") == []
    yield jid
    with stack.controller.client() as c:
        c.cancel(jid)


def get(stack: ApiStack, jid: str, token: str | None, **params) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(
        f"{stack.url}/v1/jobs/{jid}/history", params=params, headers=headers, timeout=10
    )


def test_a_viewer_reads_the_downsampled_history_with_its_checkpoints(stack, job):
    r = get(stack, job, stack.secrets.viewer_token, max_points=10)
    assert r.status_code == 200, r.text
    doc = api.JobHistory.model_validate(r.json())
    assert doc.id == job and doc.total_points == 30
    assert [p.step for p in doc.points][0] == 1 and doc.points[-1] == point(30)
    assert len(doc.points) == 10
    assert doc.recoveries == []
    [mark] = doc.checkpoints
    assert (mark.step, mark.generation) == (20, 0) and mark.time is not None

    whole = api.JobHistory.model_validate(get(stack, job, stack.secrets.viewer_token).json())
    assert whole.points == [point(s) for s in range(1, 31)]  # the default (1000) holds them all


def test_no_token_is_refused(stack, job):
    r = get(stack, job, None)
    assert r.status_code == 401, r.text
    assert r.headers["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize("bad", ["1", "5001", "-3", "many"])
def test_a_bad_max_points_is_a_422_naming_the_field(stack, job, bad):
    r = get(stack, job, stack.secrets.viewer_token, max_points=bad)
    assert r.status_code == 422, r.text
    body = r.json()
    assert [p["field"] for p in body["problems"]] == ["query.max_points"]
    assert "max_points" in body["detail"]


def test_an_unknown_job_is_a_404(stack):
    r = get(stack, "no-such-job", stack.secrets.viewer_token)
    assert r.status_code == 404, r.text
    assert "no-such-job" in r.json()["detail"]
