"""Every `data.source` behind one interface: training samples by global index, the epoch an
index falls in, and held-out samples for validation (docs/data.md, "Sources")."""

from __future__ import annotations

import numpy as np

from dataset.format import DatasetError, read_manifest
from dataset.sampler import EpochSampler, PackedWindows, Permutation
from dataset.synthetic import SyntheticMarkov
from dataset.tokens import TokenStream

# Validation's window order is its own stream, apart from every epoch's (epochs are >= 0).
EVAL_STREAM = -1
# Synthetic validation samples come from indices training never reaches (steps x batch < 2**62).
SYNTHETIC_HELD_OUT = 1 << 62


class Synthetic:
    """The seeded Markov chain: unbounded, no epochs."""

    windows = None

    def __init__(self, vocab: int, seed: int, length: int):
        self.chain, self.seed, self.length = SyntheticMarkov(vocab, seed), seed, length

    def train(self, indices: range) -> np.ndarray:
        return self.chain.samples(self.seed, indices, self.length)

    def epoch_of(self, index: int) -> int | None:
        return None

    def held_out(self, indices: range) -> np.ndarray:
        shifted = range(SYNTHETIC_HELD_OUT + indices.start, SYNTHETIC_HELD_OUT + indices.stop)
        return self.chain.samples(self.seed, shifted, self.length)

    def entropy_floor(self) -> float:
        return self.chain.entropy_floor()


class Packed:
    """Packed windows of a finite token stream, every one once per epoch; a prepared
    dataset's held-out split in a fixed order for validation."""

    def __init__(
        self, train: TokenStream, held_out: TokenStream | None, vocab: int, seed: int, length: int
    ):
        windows = PackedWindows(train, length)
        if windows.count == 0:
            raise DatasetError(
                f"data.source: the training data holds {len(train)} tokens, fewer than "
                f"seq_len+1 = {length}; use more data or a shorter model.seq_len"
            )
        self.sampler, self.vocab, self.seed = EpochSampler(windows, seed), vocab, seed
        self.windows = windows.count
        self.val = PackedWindows(held_out, length) if held_out is not None else None

    def train(self, indices: range) -> np.ndarray:
        return self._checked(self.sampler.samples(indices))

    def epoch_of(self, index: int) -> int | None:
        return self.sampler.epoch_of(index)

    def held_out(self, indices: range) -> np.ndarray:
        count = self.val.count if self.val else 0
        if indices.stop > count:
            raise DatasetError(
                f"eval: needs {indices.stop} held-out windows but the validation split holds "
                f"{count}; lower eval.batches or prepare with a larger --val-fraction"
            )
        order = Permutation(count, self.seed, EVAL_STREAM)
        return self._checked(np.stack([self.val.window(order[i]) for i in indices]))

    def entropy_floor(self) -> None:
        return None

    def _checked(self, out: np.ndarray) -> np.ndarray:
        if out.max(initial=0) >= self.vocab:
            raise DatasetError(
                f"data.source: token id {int(out.max())} >= model.vocab {self.vocab}; "
                "raise model.vocab or check data.token_dtype"
            )
        return out


def open_source(source: str, token_dtype: str, vocab: int, seed: int, length: int):
    """The source `data.source` names, for windows of `length` tokens."""
    kind, _, path = source.partition(":")
    if kind == "synthetic":
        return Synthetic(vocab, seed, length)
    if kind == "dataset":
        manifest = read_manifest(path)
        return Packed(
            TokenStream.of_split(path, manifest, "train"),
            TokenStream.of_split(path, manifest, "val") if manifest.tokens("val") else None,
            vocab,
            seed,
            length,
        )
    dtype = "uint8" if kind == "text" else token_dtype
    return Packed(TokenStream.of_file(path, dtype), None, vocab, seed, length)
