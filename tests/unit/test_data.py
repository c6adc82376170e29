import numpy as np
import pytest

from dataset.format import DatasetError
from dataset.synthetic import SyntheticMarkov
from services.spec import DataSpec, ModelSpec
from worker.trainer.data import Batches

TINY = ModelSpec(preset="tiny")


def test_batches_are_a_pure_function_of_seed_and_step():
    a = Batches(DataSpec(seed=5), TINY, global_batch=8, dp=1)
    b = Batches(DataSpec(seed=5), TINY, global_batch=8, dp=1)
    assert np.array_equal(a.local(3, 0)[0], b.local(3, 0)[0])
    assert not np.array_equal(a.local(3, 0)[0], a.local(4, 0)[0])
    assert not np.array_equal(
        a.local(3, 0)[0], Batches(DataSpec(seed=6), TINY, 8, 1).local(3, 0)[0]
    )


def test_dp_ranks_split_the_same_global_batch():
    whole_x, whole_y = Batches(DataSpec(), TINY, 8, dp=1).local(2, 0)
    halves = Batches(DataSpec(), TINY, 8, dp=2)
    assert np.array_equal(np.concatenate([halves.local(2, r)[0] for r in range(2)]), whole_x)
    assert np.array_equal(whole_x[:, 1:], whole_y[:, :-1])  # targets are inputs shifted by one


def test_markov_entropy_floor_matches_empirical_estimate():
    chain = SyntheticMarkov(vocab=16, seed=1)
    seq = chain.samples(0, range(200), 400)
    # the model-free estimate: negative log-likelihood under the true transition probabilities
    nll = -np.log(chain.probability(seq[:, :-1], seq[:, 1:])).mean()
    assert nll == pytest.approx(chain.entropy_floor(), rel=0.03)


def test_markov_chain_is_doubly_stochastic_so_uniform_is_stationary():
    chain = SyntheticMarkov(vocab=16, seed=3)
    tokens = np.arange(16)
    dense = chain.probability(tokens[:, None], tokens[None, :])  # dense only at a tiny vocab
    assert dense.sum(axis=1) == pytest.approx(np.ones(16), abs=1e-12)
    assert dense.sum(axis=0) == pytest.approx(np.ones(16), abs=1e-12)


def test_markov_chain_memory_is_linear_in_vocab():
    """The 1b presets' vocab: a dense transition matrix would be 131 GB of float64."""
    vocab = 128_256
    chain = SyntheticMarkov(vocab=vocab, seed=0)
    assert chain.successors.nbytes == vocab * 4 * 8
    assert 0 < chain.entropy_floor() < np.log(4)  # at most uniform over 4 successors
    seq = chain.samples(0, range(2), 64)
    assert int(seq.max()) < vocab
    assert chain.probability(seq[:, :-1], seq[:, 1:]).min() > 0  # only real transitions


def test_text_and_token_files(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_bytes(bytes(range(256)) * 4)
    x, y = Batches(DataSpec(source=f"text:{text}"), TINY, 4, 1).local(0, 0)
    assert x.shape == (4, TINY.seq_len) and int(x.max()) < 256
    tokens = tmp_path / "tokens.bin"
    (np.arange(1000) % 200).astype(np.uint32).tofile(tokens)
    x, _ = Batches(DataSpec(source=f"tokens:{tokens}", token_dtype="uint32"), TINY, 4, 1).local(
        1, 0
    )
    assert bool(((x[:, 1:] - x[:, :-1]) % 200 == 1).all())  # consecutive windows of the file


def test_file_errors_name_the_fix(tmp_path):
    with pytest.raises(DatasetError, match="does not exist"):
        Batches(DataSpec(source=f"text:{tmp_path / 'nope'}"), TINY, 4, 1)
    short = tmp_path / "short.txt"
    short.write_bytes(b"abc")
    with pytest.raises(DatasetError, match="fewer than seq_len"):
        Batches(DataSpec(source=f"text:{short}"), TINY, 4, 1).local(0, 0)
    big = tmp_path / "big.bin"
    np.full(500, 60000, dtype=np.uint16).tofile(big)
    with pytest.raises(DatasetError, match="raise model.vocab"):
        Batches(DataSpec(source=f"tokens:{big}"), TINY, 4, 1).local(0, 0)
