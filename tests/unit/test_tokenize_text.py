"""scripts/tokenize_text.py: a text file becomes a `tokens:` file the trainer reads."""

import subprocess
import sys

import numpy as np

from services.spec import DataSpec, ModelSpec
from tests.launch import ROOT
from worker.trainer.data import Batches


def test_trained_bpe_tokens_feed_the_trainer(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog\n" * 200, encoding="utf-8")
    out = tmp_path / "corpus.tokens"
    script = ROOT / "scripts" / "tokenize_text.py"
    cmd = [sys.executable, str(script), str(text), str(out), "--vocab", "300"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "token_dtype: uint16" in done.stdout
    assert "only under a data root" in done.stdout  # else the service refuses it, unexplained
    vocab = int(done.stdout.split("model: {vocab: ")[1].split("}")[0])
    assert 256 < vocab <= 300  # the 256 byte ids plus merges, as many as the text allows
    ids = np.fromfile(out, dtype=np.uint16)
    assert 0 < len(ids) < len(text.read_bytes()) and int(ids.max()) < vocab
    model = ModelSpec(layers=1, d_model=8, heads=1, vocab=300, seq_len=16)
    spec = DataSpec(source=f"tokens:{out}", token_dtype="uint16")
    x, _ = Batches(spec, model, 4, 1).local(0, 0)
    assert x.shape == (4, 16) and int(x.max()) < 300
