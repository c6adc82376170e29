import json

from tests.launch import run_ranks


def test_tp_blocks_match_unsharded():
    proc = run_ranks(2, "tests.numerics.tp_block_check", timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = {r["block"]: r for r in map(json.loads, proc.stdout.strip().splitlines())}
    assert set(results) == {"mlp", "attention"}
    for name, r in results.items():
        assert r["sharded"], f"{name}: TP did not shard every weight"
        assert r["out_l2"] < 1e-6, f"{name}: forward differs by {r['out_l2']}"
        assert len(r["grad_l2"]) == (3 if name == "mlp" else 4)
        for weight, diff in r["grad_l2"].items():
            assert diff < 1e-6, f"{name}.{weight}: gradient differs by {diff}"
