"""Training on a prepared dataset with real processes: layout parity for the training and the
validation loss, a few hundred steps on real text read back through TensorBoard's own reader,
and a rank's memory that does not grow with the dataset."""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from dataset.format import MANIFEST, Manifest, SplitRule, TokenizerEntry
from dataset.shard_writer import SplitWriter
from tests.corpus import prepared, stdlib_docstrings
from tests.launch import run_ranks, train, trainer_args

pytestmark = pytest.mark.slow

VOCAB, SEQ = 512, 64


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out, _ = prepared(stdlib_docstrings(2_000_000), tmp_path_factory.mktemp("corpus"), VOCAB)
    return out


def spec_on(source: str, steps: int, **sections) -> dict:
    spec = {
        "name": "corpus",
        "model": {"preset": "tiny", "seq_len": SEQ, "vocab": VOCAB},
        "data": {"source": source, "seed": 5},
        "train": {"steps": steps, "global_batch": 8, "lr": 3e-3, "warmup_steps": 2},
    }
    return {**spec, **sections}


def test_layouts_agree_on_training_and_validation_loss(corpus, tmp_path):
    spec = spec_on(f"dataset:{corpus}", 6, eval={"every_steps": 3, "batches": 2})
    single = train(spec, tmp_path / "single")
    meshed = copy.deepcopy(spec)
    meshed["parallel"] = {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2}
    spread = train(meshed, tmp_path / "spread")
    for want, got in zip(single, spread, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5), want["step"]
        assert (got.get("eval_loss") is None) == (want["step"] % 3 != 0)
        if want["step"] % 3 == 0:
            assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)
            assert got["eval_loss"] != want["loss"]  # measured on other batches
        assert got["epoch"] == want["epoch"] == 0


def test_eval_time_is_its_own_and_not_in_the_steps_time(corpus, tmp_path):
    """24 held-out batches every other step cost many training steps' time: it shows in
    eval_s, and the training step's time (so tokens/s and MFU) stays what it was."""
    spec = spec_on(f"dataset:{corpus}", 8, eval={"every_steps": 2, "batches": 24})
    records = train(spec, tmp_path / "run")
    plain = [r["step_s"] for r in records if r.get("eval_s") is None]
    evaluated = [r for r in records if r.get("eval_s") is not None]
    assert len(evaluated) == 4 and len(plain) == 4
    typical = float(np.median(plain))
    for r in evaluated:
        assert r["eval_s"] > 3 * typical, (r, typical)
        assert r["step_s"] < 2 * typical + r["eval_s"] / 4, (r, typical)


def test_a_real_corpus_learns_in_tensorboards_own_reader(corpus, tmp_path):
    steps = 300
    spec = spec_on(f"dataset:{corpus}", steps, eval={"every_steps": 50, "batches": 4})
    records = train(spec, tmp_path / "run", extra=["--run-record", str(tmp_path / "tb")])
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    evals = [(e.step, e.value) for e in events.Scalars("eval/loss")]
    assert [s for s, _ in losses] == list(range(1, steps + 1))
    assert [s for s, _ in evals] == list(range(50, steps + 1, 50))
    assert [v for _, v in evals] == pytest.approx([r["eval_loss"] for r in records[49::50]])
    first, last = evals[0][1], evals[-1][1]
    assert last < first - 0.3, f"eval loss {first:.3f} -> {last:.3f}: the model did not learn"
    assert last < np.log(VOCAB) - 1.5  # far below guessing among the vocabulary


def random_dataset(directory, tokens: int) -> str:
    """A prepared dataset of `tokens` random ids, written by prepare's own shard writer."""
    rng = np.random.default_rng(0)
    splits = {}
    for split, count in (("train", tokens), ("val", 10_000)):
        writer = SplitWriter(directory / split, "uint16", 1 << 26)
        for start in range(0, count, 1 << 24):
            n = min(1 << 24, count - start)
            writer.add(rng.integers(0, VOCAB, n, dtype=np.uint16), np.array([n]))
        splits[split] = writer.close()
    (directory / MANIFEST).write_text(
        Manifest(
            dtype="uint16",
            eos_id=0,
            tokenizer=TokenizerEntry(sha256="0" * 64, vocab_size=VOCAB, source="random"),
            split=SplitRule(seed=0, fraction=0.0),
            inputs=(),
            splits=splits,
        ).model_dump_json()
    )
    return f"dataset:{directory}"


def test_a_ranks_memory_does_not_grow_with_the_dataset(tmp_path):
    peaks = {}
    for name, tokens in (("small", 5 * 10**6), ("large", 540 * 10**6)):  # 10 MB, 1.08 GB
        source = random_dataset(tmp_path / name, tokens)
        records = train(spec_on(source, 20), tmp_path / f"run-{name}")
        peaks[name] = records[-1]["peak_mem_bytes"]
        assert sum(f.stat().st_size for f in (tmp_path / name / "train").iterdir()) >= (tokens * 2)
    assert abs(peaks["large"] - peaks["small"]) <= 64 << 20, peaks


def test_a_resume_onto_another_dataset_is_refused(corpus, tmp_path):
    """The checkpoint records the dataset's content id: the same job resumed after its
    directory was prepared again from other text stops (exit 2) instead of training on."""
    run, root = tmp_path / "run", tmp_path / "root"
    source = tmp_path / "ds"
    shutil.copytree(corpus, source)
    spec = spec_on(f"dataset:{source}", 4, checkpoint={"every_steps": 2, "mode": "sync"})
    train(spec, run, extra=["--checkpoint-root", str(root)])
    shutil.rmtree(source)
    other, _ = prepared(stdlib_docstrings(300_000), tmp_path / "other", VOCAB)
    shutil.copytree(other, source)
    longer = {**spec, "train": {**spec["train"], "steps": 6}}
    world, args = trainer_args(longer, run, ["--checkpoint-root", str(root)])
    out = run_ranks(world, "worker.trainer", args)
    assert "rank 0 exited with 2" in out.stderr, out.stderr[-2000:]
    assert "was trained on another dataset" in out.stderr
