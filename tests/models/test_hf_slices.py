"""Each rank reads only the slices of a Hugging Face checkpoint that its shards hold, straight
into them (worker/hf/weights.py), on four real gloo ranks:

- at tp2 x pp2 (Llama 3), a rank reads only its pipeline stage's tensors, exactly half of
  each tensor TP splits (q and k rows too: whole heads) and all of each one it replicates
  (the norms), where the whole-tensor read took all of every one (`load_into`'s byte count);
- at dp2 x tp2 under zero 3 (FSDP's _StridedShard over TP's Shard: a Qwen3 with odd sizes,
  vocab 250 and MLP 90, so FSDP's halves of TP's halves are uneven, and half of one k head or
  one q/k norm per rank) and at dp4 under zero 3 (uneven Shard(0): 250 rows as 63, 63, 63,
  61), every rank's shard of every parameter equals, bit for bit, that slice of the full
  tensor (`local_shard` of the converted checkpoint tensor: what the whole-tensor read
  kept), and each rank reads at most its shard plus the rest of the two heads a q/k shard
  starts and ends in;
- at those odd sizes (dp2 x tp2) and at dp4 (Qwen3: FSDP's quarters of k are half heads),
  the trainer's step-1 loss equals `transformers`' within rtol 1e-5, as at the layouts
  tests/models/test_hf_import.py covers.

The rank side is this module's `__main__`: four ranks under tests/rankrun.py print one JSON
line each per layout.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from services.hf_config import with_hf_architecture
from services.spec import parse_spec
from tests.launch import rank_scenarios, train
from tests.models.hf_fixtures import COMMON, each_import, hf_job, hf_loss, save_checkpoint
from worker.trainer.data import Batches

pytestmark = pytest.mark.slow

GLOBAL_BATCH = 8
# a Qwen3 whose sizes FSDP splits unevenly: vocab 250 (tp2: 125 rows, FSDP over that: 63
# and 62), MLP 90 (45, then 23 and 22); head_dim 32, so half of a k head per rank at dp2 x tp2
ODD = dict(COMMON, vocab_size=250, intermediate_size=90, head_dim=32, tie_word_embeddings=False)
LAYOUTS = {  # name: (checkpoint, parallel)
    "tp2-pp2": ("llama3", {"dp": 1, "pp": 2, "tp": 2, "microbatches": 2}),
    "dp2-tp2-zero3": ("odd", {"dp": 2, "tp": 2, "zero": 3}),
    "dp4-zero3": ("odd", {"dp": 4, "zero": 3}),
}


def save_odd(directory: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.Qwen3Config(**ODD), dtype=torch.float32
    )
    with torch.no_grad():  # norm gains apart from 1, so their rows are told apart
        for key, p in model.named_parameters():
            if key.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-slices")
    return {
        "llama3": save_checkpoint("llama3", root / "llama3"),
        "qwen3": save_checkpoint("qwen3", root / "qwen3"),
        "odd": save_odd(root / "odd"),
    }


def job(directory: Path, parallel: dict) -> dict:
    return hf_job("hf-slices", directory, parallel, GLOBAL_BATCH)


@pytest.fixture(scope="module")
def results(checkpoints) -> dict[str, list[dict]]:
    args = [json.dumps({k: str(v) for k, v in checkpoints.items()})]
    return rank_scenarios(4, "tests.models.test_hf_slices", list(LAYOUTS), args, timeout=300)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_shard_equals_its_slice_of_the_full_tensor(results, layout):
    rows = results[layout]
    assert len(rows) == 4
    for r in rows:
        assert r["sharded"], r  # the layout did shard something on this rank
        assert r["differing"] == [], r


def test_a_tp2_rank_reads_half_of_each_tensor_tp_splits_and_only_its_stage(results):
    rows = results["tp2-pp2"]
    stages = [set(r["read"]) for r in rows]
    assert stages[0] == stages[1] and stages[2] == stages[3]  # the TP pair of each stage
    assert stages[0].isdisjoint(stages[2])  # nothing of the other stage is read
    assert "model.embed_tokens.weight" in stages[0] and "lm_head.weight" in stages[2]
    for r in rows:
        assert len(r["tp_split"]) >= 8, r  # q, k, v, o, gate, up, down of a layer at least
        for key, read in r["read"].items():
            whole = r["whole"][key]
            assert read == (whole // 2 if key in r["tp_split"] else whole), (r["rank"], key)
        half = sum(r["whole"][k] // 2 for k in r["tp_split"])
        replicated = sum(r["whole"][k] for k in r["read"] if k not in r["tp_split"])
        assert sum(r["read"].values()) == half + replicated
        assert replicated < 0.02 * half  # the norms: next to nothing


@pytest.mark.parametrize("layout", ["dp2-tp2-zero3", "dp4-zero3"])
def test_a_rank_reads_its_shard_and_at_most_the_heads_around_it(results, layout):
    rows = results[layout]
    head_row = ODD["head_dim"] * ODD["hidden_size"] * 4  # one head's rows of q or k, fp32
    for r in rows:
        for key, read in r["read"].items():
            local = r["local"][key]
            if "q_proj" in key or "k_proj" in key or "_norm" in key:
                assert local <= read <= local + 2 * head_row, (r["rank"], key, read, local)
            else:
                assert read == local, (r["rank"], key, read, local)
        assert sum(r["read"].values()) < 0.3 * sum(r["whole"].values())  # about a quarter
    # the shards really are uneven (vocab 250 over 4 ranks, or halves of 125)
    embed = [r["local"]["model.embed_tokens.weight"] for r in rows]
    assert len(set(embed)) > 1, embed
    # and some q/k shard did start inside a head, so the heads around it were read
    assert any(r["read"][k] > r["local"][k] for r in rows for k in r["read"] if "k_proj" in k)


@pytest.mark.parametrize(
    "arch, parallel", [("odd", {"dp": 2, "tp": 2}), ("qwen3", {"dp": 4})], ids=["odd", "qwen3"]
)
def test_step_one_loss_equals_transformers(checkpoints, tmp_path, arch, parallel):
    spec = job(checkpoints[arch], parallel)
    (first,) = train(spec, tmp_path, timeout=300)
    s = parse_spec(with_hf_architecture(spec))
    x, y = Batches(s.data, s.model, GLOBAL_BATCH, 1).local(0, 0)
    assert first["loss"] == pytest.approx(hf_loss(checkpoints[arch], x, y), rel=1e-5)


# -- the rank side -----------------------------------------------------------------------
def _main(directories: dict[str, str]) -> None:
    from torch.distributed.tensor import DTensor

    from worker.hf import llama
    from worker.trainer.shards import local_shard

    for name, rank, spec, full, params, imported in each_import("hf-slices", directories, LAYOUTS):
        differing, sharded, local_bytes, tp_split = [], False, {}, []
        for pname, p, local in params:
            key = llama.hf_name(pname)
            sharded = sharded or local.shape != p.shape
            local_bytes[key] = local.numel() * full[key].element_size()
            whole = llama.from_hf(pname, full[key].float(), spec.model)
            if not torch.equal(local.detach(), local_shard(whole, p)):
                differing.append(pname)
            if isinstance(p, DTensor) and "tp" in (p.device_mesh.mesh_dim_names or ()):
                tp = p.device_mesh.mesh_dim_names.index("tp")
                if p.placements[tp].is_shard():
                    tp_split.append(key)
        line = {
            "scenario": name,
            "rank": rank,
            "differing": differing,
            "sharded": sharded,
            "read": imported.read,
            "whole": imported.whole,
            "local": local_bytes,
            "tp_split": tp_split,
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    _main(json.loads(sys.argv[1]))
