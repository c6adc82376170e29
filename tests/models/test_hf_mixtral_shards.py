"""Each rank reads only the experts it holds from a Mixtral checkpoint, straight into its
shards (worker/hf/mixtral.py), on four real gloo ranks, 4 experts per layer:

- at dp4 x ep2 under zero 3 (FSDP over the two replicas of each expert shard), a rank holds
  one expert of each layer and reads that expert's w1, w2 and w3 whole and no other expert's;
  the four ranks hold the four experts; the router, data parallel like the attention, is read
  as its FSDP quarter;
- at dp2 x ep2 x tp2, a rank holds two experts, and reads exactly half of each of their
  tensors (its slice of the expert's hidden width), in the hub's per-expert form, and a
  quarter of each fused tensor (its experts' box of its hidden slice) in transformers 5's;
  the router as its FSDP half;
- everywhere, every rank's shard of every parameter equals, bit for bit, that slice of the
  full tensor, the expert stack built here from the checkpoint's own tensors (expert e's w1
  and w3 transposed into row e of w_gate and w_up, w2 into w_down; gate_up_proj's first half
  gate, second half up): what the whole-tensor read would keep.

The trainer's loss at these layouts is tests/models/test_hf_import.py's. The rank side is
this module's `__main__`: four ranks under tests/rankrun.py print one JSON line each per
layout.
"""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch

from tests.launch import rank_scenarios
from tests.models.hf_fixtures import each_import, save_checkpoint

pytestmark = pytest.mark.slow

EXPERTS = 4
LAYOUTS = {  # name: (checkpoint, parallel)
    "dp4-ep2": ("mixtral", {"dp": 4, "ep": 2, "zero": 3}),
    "dp2-ep2-tp2": ("mixtral", {"dp": 2, "ep": 2, "tp": 2}),
    "dp2-ep2-tp2-fused": ("mixtral-fused", {"dp": 2, "ep": 2, "tp": 2}),
}
_EXPERT_KEY = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("hf-mixtral")
    directories = {
        name: str(save_checkpoint(name, root / name)) for name in ("mixtral", "mixtral-fused")
    }
    return rank_scenarios(
        4, "tests.models.test_hf_mixtral_shards", list(LAYOUTS), [json.dumps(directories)], 300
    )


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_shard_equals_its_slice_of_the_full_tensor(results, layout):
    rows = results[layout]
    assert len(rows) == 4
    for r in rows:
        assert r["experts_sharded"], r  # the experts are split on this rank
        assert r["differing"] == [], r


def experts_read(r: dict) -> dict[tuple[str, str], set[int]]:
    """(layer, w1/w2/w3) -> the experts whose tensor this rank read (the hub's form)."""
    out: dict[tuple[str, str], set[int]] = {}
    for key in r["read"]:
        m = _EXPERT_KEY.match(key)
        if m:
            out.setdefault((m.group(1), m.group(3)), set()).add(int(m.group(2)))
    return out


def moe_keys(r: dict) -> list[str]:
    """The router and expert tensors this rank read (the rest is worker/hf/weights.py's)."""
    keys = [k for k in r["read"] if ".block_sparse_moe." in k]
    assert len(keys) == 2 * (1 + 3 * len(r["held"])), keys  # per layer: router, w1-w3 each
    return keys


def test_at_dp4_ep2_a_rank_reads_the_one_expert_it_holds_whole(results):
    rows = results["dp4-ep2"]
    held = []
    for r in rows:
        read = experts_read(r)
        assert len(read) == 2 * 3, r["read"]  # two layers, w1 w2 w3
        (mine,) = {frozenset(e) for e in read.values()}  # the same expert in every tensor
        assert len(mine) == 1 and sorted(mine) == r["held"], (r["rank"], read, r["held"])
        held += r["held"]
        for key in moe_keys(r):  # no TP: each expert read whole; the router's FSDP slice
            want = r["whole"][key] // (4 if key.endswith(".gate.weight") else 1)
            assert r["read"][key] == want, (r["rank"], key)
    assert sorted(held) == list(range(EXPERTS))


def test_at_dp2_ep2_tp2_a_rank_reads_its_slice_of_its_two_experts(results):
    rows = results["dp2-ep2-tp2"]
    for r in rows:
        read = experts_read(r)
        assert len(read) == 2 * 3, r["read"]
        assert all(sorted(e) == r["held"] for e in read.values()), (r["rank"], read, r["held"])
        assert len(r["held"]) == EXPERTS // 2
        for key in moe_keys(r):  # a TP half of each expert; the router's FSDP half (dp2)
            assert r["read"][key] == r["whole"][key] // 2, (r["rank"], key)
    # the two EP ranks of a TP pair hold the other two experts
    assert sorted(rows[0]["held"] + rows[2]["held"]) == list(range(EXPERTS))


def test_a_fused_checkpoint_is_read_as_its_experts_box(results):
    for r in results["dp2-ep2-tp2-fused"]:
        assert r["held"] in ([0, 1], [2, 3])
        fused = [k for k in r["read"] if "mlp.experts." in k]
        assert len(fused) == 2 * 2, r["read"]  # gate_up_proj and down_proj of two layers
        for key in fused:  # half the experts, half of each one's hidden width
            assert r["read"][key] == r["whole"][key] // 4, (r["rank"], key)


# -- the rank side -----------------------------------------------------------------------
def stacked(name: str, full: dict[str, torch.Tensor], hidden: int) -> torch.Tensor:
    """meshkeeper's full `name` (a router or a stack of experts) from the checkpoint's
    tensors, built independently of worker/hf/mixtral.py."""
    layer, kind = re.match(r"layers\.(\d+)\.mlp\.(.+)$", name).groups()
    prefix = f"model.layers.{layer}"
    if f"{prefix}.mlp.gate.weight" in full:  # transformers 5's fused form
        if kind == "router.gate.weight":
            return full[f"{prefix}.mlp.gate.weight"]
        if kind == "experts.w_down":
            return full[f"{prefix}.mlp.experts.down_proj"].transpose(1, 2)
        gate_up = full[f"{prefix}.mlp.experts.gate_up_proj"]
        half = gate_up[:, :hidden] if kind == "experts.w_gate" else gate_up[:, hidden:]
        return half.transpose(1, 2)
    moe = f"{prefix}.block_sparse_moe"
    if kind == "router.gate.weight":
        return full[f"{moe}.gate.weight"]
    w = {"experts.w_gate": "w1", "experts.w_up": "w3", "experts.w_down": "w2"}[kind]
    return torch.stack([full[f"{moe}.experts.{e}.{w}.weight"].T for e in range(EXPERTS)])


def _main(directories: dict[str, str]) -> None:
    from worker.hf import llama, mixtral
    from worker.trainer.init_rng import _held
    from worker.trainer.shards import local_shard

    shards = each_import("hf-mixtral-shards", directories, LAYOUTS)
    for name, rank, spec, full, params, imported in shards:
        differing, held, experts_sharded = [], None, False
        for pname, p, local in params:
            if mixtral.owns(pname):
                whole = stacked(pname, full, spec.model.ffn)
                if pname.endswith("experts.w_gate"):
                    held = _held(p, 0).tolist()
                    experts_sharded = experts_sharded or local.shape != p.shape
            else:
                whole = llama.from_hf(pname, full[llama.hf_name(pname)].float(), spec.model)
            if not torch.equal(local.detach(), local_shard(whole, p)):
                differing.append(pname)
        line = {
            "scenario": name,
            "rank": rank,
            "differing": differing,
            "experts_sharded": experts_sharded,
            "held": held,
            "read": imported.read,
            "whole": imported.whole,
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
