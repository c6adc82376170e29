"""A model directory's weights are checked against the whole architecture before any step
(worker/hf/weights.py `verify`): a missing tensor, a wrong shape, an integer tensor, a
tensor the architecture has no place for, a shard the index names but the directory lacks;
each error names the tensor or file. And what the sliced read rests on: q's and k's rows
come from rows of their own head (`source_rows`), a box is that slice of the tensor, and one
process reads every tensor whole into meshkeeper's layout (tests/models/test_hf_slices.py
reads shards on four ranks)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from services.model_spec import ModelSpec
from worker.hf.llama import from_hf, hf_name
from worker.hf.weights import (
    INDEX,
    SafetensorsDir,
    WeightsError,
    expected,
    load_into,
    source_rows,
    verify,
)
from worker.trainer.model import build_model

CFG = ModelSpec(layers=2, d_model=64, heads=4, kv_heads=2, vocab=256, seq_len=32, ffn_hidden=96)


def full() -> dict[str, torch.Tensor]:
    return {key: torch.zeros(shape) for key, (_, shape) in expected(CFG).items()}


def problem(tmp_path, tensors: dict) -> str:
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError) as e:
        verify(SafetensorsDir(tmp_path), CFG)
    return str(e.value)


def test_a_complete_directory_passes(tmp_path):
    save_file(full(), tmp_path / "model.safetensors")
    verify(SafetensorsDir(tmp_path), CFG)


def test_a_missing_tensor_is_named(tmp_path):
    tensors = full()
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    assert "model.layers.1.self_attn.k_proj.weight is missing" in problem(tmp_path, tensors)


def test_a_wrong_shape_names_both_shapes(tmp_path):
    tensors = full()
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)  # no GQA
    got = problem(tmp_path, tensors)
    assert "k_proj.weight has shape [64, 64], the config implies [32, 64]" in got, got


def test_integer_weights_and_leftovers_are_named(tmp_path):
    tensors = full()
    tensors["model.norm.weight"] = torch.zeros(64, dtype=torch.int32)
    tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(96, 64)  # a third layer
    got = problem(tmp_path, tensors)
    assert "model.norm.weight is I32" in got, got
    assert "model.layers.2.mlp.up_proj.weight is not part of this architecture" in got, got


def test_a_shard_the_index_names_but_the_directory_lacks_is_named(tmp_path):
    weight_map = {key: "model-00002-of-00002.safetensors" for key in full()}
    (tmp_path / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(WeightsError, match="model-00002-of-00002.safetensors: missing"):
        verify(SafetensorsDir(tmp_path), CFG)


def test_a_directory_without_safetensors_says_how_to_save_one(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(WeightsError, match="save the model with safetensors"):
        SafetensorsDir(tmp_path)


def test_q_and_k_rows_come_from_their_own_head_and_other_rows_stay():
    head = CFG.head_size
    for name in ("layers.0.attn.q.weight", "layers.1.attn.k.weight"):
        shape = expected(CFG)[hf_name(name)][1]
        rows = source_rows(name, shape, CFG)
        assert rows is not None and not torch.equal(rows, torch.arange(shape[0]))
        for h in range(shape[0] // head):  # a head's rows are a permutation of its own
            got = sorted(rows[h * head : (h + 1) * head].tolist())
            assert got == list(range(h * head, (h + 1) * head)), (name, h)
    shape = expected(CFG)["model.layers.0.mlp.up_proj.weight"][1]
    assert torch.equal(source_rows("layers.0.mlp.up.weight", shape, CFG), torch.arange(96))


def test_a_box_is_that_slice_of_the_tensor(tmp_path):
    t = torch.arange(96 * 64, dtype=torch.float32).view(96, 64)
    save_file({"model.layers.0.mlp.up_proj.weight": t}, tmp_path / "model.safetensors")
    weights = SafetensorsDir(tmp_path)
    with weights.box("model.layers.0.mlp.up_proj.weight", (slice(10, 40), slice(3, 35))) as b:
        assert torch.equal(b, t[10:40, 3:35])


def test_one_process_reads_each_tensor_whole_into_meshkeepers_layout(tmp_path):
    torch.manual_seed(0)
    tensors = {key: torch.randn(shape) for key, (_, shape) in expected(CFG).items()}
    save_file(tensors, tmp_path / "model.safetensors")
    model = build_model(CFG, 0, "cpu")
    imported = load_into([model], CFG, tmp_path)
    assert imported.read == imported.whole == {k: t.numel() * 4 for k, t in tensors.items()}
    for name, p in model.named_parameters():
        assert torch.equal(p, from_hf(name, tensors[hf_name(name)], CFG)), name
