"""A model directory's weights are checked against the whole architecture before any step
(worker/hf/weights.py `verify`): a missing tensor, a wrong shape, an integer tensor, a
tensor the architecture has no place for, a shard the index names but the directory lacks;
each error names the tensor or file."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from services.model_spec import ModelSpec
from worker.hf.weights import INDEX, SafetensorsDir, WeightsError, expected, verify

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
