"""The held-out split is a function of each document's text: adding files moves nothing."""

from __future__ import annotations

import pytest

from tests.data.conftest import split_docs, write_jsonl


def membership(directory) -> dict[tuple, str]:
    return {tuple(d): s for s in ("train", "val") for d in split_docs(directory, s)}


@pytest.mark.parametrize("rule", [["--val-fraction", 0.25], ["--val-docs", 40]])
def test_adding_a_file_moves_no_train_document_into_val(tmp_path, prepare, docs, rule):
    first = write_jsonl(tmp_path / "b.jsonl", docs[:200])
    added = write_jsonl(tmp_path / "a.jsonl", docs[200:400])  # sorts first: shifts every row
    assert prepare([first], tmp_path / "one", *rule).rc == 0
    assert prepare([first, added], tmp_path / "two", *rule).rc == 0
    before, after = membership(tmp_path / "one"), membership(tmp_path / "two")
    assert 10 < sum(s == "val" for s in before.values()) < 100
    moved = {d: (s, after[d]) for d, s in before.items() if after[d] != s}
    if rule[0] == "--val-fraction":
        assert not moved  # each document's split depends on its text alone
    else:
        # the 40 smallest hashes of 400 documents: some val documents of the first run
        # became train, and no train document became val
        assert moved and set(moved.values()) == {("val", "train")}
        assert sum(s == "val" for s in after.values()) == 40


def test_the_seed_draws_another_split(tmp_path, prepare, docs):
    data = write_jsonl(tmp_path / "a.jsonl", docs[:200])
    assert prepare([data], tmp_path / "s0", "--val-fraction", 0.3).rc == 0
    assert prepare([data], tmp_path / "s1", "--val-fraction", 0.3, "--split-seed", 1).rc == 0
    assert membership(tmp_path / "s0") != membership(tmp_path / "s1")
