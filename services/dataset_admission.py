"""What a job spec asks of a prepared dataset, checked before any rank starts (docs/data.md,
"Admission"): the manifest reads, its vocabulary fits the model, its tokenizer is the model's,
and its splits hold the windows the spec needs. Torch- and numpy-free: the controller runs it
at submission, the agent on its host."""

from __future__ import annotations

from pathlib import Path

from dataset.format import DatasetError, Manifest, read_manifest, sha256_file, verify_files
from services.epochs import windows
from services.spec import JobSpec, Problem, SpecError

SOURCE = "data.source"
# shards hashed at a job's first start: the first of each split (verify_files samples every
# this many); more would cost seconds per GB before the first step
SAMPLE_EVERY = 1 << 30


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
    if windows(manifest.tokens("train"), m.seq_len) == 0:
        out.append(
            Problem(
                SOURCE,
                f"the training split of {where} holds {manifest.tokens('train')} tokens, "
                f"fewer than seq_len+1 = {m.seq_len + 1}; use more data or a shorter seq_len",
            )
        )
    if spec.eval:
        need = spec.eval.batches * spec.train.global_batch
        have = windows(manifest.tokens("val"), m.seq_len)
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
