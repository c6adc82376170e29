"""Data paths only under the configured data roots; checkpoint.root honoured inside an allowed
root, refused outside, never silently replaced.

First `services/paths.py` on a real filesystem (links, `..`, missing files), then the whole
path through a real controller (`--data-root`, `--checkpoint-root-allow`) and a real agent with
its own, narrower `--data-root`: the controller refuses at submission with 422 naming the
field, the agent refuses again on its host, and a job inside the roots trains on the file and
checkpoints where its spec said."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from dataset.format import read_manifest
from services.paths import PathRefused, confine, confine_spec
from services.spec import SpecError
from tests.corpus import prepared, stdlib_docstrings
from tests.security.smallpool import SmallPool
from tests.stack import tiny_spec, wait_phase, wait_until


@pytest.fixture
def tree(tmp_path) -> dict[str, Path]:
    """root/ with a file, a link inside the root, links out of it; secret/ outside the root."""
    root, secret = tmp_path / "root", tmp_path / "secret"
    (root / "sub").mkdir(parents=True)
    secret.mkdir()
    (root / "sub" / "corpus.txt").write_text("hello " * 100)
    (secret / "key.txt").write_text("do not train on me")
    (root / "inner").symlink_to(root / "sub")  # stays inside: allowed
    (root / "out-dir").symlink_to(secret)  # a directory link that leaves the root
    (root / "out-file.txt").symlink_to(secret / "key.txt")
    (root / "rel-out").symlink_to("../secret")  # relative target, leaves too
    return {"root": root, "secret": secret}


def test_files_under_the_root_resolve(tree):
    root = tree["root"]
    assert confine(f"{root}/sub/corpus.txt", [root], must_exist=True) == root / "sub" / "corpus.txt"
    # a link that stays inside is followed; the result is the real file
    assert (
        confine(f"{root}/inner/corpus.txt", [root], must_exist=True) == root / "sub" / "corpus.txt"
    )
    assert (
        confine(f"{root}//sub/./corpus.txt", [root], must_exist=True) == root / "sub" / "corpus.txt"
    )
    # a root given through a link of its own still works, both spellings
    alias = tree["secret"].parent / "alias"
    alias.symlink_to(root)
    assert (
        confine(f"{alias}/sub/corpus.txt", [alias], must_exist=True) == root / "sub" / "corpus.txt"
    )


@pytest.mark.parametrize(
    "rel",
    [
        "out-dir/key.txt",
        "out-file.txt",
        "rel-out/key.txt",
        "sub/../../secret/key.txt",
        "sub/../sub/corpus.txt",
    ],
)
def test_links_out_of_the_root_and_dotdot_are_refused(tree, rel):
    with pytest.raises(PathRefused):
        confine(f"{tree['root']}/{rel}", [tree["root"]], must_exist=True)
    with pytest.raises(PathRefused):  # a checkpoint directory may not leave through them either
        confine(f"{tree['root']}/{rel}", [tree["root"]], must_exist=False)


def test_outside_paths_relative_paths_and_no_roots_are_refused(tree):
    for path in (
        "/etc/shadow",
        "/proc/self/environ",
        str(tree["secret"] / "key.txt"),
        "sub/corpus.txt",
        f"{tree['root']}-sibling/x",
    ):  # a prefix of the root's name is not inside it
        with pytest.raises(PathRefused):
            confine(path, [tree["root"]], must_exist=True)
    with pytest.raises(PathRefused, match="no roots are configured"):
        confine(f"{tree['root']}/sub/corpus.txt", [], must_exist=True)


def test_outside_the_roots_a_refusal_never_tells_whether_a_path_exists(tree):
    """Outside every root nothing is looked up: a file that exists, a root-only one and one
    that does not all get the same message."""

    def message(path: str) -> str:
        with pytest.raises(PathRefused) as e:
            confine(path, [tree["root"]], must_exist=True)
        return str(e.value).replace(repr(path), "PATH")

    outside = {
        message(p)
        for p in ("/etc/shadow", "/etc/passwd", "/no/such/file", str(tree["secret"] / "key.txt"))
    }
    assert len(outside) == 1 and "is not inside the allowed roots" in outside.pop()


def test_inside_a_root_a_refusal_says_what_is_wrong(tree):
    """The user's own tree: missing, a directory, a link out (unreadable cannot be shown as
    root, which reads anything). A link is judged by where it points, so a link out reads the
    same whether or not its target exists."""
    root = tree["root"]

    def message(rel: str) -> str:
        with pytest.raises(PathRefused) as e:
            confine(f"{root}/{rel}", [root], must_exist=True)
        return str(e.value)

    assert "does not exist" in message("nope.txt") and "directory" not in message("nope.txt")
    assert "is a directory or special file, not a regular file" in message("sub")
    for rel in ("out-file.txt", "out-dir/key.txt", "out-dir/missing.txt", "rel-out/key.txt"):
        assert "a link that leads out of the allowed root" in message(rel), rel
    assert message("out-dir/key.txt").replace("key", "missing") == message("out-dir/missing.txt")


def test_a_refusal_is_true_of_a_file_and_of_a_link(tree):
    """The controller's check (no file required) of a data file outside the roots, and the
    agent's of a link leading out: neither message calls a file a directory, and the link's
    names the link."""
    with pytest.raises(PathRefused) as e:
        confine("/etc/passwd", [tree["root"]], must_exist=False)
    assert "directory" not in str(e.value) and "is not inside the allowed roots" in str(e.value)
    with pytest.raises(PathRefused) as e:
        confine(f"{tree['root']}/out-file.txt", [tree["root"]], must_exist=True)
    assert f"passes through {tree['root']}/out-file.txt, a link" in str(e.value)


def test_checkpoint_root_inside_is_resolved_outside_is_refused(tree):
    spec = tiny_spec("ck", checkpoint={"root": f"{tree['root']}/inner/runs"})
    assert confine_spec(spec, [], [tree["root"]], on_host=True)["checkpoint"]["root"] == str(
        tree["root"] / "sub" / "runs"
    )  # not yet there: fine for a directory to be made
    for bad in ("/tmp/elsewhere", f"{tree['root']}/out-dir/runs", f"{tree['root']}/../secret"):
        with pytest.raises(SpecError) as e:
            confine_spec(
                tiny_spec("ck", checkpoint={"root": bad}), [], [tree["root"]], on_host=False
            )
        assert [p.field for p in e.value.problems] == ["checkpoint.root"]


# --- through a real controller and agent -------------------------------------------------


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """Controller data root D, agents' data root D/agent (narrower), checkpoints under
    work/checkpoints (the agents' --checkpoint-root, allowed to specs by the controller)."""
    work = tmp_path_factory.mktemp("roots")
    data = work / "data"
    (data / "agent").mkdir(parents=True)
    (data / "agent" / "corpus.txt").write_bytes(bytes(range(32, 127)) * 40)
    (data / "controller-only.txt").write_bytes(bytes(range(32, 127)) * 40)
    (data / "agent" / "escape").symlink_to("/etc")
    p = SmallPool(
        work,
        1,
        controller_flags=[
            "--data-root",
            str(data),
            "--checkpoint-root-allow",
            str(work / "checkpoints"),
        ],
        agent_flags=["--data-root", str(data / "agent")],
    )
    p.data = data
    yield p
    p.close()


def one_rank(name: str, **sections: dict) -> dict:
    """A tiny job for the pool's single worker."""
    return tiny_spec(name, parallel={"dp": 1}, **sections)


def refused(pool: SmallPool, spec: dict) -> dict:
    r = pool.client.http.post("/v1/jobs", json=spec)
    assert r.status_code == 422, r.text
    return r.json()


def test_a_job_reading_outside_the_data_roots_gets_422_naming_data_source(pool):
    data = pool.data
    bodies = {}
    for path in (
        "/etc/shadow",
        "/etc/passwd",
        "/no/such/file",
        f"{data}/../secret.txt",
        f"{data}/agent/escape/passwd",
        "relative/corpus.txt",
    ):
        body = refused(pool, one_rank("leak", data={"source": f"text:{path}"}))
        assert [p["field"] for p in body["problems"]] == ["data.source"], body
        bodies[path] = json.dumps(body).replace(path, "PATH")
    # a root-only file, a world-readable one and a missing one answer alike
    assert bodies["/etc/shadow"] == bodies["/etc/passwd"] == bodies["/no/such/file"]
    assert not pool.client.jobs(), "a refused job must not be stored"


def test_checkpoint_root_outside_the_allowed_roots_gets_422(pool):
    body = refused(pool, one_rank("ck", checkpoint={"root": "/tmp/anywhere"}))
    assert [p["field"] for p in body["problems"]] == ["checkpoint.root"]
    assert "--checkpoint-root-allow" in body["problems"][0]["message"]


def test_an_export_outside_the_checkpoint_roots_gets_422_naming_it(pool):
    """A submitter cannot make the trainers write a model anywhere on the workers' hosts."""
    with pool.client_as(pool.secrets.submitter_token) as submitter:
        for path in ("/etc/cron.d/model", "/tmp/anywhere", "relative/out"):
            spec = one_rank("out", checkpoint={"export_hf": path})
            r = submitter.http.post("/v1/jobs", json=spec)
            assert r.status_code == 422, r.text
            assert [p["field"] for p in r.json()["problems"]] == ["checkpoint.export_hf"]
    assert not pool.client.jobs(), "a refused job must not be stored"


def test_the_agent_refuses_a_path_outside_its_own_roots(pool):
    """The controller's root allows the file, the agent's narrower one does not: the rank fails
    with exit code 2 and the path named, and no trainer is started."""
    spec = one_rank("agent-no", data={"source": f"text:{pool.data}/controller-only.txt"})
    jid = pool.client.submit(spec).id
    job = wait_phase(pool.client, jid, ("Failed", "Succeeded"), 60)
    failed = job.condition("Failed")
    assert job.phase == "Failed" and "exited with code 2" in failed.message, failed
    assert "data.source" in failed.message and "controller-only.txt" in failed.message, (
        failed.message
    )
    assert not list((pool.work / "workers").glob(f"*/jobs/{jid}/g*/rank*.log")), (
        "a trainer was started"
    )


@pytest.mark.slow
def test_a_job_inside_the_roots_trains_on_the_file_and_checkpoints_where_its_spec_says(pool):
    ckpt = pool.work / "checkpoints" / "team-a"
    spec = one_rank(
        "in-roots",
        train={"steps": 4, "global_batch": 4},
        data={"source": f"text:{pool.data}/agent/corpus.txt"},
        checkpoint={"root": str(ckpt), "every_steps": 2, "mode": "sync"},
    )
    jid = pool.client.submit(spec).id
    job = wait_phase(pool.client, jid, ("Succeeded", "Failed"), 180)
    assert job.phase == "Succeeded", job.conditions
    saved = wait_until(lambda: list((ckpt / jid / "in-roots").rglob("*")), 10, "checkpoint files")
    assert saved, f"nothing under {ckpt}"
    spec_seen = json.loads(
        next((pool.work / "workers").glob(f"*/jobs/{jid}/g1/spec.json")).read_text()
    )
    assert (
        spec_seen["data"]["source"]
        == f"text:{os.path.realpath(pool.data / 'agent' / 'corpus.txt')}"
    )


def hf_job(name: str, directory: str) -> dict:
    """A job starting from a Hugging Face directory, its architecture given (as the CLI sends)."""
    model = {"hf": directory, "layers": 2, "d_model": 64, "heads": 4, "vocab": 256, "seq_len": 32}
    return one_rank(name, model=model)


def test_a_model_directory_outside_the_data_roots_gets_422_naming_model_hf(pool):
    """With the submitter's token, what a tenant holds."""
    submitter = pool.client_as(pool.secrets.submitter_token)
    try:
        for path in ("/etc", f"{pool.data}/agent/escape", f"{pool.data}/../secret", "relative"):
            r = submitter.http.post("/v1/jobs", json=hf_job("leak-model", path))
            assert r.status_code == 422, r.text
            assert [p["field"] for p in r.json()["problems"]] == ["model.hf"], r.text
        assert "leak-model" not in {j.name for j in pool.client.jobs()}, "a refused job was stored"
    finally:
        submitter.close()


def test_the_agent_refuses_a_model_directory_outside_its_own_roots(pool):
    """The controller's root allows it, the agent's narrower one does not: exit code 2 with
    model.hf named, and no trainer started."""
    model_dir = pool.data / "controller-only-model"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text("{}")
    submitter = pool.client_as(pool.secrets.submitter_token)
    try:
        jid = submitter.submit(hf_job("agent-no-model", str(model_dir))).id
    finally:
        submitter.close()
    job = wait_phase(pool.client, jid, ("Failed", "Succeeded"), 60)
    failed = job.condition("Failed")
    assert job.phase == "Failed" and "exited with code 2" in failed.message, failed
    assert "model.hf" in failed.message and "controller-only-model" in failed.message, failed


# --- prepared datasets (dataset:DIR) ------------------------------------------------------


@pytest.fixture(scope="module")
def dataset(pool) -> Path:
    out, _ = prepared(stdlib_docstrings(20_000), pool.data / "agent" / "ds", val_fraction=0.3)
    return out


def dataset_job(name: str, directory, vocab: int = 512, **sections) -> dict:
    spec = one_rank(name, data={"source": f"dataset:{directory}"}, **sections)
    spec["model"] = {**spec["model"], "seq_len": 32, "vocab": vocab}
    return spec


def submitted(pool: SmallPool, spec: dict):
    """POST /v1/jobs with the submitter's token, what a tenant holds."""
    submitter = pool.client_as(pool.secrets.submitter_token)
    try:
        return submitter.http.post("/v1/jobs", json=spec)
    finally:
        submitter.close()


def test_a_dataset_outside_the_data_roots_gets_422_naming_data_source(pool, dataset):
    for path in ("/etc", f"{pool.data}/agent/escape", f"{dataset}/../../..", "relative"):
        for steps in ({"steps": 2}, {"epochs": 1}):
            spec = dataset_job("leak-ds", path)
            spec["train"] = {"global_batch": 4, **steps}
            r = submitted(pool, spec)
            assert r.status_code == 422, r.text
            fields = [p["field"] for p in r.json()["problems"]]
            assert fields == (["data.source"] if "steps" in steps else ["train.epochs"]), r.text
    assert "leak-ds" not in {j.name for j in pool.client.jobs()}, "a refused job was stored"


def test_a_dataset_that_cannot_serve_the_spec_gets_422_naming_both(pool, dataset):
    r = submitted(pool, dataset_job("narrow", dataset, vocab=300))
    assert r.status_code == 422, r.text
    (problem,) = r.json()["problems"]
    assert problem["field"] == "model.vocab" and "512" in problem["message"], problem
    r = submitted(pool, dataset_job("eval-big", dataset, eval={"every_steps": 1, "batches": 1000}))
    assert r.status_code == 422 and r.json()["problems"][0]["field"] == "eval.batches", r.text


def test_a_manifest_naming_a_file_outside_its_directory_is_refused(pool, dataset):
    forged = pool.data / "agent" / "forged"
    shutil.copytree(dataset, forged)
    manifest = json.loads((forged / "manifest.json").read_text())
    manifest["splits"]["train"]["shards"][0]["name"] = "../../../../etc/passwd"
    (forged / "manifest.json").write_text(json.dumps(manifest))
    r = submitted(pool, dataset_job("forged", forged))
    assert r.status_code == 422, r.text
    (problem,) = r.json()["problems"]
    assert problem["field"] == "data.source" and "prepare the dataset again" in problem["message"]


def test_epochs_are_counted_into_steps_at_submission(pool, dataset):
    spec = dataset_job("epochs", dataset)
    spec["train"] = {"global_batch": 4, "epochs": 2}
    r = submitted(pool, spec)
    assert r.status_code == 201, r.text
    job = pool.client.job(r.json()["id"])
    train = read_manifest(dataset).splits["train"]
    assert job.steps == -(-2 * ((train.tokens - 1) // 32) // 4)  # ceil(2 * windows / batch)
    assert "epochs" not in job.spec["train"]
    pool.client.cancel(job.id)


def test_a_shard_changed_after_preparation_fails_the_first_start_naming_it(pool, dataset):
    """Admission reads only the manifest; the agent hashes each split's first shard before any
    rank starts, so a shard rewritten in place (same size, one byte) never reaches training."""
    changed = pool.data / "agent" / "changed"
    shutil.copytree(dataset, changed)
    shard = read_manifest(changed).splits["train"].shards[0].name
    path = changed / "train" / shard
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    r = submitted(pool, dataset_job("changed", changed))
    assert r.status_code == 201, r.text
    job = wait_phase(pool.client, r.json()["id"], ("Failed", "Succeeded"), 60)
    failed = job.condition("Failed")
    assert job.phase == "Failed" and "exited with code 2" in failed.message, failed
    assert shard in failed.message and "data.source" in failed.message, failed
