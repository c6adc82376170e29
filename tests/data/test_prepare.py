"""`meshkeeper data prepare` over every input format: the manifest, the shards, the ids."""

from __future__ import annotations

import json
import re

from tokenizers import Tokenizer, models, pre_tokenizers, processors

from dataset.format import sha256_file, shard_path
from tests.data.conftest import split_docs, write_jsonl, write_parquet


def test_every_format_becomes_the_tokenizers_own_ids(tmp_path, prepare, cli, docs, tok):
    inputs = tmp_path / "in"
    (inputs / "d").mkdir(parents=True)
    write_jsonl(inputs / "a.jsonl", docs[:100])
    write_jsonl(inputs / "b.jsonl.gz", docs[100:200], field="body")
    write_parquet(inputs / "c.parquet", docs[200:300], field="body")
    for i, text in enumerate(docs[300:320]):
        (inputs / "d" / f"{i:02d}.txt").write_text(text, encoding="utf-8")
    (inputs / "d" / "README.md").write_text("not data: a directory keeps only known formats")
    out = tmp_path / "ds"
    # --text-field names the field of every input: here only a.jsonl lacks it, so two runs
    args = ["--shard-tokens", 4096, "--val-fraction", 0.2, "--workers", 2]
    r = prepare([inputs / "a.jsonl", inputs / "d"], out, *args)
    assert r.rc == 0, r.err
    body = prepare(
        [inputs / "b.jsonl.gz", inputs / "c.parquet"],
        tmp_path / "ds2",
        "--text-field",
        "body",
        *args,
    )
    assert body.rc == 0, body.err

    eos = tok.token_to_id("<|endoftext|>")
    for directory, expected in (
        (out, docs[:100] + docs[300:320]),
        (tmp_path / "ds2", docs[100:300]),
    ):
        m = json.loads((directory / "manifest.json").read_text())
        train, val = split_docs(directory, "train"), split_docs(directory, "val")
        assert len(train) + len(val) == len(expected) and train and val
        assert sum(i["documents"] for i in m["inputs"]) == len(expected)
        assert (
            m["eos_id"] == eos and m["dtype"] == "uint16" and m["tokenizer"]["vocab_size"] == 1000
        )
        # each document, in input order, is the next one of train or of val: exactly the
        # tokenizer's own encoding, then EOS
        t = v = 0
        for text in expected:
            want = tok.encode(text).ids + [eos]
            if t < len(train) and train[t] == want:
                t += 1
            else:
                assert val[v] == want, text[:60]
                v += 1
        for split, entry in m["splits"].items():
            assert entry["tokens"] == sum(len(d) for d in split_docs(directory, split))
            assert len(entry["shards"]) == -(-entry["tokens"] // 4096)
            for s in entry["shards"]:
                assert sha256_file(shard_path(directory, split, s["name"])) == s["sha256"]
        v = cli("data", "verify", directory)
        assert v.rc == 0 and f"train: {len(train):,} documents" in v.out, v.err
    assert r.out.splitlines()[-3:] == [
        f'data: {{source: "dataset:{out.resolve()}"}}',
        "model: {vocab: 1000}  # at least this many ids",
        "# a job reads it only under a data root (--data-root; meshkeeper up: RUN_DIR/data)",
    ]
    names = [i["name"] for i in json.loads((out / "manifest.json").read_text())["inputs"]]
    assert names == [str(inputs / "a.jsonl")] + [
        str(inputs / "d" / f"{i:02d}.txt") for i in range(20)
    ]


def test_txt_paragraphs_and_globs(tmp_path, prepare, docs, tok):
    paras = [p.strip() for d in docs for p in re.split(r"\n\s*\n", d) if p.strip()][:30]
    (tmp_path / "p.txt").write_text("\n\n  \n".join(paras) + "\n", encoding="utf-8")
    out = tmp_path / "ds"
    r = prepare([tmp_path / "*.txt"], out, "--split-on-blank-lines", "--val-fraction", 0)
    assert r.rc == 0, r.err
    eos = tok.token_to_id("<|endoftext|>")
    assert split_docs(out, "train") == [tok.encode(p).ids + [eos] for p in paras]
    assert "val" not in json.loads((out / "manifest.json").read_text())["splits"]


def test_end_of_document_id(tmp_path, cli, docs, tokenizer_file):
    raw = json.loads(tokenizer_file.read_text())
    for t in raw["added_tokens"]:  # the EOS renamed: no token any tokenizer ends text with
        t["content"] = "<|sep|>"
    raw["model"]["vocab"]["<|sep|>"] = raw["model"]["vocab"].pop("<|endoftext|>")
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(raw))
    write_jsonl(tmp_path / "a.jsonl", docs[:20])
    base = ["data", "prepare", tmp_path / "a.jsonl", "--quiet", "--workers", 1]
    r = cli(*base, "--tokenizer", plain, "--out", tmp_path / "x")
    assert r.rc == 1 and "has no end-of-text token" in r.err and "--eos-id" in r.err, r.err
    r = cli(*base, "--tokenizer", plain, "--out", tmp_path / "x", "--eos-id", 1000)
    assert r.rc == 1 and "1000" in r.err and "--eos-id below 1000" in r.err, r.err
    r = cli(*base, "--tokenizer", plain, "--out", tmp_path / "x", "--eos-id", 7)
    assert r.rc == 0 and json.loads((tmp_path / "x" / "manifest.json").read_text())["eos_id"] == 7

    # a model directory: its tokenizer_config.json names the EOS, over the guess by name
    model = tmp_path / "model"
    model.mkdir()
    tok = Tokenizer.from_file(str(tokenizer_file))
    tok.add_special_tokens(["<|eot_id|>"])
    tok.save(str(model / "tokenizer.json"))
    (model / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    r = cli(*base, "--tokenizer", model, "--out", tmp_path / "y")
    assert r.rc == 0, r.err
    m = json.loads((tmp_path / "y" / "manifest.json").read_text())
    assert m["eos_id"] == tok.token_to_id("<|eot_id|>") == 1000
    assert m["tokenizer"]["vocab_size"] == 1001


def test_an_id_outside_the_vocabulary_names_the_record(tmp_path, cli, docs, tokenizer_file):
    tok = Tokenizer.from_file(str(tokenizer_file))
    # a post-processor's special token need not be in the vocabulary: id 5000 of 1000
    tok.post_processor = processors.TemplateProcessing(
        single="$A [X]", special_tokens=[("[X]", 5000)]
    )
    tok.save(str(tmp_path / "broken.json"))
    write_jsonl(tmp_path / "a.jsonl", docs[:3])
    r = cli(
        "data",
        "prepare",
        tmp_path / "a.jsonl",
        "--tokenizer",
        tmp_path / "broken.json",
        "--out",
        tmp_path / "x",
        "--quiet",
        "--workers",
        1,
    )
    assert r.rc == 1 and f"{tmp_path / 'a.jsonl'}:1: the tokenizer gave id 5000" in r.err, r.err
    assert not (tmp_path / "x" / "manifest.json").exists()


def test_a_vocabulary_past_65536_ids_is_stored_as_uint32(tmp_path, cli):
    """Ids above 2**16 survive: a uint16 shard would wrap them to other tokens silently."""
    words = [f"w{i}" for i in range(70_000)]
    vocab = {w: i for i, w in enumerate(words)} | {"[UNK]": 70_000, "<|endoftext|>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "wide.json"))
    texts = ["w69999 w65536 w1", "w65535 w0", "w42 w68000"]
    write_jsonl(tmp_path / "a.jsonl", texts)
    out = tmp_path / "ds"
    args = ["--tokenizer", tmp_path / "wide.json", "--out", out, "--quiet", "--workers", 1]
    r = cli("data", "prepare", tmp_path / "a.jsonl", *args, "--val-docs", 0)
    assert r.rc == 0, r.err
    assert json.loads((out / "manifest.json").read_text())["dtype"] == "uint32"
    want = sorted(tok.encode(t).ids + [70_001] for t in texts)
    assert sorted(split_docs(out, "train")) == want and max(max(d) for d in want) == 70_001


def test_the_progress_bar_counts_documents_and_tokens_on_stderr(
    tmp_path, cli, docs, tokenizer_file
):
    write_jsonl(tmp_path / "a.jsonl", docs[:50])
    out = tmp_path / "ds"
    args = ["--tokenizer", tokenizer_file, "--out", out, "--workers", 1, "--val-docs", 0]
    r = cli("data", "prepare", tmp_path / "a.jsonl", *args)
    assert r.rc == 0, r.err
    tokens = json.loads((out / "manifest.json").read_text())["splits"]["train"]["tokens"]
    bar = r.err.strip().splitlines()[-1]
    assert bar.startswith("prepare") and f"50 docs {tokens:,} tokens" in bar, r.err
    assert "docs" not in r.out  # stdout keeps the summary alone, for scripts
