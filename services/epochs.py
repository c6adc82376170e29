"""`train.epochs` counted into `train.steps` from a prepared dataset's manifest (docs/data.md,
"Epochs"), wherever a spec is read: `load_spec` (the CLI, a standalone trainer) and the
controller's submission (confined to its data roots first)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from dataset.format import MANIFEST, DatasetError, read_manifest
from services.paths import PathRefused, confine
from services.spec_types import Problem, SpecError


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
    count = windows(manifest.tokens("train"), seq_len)
    steps = max(1, math.ceil(epochs * count / batch))
    rest = {k: v for k, v in train.items() if k != "epochs"}
    return {**spec, "train": {**rest, "steps": steps}}
