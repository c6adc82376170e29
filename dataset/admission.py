"""What a job spec asks of a prepared dataset, checked before any rank starts (docs/data.md,
"Admission"): the manifest reads, its vocabulary fits the model, its tokenizer is the model's,
and its splits hold the windows the spec needs. `train.epochs` becomes `train.steps` here.
Torch- and numpy-free: the controller and the CLI run it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from dataset.format import (
    MANIFEST,
    DatasetError,
    Manifest,
    read_manifest,
    sha256_file,
    verify_files,
)
from services.paths import PathRefused, confine
from services.spec import JobSpec, Problem, SpecError

SOURCE = "data.source"
# shards hashed at a job's first start: the first of each split (verify_files samples every
# this many); more would cost seconds per GB before the first step
SAMPLE_EVERY = 1 << 30


def windows(tokens: int, seq_len: int) -> int:
    """Packed windows of seq_len + 1 tokens in a split (dataset/sampler.py)."""
    return max(0, (tokens - 1) // seq_len)


def with_epochs(spec: dict, roots: Sequence[Path] | None = None) -> dict:
    """The spec (plain dict form) with `train.epochs` turned into `train.steps`: enough steps
    to visit every training window that many times. `roots`: confine the dataset first (the
    controller, for a client's spec); None reads it as given (the CLI, on its own files)."""
    train = spec.get("train") if isinstance(spec, dict) else None
    if not isinstance(train, dict) or "epochs" not in train:
        return spec
    epochs = train["epochs"]
    if isinstance(epochs, bool) or not isinstance(epochs, (int, float)) or not epochs > 0:
        raise SpecError([Problem("train.epochs", f"must be a number > 0 (got {epochs!r})")])
    if "steps" in train:
        raise SpecError(
            [Problem("train.epochs", "train.steps and train.epochs exclude each other; give one")]
        )
    source = str((spec.get("data") or {}).get("source", "synthetic"))
    kind, _, path = source.partition(":")
    if kind != "dataset":
        raise SpecError(
            [
                Problem(
                    "train.epochs",
                    f"counts passes over a prepared dataset, and data.source is {source!r}; "
                    "give train.steps, or use data.source dataset:DIR",
                )
            ]
        )
    seq_len, batch = (spec.get("model") or {}).get("seq_len"), train.get("global_batch")
    if not isinstance(seq_len, int) or not isinstance(batch, int) or seq_len < 1 or batch < 1:
        raise SpecError(
            [Problem("train.epochs", "needs model.seq_len and train.global_batch to count steps")]
        )
    try:
        if roots is not None:
            path = str(confine(str(Path(path) / MANIFEST), roots, must_exist=True).parent)
        manifest = read_manifest(path)
    except (PathRefused, DatasetError) as e:
        raise SpecError([Problem("train.epochs", f"{e}; or give train.steps")]) from None
    count = windows(manifest.splits["train"].tokens, seq_len)
    steps = max(1, math.ceil(epochs * count / batch))
    rest = {k: v for k, v in train.items() if k != "epochs"}
    return {**spec, "train": {**rest, "steps": steps}}


def dataset_problems(spec: JobSpec, manifest: Manifest) -> list[Problem]:
    """Why `manifest` cannot serve `spec`; each problem names both sides and the fix."""
    out: list[Problem] = []
    m, where = spec.model, spec.data.path
    vocab = manifest.tokenizer.vocab_size
    if vocab > m.vocab:
        out.append(
            Problem(
                "model.vocab",
                f"{m.vocab} is smaller than the vocabulary of {where}'s tokenizer ({vocab}); "
                f"raise model.vocab to at least {vocab}, or prepare the data with the model's "
                "tokenizer",
            )
        )
    if m.hf and (tok := Path(m.hf) / "tokenizer.json").is_file():
        ours = sha256_file(tok)
        if ours != manifest.tokenizer.sha256:
            out.append(
                Problem(
                    SOURCE,
                    f"{where} was tokenized with {manifest.tokenizer.source} (sha256 "
                    f"{manifest.tokenizer.sha256[:12]}), not with model.hf's {tok} (sha256 "
                    f"{ours[:12]}); prepare the data again with --tokenizer {m.hf}",
                )
            )
    if windows(manifest.splits["train"].tokens, m.seq_len) == 0:
        out.append(
            Problem(
                SOURCE,
                f"the training split of {where} holds {manifest.splits['train'].tokens} tokens, "
                f"fewer than seq_len+1 = {m.seq_len + 1}; use more data or a shorter seq_len",
            )
        )
    if spec.eval:
        need = spec.eval.batches * spec.train.global_batch
        have = windows(manifest.splits["val"].tokens, m.seq_len)
        if need > have:
            out.append(
                Problem(
                    "eval.batches",
                    f"{spec.eval.batches} batches of {spec.train.global_batch} need {need} "
                    f"held-out windows of {m.seq_len + 1} tokens; the validation split of "
                    f"{where} holds {have}: lower eval.batches, or prepare with a larger "
                    "--val-fraction",
                )
            )
    return out


def check_dataset(spec: JobSpec, sample_shards: bool = False) -> None:
    """SpecError unless the spec's dataset (if any) serves it; the path is already confined.
    `sample_shards`: also hash each split's first shard and document index against the
    manifest (a job's first start: `meshkeeper data verify` checks every shard)."""
    if spec.data.kind != "dataset":
        return
    try:
        manifest = read_manifest(spec.data.path)
        if not (problems := dataset_problems(spec, manifest)) and sample_shards:
            verify_files(spec.data.path, manifest, every=SAMPLE_EVERY)
    except DatasetError as e:
        raise SpecError([Problem(SOURCE, str(e))]) from None
    if problems:
        raise SpecError(problems)
