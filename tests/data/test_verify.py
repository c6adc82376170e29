"""`meshkeeper data verify` catches a changed byte, and what hashes alone cannot show."""

from __future__ import annotations

import json

import numpy as np

from dataset.format import sha256_file
from tests.data.conftest import write_jsonl


def flip(path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_verify_catches_a_flipped_byte(tmp_path, prepare, cli, docs):
    out = tmp_path / "ds"
    assert (
        prepare([write_jsonl(tmp_path / "a.jsonl", docs[:60])], out, "--shard-tokens", 500).rc == 0
    )
    ok = cli("data", "verify", out, "--quiet")
    assert ok.rc == 0 and "every file matches its manifest" in ok.out and "skipped" in ok.out
    shard = out / "train" / "shard-00001.bin"
    flip(shard, 123)
    r = cli("data", "verify", out, "--quiet")
    assert r.rc == 1 and f"meshkeeper: {shard} does not match its sha256" in r.err, r.err
    flip(shard, 123)
    flip(out / "train" / "docs.bin", 0)
    r = cli("data", "verify", out, "--quiet")
    assert r.rc == 1 and "docs.bin does not match its sha256" in r.err, r.err


def test_verify_checks_every_document_ends_with_eos(tmp_path, prepare, cli, docs):
    out = tmp_path / "ds"
    assert prepare([write_jsonl(tmp_path / "a.jsonl", docs[:20])], out, "--val-docs", 0).rc == 0
    # the first document's EOS overwritten, and the manifest's hash made to match: only the
    # structure check can see it
    shard = out / "train" / "shard-00000.bin"
    end = int(np.fromfile(out / "train" / "docs.bin", dtype="<u8")[0])
    ids = np.fromfile(shard, dtype=np.uint16)
    ids[end - 1] = 42
    ids.tofile(shard)
    m = json.loads((out / "manifest.json").read_text())
    m["splits"]["train"]["shards"][0]["sha256"] = sha256_file(shard)
    (out / "manifest.json").write_text(json.dumps(m))
    r = cli("data", "verify", out, "--quiet")
    assert r.rc == 1 and f"{shard}: the document ending at id {end - 1} does not end" in r.err
