"""What a spec asks of a prepared dataset: epochs become steps (services/epochs.py), and a
manifest that cannot serve the spec is refused naming both sides
(services/dataset_admission.py)."""

from __future__ import annotations

import json

import pytest

from dataset.format import Manifest
from services.dataset_admission import dataset_problems
from services.epochs import with_epochs
from services.spec import SpecError, parse_spec
from tests.stack import tiny_spec

TRAIN_TOKENS, VAL_TOKENS = 64 * 100 + 1, 64 * 10 + 1  # 100 and 10 windows at seq_len 64


def manifest(vocab: int = 256, sha: str = "a" * 64) -> Manifest:
    def split(tokens: int) -> dict:
        return {"documents": 1, "tokens": tokens, "shards": [], "docs_sha256": "0" * 64}

    return Manifest.model_validate(
        {
            "dtype": "uint16",
            "eos_id": 0,
            "tokenizer": {"sha256": sha, "vocab_size": vocab, "source": "/t/tokenizer.json"},
            "split": {"seed": 0, "fraction": 0.1},
            "inputs": [],
            "splits": {"train": split(TRAIN_TOKENS), "val": split(VAL_TOKENS)},
        }
    )


@pytest.fixture
def dataset_dir(tmp_path):
    (tmp_path / "manifest.json").write_text(manifest().model_dump_json())
    return tmp_path


def spec_on(directory, **train) -> dict:
    spec = tiny_spec("ds", train={"global_batch": 8, **train})
    spec["model"] = {**spec["model"], "seq_len": 64, "vocab": 256}
    spec["data"] = {"source": f"dataset:{directory}"}
    return spec


def test_epochs_become_the_steps_that_visit_every_window(dataset_dir):
    spec = spec_on(dataset_dir, epochs=2)
    spec["train"].pop("steps", None)
    train = with_epochs(spec)["train"]
    assert train["steps"] == 25 and "epochs" not in train  # ceil(2 * 100 / 8)


def test_epochs_and_steps_exclude_each_other(dataset_dir):
    with pytest.raises(SpecError, match="exclude each other"):
        with_epochs(spec_on(dataset_dir, epochs=1, steps=3))


def test_epochs_need_a_dataset(dataset_dir):
    spec = spec_on(dataset_dir, epochs=1)
    spec["train"].pop("steps", None)
    spec["data"] = {"source": "synthetic"}
    with pytest.raises(SpecError, match="train.epochs: counts passes over a prepared dataset"):
        with_epochs(spec)


def test_epochs_outside_the_roots_are_refused(dataset_dir, tmp_path_factory):
    spec = spec_on(dataset_dir, epochs=1)
    spec["train"].pop("steps", None)
    elsewhere = tmp_path_factory.mktemp("root")
    with pytest.raises(SpecError, match="is not inside the allowed roots"):
        with_epochs(spec, [elsewhere])


def test_a_tokenizer_wider_than_the_model_is_refused_naming_both(dataset_dir):
    spec = parse_spec(spec_on(dataset_dir))
    (problem,) = dataset_problems(spec, manifest(vocab=1000))
    assert problem.field == "model.vocab"
    assert "256" in problem.message and "1000" in problem.message


def test_another_tokenizer_than_the_models_is_refused(dataset_dir, tmp_path_factory):
    hf = tmp_path_factory.mktemp("model")
    (hf / "tokenizer.json").write_text(json.dumps({"model": "not the dataset's"}))
    spec = parse_spec(spec_on(dataset_dir))
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"hf": str(hf)})})
    (problem,) = dataset_problems(spec, manifest())
    assert problem.field == "data.source" and "--tokenizer" in problem.message
    assert str(hf / "tokenizer.json") in problem.message and "/t/tokenizer.json" in problem.message


def test_eval_needs_enough_held_out_windows(dataset_dir):
    ok = parse_spec({**spec_on(dataset_dir), "eval": {"every_steps": 1, "batches": 1}})
    assert dataset_problems(ok, manifest()) == []
    over = parse_spec({**spec_on(dataset_dir), "eval": {"every_steps": 1, "batches": 2}})
    (problem,) = dataset_problems(over, manifest())  # 16 windows wanted, 10 held out
    assert problem.field == "eval.batches" and "--val-fraction" in problem.message


def test_eval_on_a_flat_file_is_refused(tmp_path):
    spec = tiny_spec("ev", train={"steps": 2})
    spec["data"] = {"source": f"tokens:{tmp_path / 'x.bin'}"}
    spec["eval"] = {"every_steps": 1}
    with pytest.raises(SpecError, match="eval: a tokens: file has no held-out split"):
        parse_spec(spec)
