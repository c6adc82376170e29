"""The window order (dataset/sampler.py): a bijection per epoch, keyed by (seed, epoch), and
packed windows that make every token after the first a target exactly once."""

from __future__ import annotations

import numpy as np
import pytest

from dataset.sampler import EpochSampler, PackedWindows, Permutation
from dataset.tokens import MappedFile, TokenStream


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 4097])
def test_each_order_is_a_permutation(n):
    order = [Permutation(n, seed=7, stream=0)[i] for i in range(n)]
    assert sorted(order) == list(range(n))


def test_order_is_a_function_of_seed_and_epoch_alone():
    n = 500
    first = [Permutation(n, 7, 0)[i] for i in range(n)]
    assert first == [Permutation(n, 7, 0)[i] for i in range(n)]
    assert first != [Permutation(n, 7, 1)[i] for i in range(n)]  # the next epoch
    assert first != [Permutation(n, 8, 0)[i] for i in range(n)]  # another seed
    assert first != list(range(n))  # shuffled, not the identity


def test_index_outside_the_range_is_refused():
    with pytest.raises(IndexError):
        Permutation(10, 0, 0)[10]


def stream_of(tmp_path, tokens: np.ndarray, parts: int) -> TokenStream:
    """`tokens` split over `parts` files, mapped back to back as a prepared split's shards."""
    maps = []
    for i, chunk in enumerate(np.array_split(tokens, parts)):
        path = tmp_path / f"shard-{i:05d}.bin"
        chunk.astype(np.uint16).tofile(path)
        maps.append(MappedFile(path, "uint16", "test"))
    return TokenStream(maps)


def test_reads_cross_shard_boundaries(tmp_path):
    tokens = np.arange(1000) % 60000
    stream = stream_of(tmp_path, tokens, parts=7)
    assert len(stream) == 1000
    for start, length in [(0, 1000), (140, 30), (142, 1), (999, 1), (500, 300)]:
        assert np.array_equal(stream.read(start, length), tokens[start : start + length])


def test_one_epoch_targets_every_token_once(tmp_path):
    tokens = np.arange(1001)  # token i is its own position: targets name what was read
    windows = PackedWindows(stream_of(tmp_path, tokens, parts=3), length=9)
    sampler = EpochSampler(windows, seed=3)
    assert windows.count == 125
    epoch0 = sampler.samples(range(125))
    assert sorted(epoch0[:, 1:].ravel().tolist()) == list(range(1, 1001))
    assert {sampler.epoch_of(i) for i in range(125)} == {0}
    epoch1 = sampler.samples(range(125, 250))
    assert sampler.epoch_of(125) == 1
    assert sorted(epoch1[:, 1:].ravel().tolist()) == list(range(1, 1001))
    assert not np.array_equal(epoch0, epoch1)  # the same windows, in another order
