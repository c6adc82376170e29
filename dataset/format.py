"""The prepared-dataset format (docs/data.md, "Format"): what `meshkeeper data prepare` writes
and every reader checks. Torch- and numpy-free: the controller reads it at admission.

    DIR/manifest.json          written last (atomically): its presence means "complete"
    DIR/{split}/shard-NNNNN.bin  little-endian uint16 or uint32 token ids, back to back
    DIR/{split}/docs.bin       little-endian uint64: each document's end offset in the split

A split's token stream is its shards concatenated; every document ends with `eos_id`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "val")
HASH_CHUNK = 1 << 22


class DatasetError(ValueError):
    """A dataset that cannot be read as given; the message names the file and the fix."""


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ShardEntry(Frozen):
    # a bare file name: a manifest must not lead a reader out of its dataset's directory
    name: str = Field(
        pattern=r"^shard-[0-9]{5,}\.bin$", description="file under the split's directory"
    )
    tokens: int = Field(ge=0, description="token ids the file holds")
    sha256: str = Field(description="of the file's bytes")


class SplitEntry(Frozen):
    documents: int = Field(ge=0)
    tokens: int = Field(ge=0, description="every shard's tokens, EOS ids included")
    shards: tuple[ShardEntry, ...]
    docs_sha256: str = Field(description="of docs.bin, the documents' end offsets")


class TokenizerEntry(Frozen):
    sha256: str = Field(description="of the tokenizer.json's bytes")
    vocab_size: int = Field(gt=0, description="ids the tokenizer can emit, added tokens included")
    source: str = Field(description="the path it was read from, for people")


class InputEntry(Frozen):
    name: str
    bytes: int = Field(ge=0)
    documents: int = Field(ge=0)
    skipped: int = Field(default=0, ge=0, description="bad records left out (--skip-bad-records)")
    sha256: str | None = Field(
        default=None, description="of the file's bytes: a re-run over the same inputs is a no-op"
    )


class SplitRule(Frozen):
    seed: int = Field(ge=0)
    fraction: float | None = Field(default=None, ge=0, le=1)
    docs: int | None = Field(default=None, ge=0)


class Manifest(Frozen):
    format: Literal[1] = FORMAT_VERSION
    dtype: Literal["uint16", "uint32"]
    eos_id: int = Field(ge=0)
    tokenizer: TokenizerEntry
    split: SplitRule
    inputs: tuple[InputEntry, ...]
    options: dict[str, str | int | float | bool | None] = Field(
        default_factory=dict, description="the options that shaped the output (re-runs compare)"
    )
    splits: dict[Literal["train", "val"], SplitEntry]

    @property
    def skipped(self) -> int:
        return sum(i.skipped for i in self.inputs)

    def tokens(self, split: str) -> int:
        """The split's token count; 0 for a split the preparation left empty (and out)."""
        entry = self.splits.get(split)
        return entry.tokens if entry else 0

    def itemsize(self) -> int:
        return 2 if self.dtype == "uint16" else 4


def content_id(manifest: Manifest) -> str:
    """What the token streams are, wherever the directory lies: the same shards, index,
    tokenizer and EOS give the same id (a checkpoint records it; a resume compares)."""
    body = json.dumps(
        [manifest.dtype, manifest.eos_id, manifest.tokenizer.sha256]
        + [[name, entry.model_dump(mode="json")] for name, entry in sorted(manifest.splits.items())]
    )
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def read_manifest(directory: str | Path) -> Manifest:
    """DIR's manifest, or DatasetError naming the file and the fix."""
    path = Path(directory) / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise DatasetError(
            f"{path} does not exist: {directory} is not a prepared dataset, or its "
            "preparation did not finish; run `meshkeeper data prepare ... --out "
            f"{directory}` (again)"
        ) from None
    except OSError as e:
        raise DatasetError(f"cannot read {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DatasetError(f"{path} is not JSON ({e}); prepare the dataset again") from None
    try:
        manifest = Manifest.model_validate(raw)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise DatasetError(
            f"{path}: {where}: {first['msg']}; it was not written by this version of "
            "`meshkeeper data prepare`: prepare the dataset again"
        ) from None
    if manifest.tokenizer.vocab_size > (1 << 16) and manifest.dtype == "uint16":
        raise DatasetError(f"{path}: a vocabulary of {manifest.tokenizer.vocab_size} needs uint32")
    return manifest


def split_dir(directory: str | Path, split: str) -> Path:
    """DIR/split, refused where a link leads it out of DIR."""
    path = Path(directory) / split
    if Path(os.path.realpath(path)).parent != Path(os.path.realpath(directory)):
        raise DatasetError(f"{path} leads out of {directory} (a link); prepare the dataset again")
    return path


def shard_path(directory: str | Path, split: str, name: str) -> Path:
    return split_dir(directory, split) / name


def docs_path(directory: str | Path, split: str) -> Path:
    return split_dir(directory, split) / "docs.bin"


def verify_files(
    directory: str | Path, manifest: Manifest, every: int = 1, progress=lambda done, total: None
) -> None:
    """Check each shard's size and sha256 (every `every`-th shard of each split, the first
    always; 1: all of them) and every document index; DatasetError naming the first file
    that differs. `progress(bytes done, bytes total)` after each file."""
    files: list[tuple[Path, str, int | None]] = []
    for split, entry in manifest.splits.items():
        for i, shard in enumerate(entry.shards):
            if i % every == 0:
                files.append(
                    (
                        shard_path(directory, split, shard.name),
                        shard.sha256,
                        shard.tokens * manifest.itemsize(),
                    )
                )
        files.append((docs_path(directory, split), entry.docs_sha256, entry.documents * 8))
    total, done = sum(size or 0 for _, _, size in files), 0
    for path, want, size in files:
        try:
            actual = path.stat().st_size
        except OSError:
            raise DatasetError(
                f"{path} is missing; the dataset is incomplete: prepare it again"
            ) from None
        if actual != size:
            raise DatasetError(
                f"{path} holds {actual} bytes where the manifest says {size}; the file was "
                "changed or cut short: prepare the dataset again"
            )
        if sha256_file(path) != want:
            raise DatasetError(
                f"{path} does not match its sha256 in the manifest; the file was changed or "
                "corrupted: prepare the dataset again"
            )
        done += size
        progress(done, total)
