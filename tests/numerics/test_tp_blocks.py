import json
import os
import subprocess
import sys

from tests.launch import ROOT


def test_tp_blocks_match_unsharded():
    # tests/rankrun.py, not torchrun: its launcher would import torch first (~2 s of CPU)
    cmd = [
        sys.executable,
        "-m",
        "tests.rankrun",
        "--nproc-per-node=2",
        "-m",
        "tests.numerics.tp_block_check",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = {r["block"]: r for r in map(json.loads, proc.stdout.strip().splitlines())}
    assert set(results) == {"mlp", "attention"}
    for name, r in results.items():
        assert r["sharded"], f"{name}: TP did not shard every weight"
        assert r["out_l2"] < 1e-6, f"{name}: forward differs by {r['out_l2']}"
        assert len(r["grad_l2"]) == (3 if name == "mlp" else 4)
        for weight, diff in r["grad_l2"].items():
            assert diff < 1e-6, f"{name}.{weight}: gradient differs by {diff}"
