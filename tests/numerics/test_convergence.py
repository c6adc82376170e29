import statistics

import pytest

from tests.launch import summary, train


@pytest.mark.slow
def test_tiny_reaches_entropy_floor(tmp_path):
    spec = {"name": "conv", "model": {"preset": "tiny"},
            "train": {"steps": 250, "global_batch": 64, "lr": 3.0e-3, "warmup_steps": 20}}
    records = train(spec, tmp_path)
    floor = summary(tmp_path)["entropy_floor"]
    assert 0 < floor < records[0]["loss"]
    tail = statistics.mean(r["loss"] for r in records[-20:])  # one batch is noisy; average the tail
    assert tail < 1.10 * floor, f"mean loss of the last 20 steps {tail:.4f} vs entropy floor {floor:.4f}"
