"""A Hugging Face config.json read as the spec's model section (services/hf_config.py): both
rope forms, and every refusal naming the file or field and the fix, never a traceback."""

from __future__ import annotations

import json

import pytest

from services.spec import SpecError, load_spec, parse_spec

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
SCALING = {
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def spec_file(tmp_path, config: dict | str, **model) -> str:
    model_dir = tmp_path / "model"
    model_dir.mkdir(exist_ok=True)
    text = config if isinstance(config, str) else json.dumps(config)
    (model_dir / "config.json").write_text(text)
    spec = {
        "name": "hf",
        "model": {"hf": str(model_dir), "seq_len": 32, **model},
        "train": {"steps": 2, "global_batch": 2},
    }
    path = tmp_path / "job.json"
    path.write_text(json.dumps(spec))
    return str(path)


def problems(path: str) -> dict[str, str]:
    with pytest.raises(SpecError) as e:
        load_spec(path)
    return {p.field: p.message for p in e.value.problems}


def test_hub_form_with_rope_scaling_fills_the_architecture(tmp_path):
    config = {**LLAMA, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **SCALING}}
    m = load_spec(spec_file(tmp_path, config)).model
    assert (m.layers, m.d_model, m.heads, m.kv_heads, m.head_dim, m.ffn_hidden) == (
        2,
        64,
        4,
        2,
        16,
        96,
    )
    assert (m.vocab, m.norm_eps, m.rope_theta, m.tie_embeddings) == (256, 1e-6, 500000.0, False)
    assert m.rope_scaling.factor == 8.0 and m.rope_scaling.original_max_position_embeddings == 16


def test_transformers_5_rope_parameters_read_the_same(tmp_path):
    hub = {**LLAMA, "rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", **SCALING}}
    v5 = {**LLAMA, "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **SCALING}}
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert load_spec(spec_file(tmp_path / "a", hub)).model.model_dump(exclude={"hf"}) == (
        load_spec(spec_file(tmp_path / "b", v5)).model.model_dump(exclude={"hf"})
    )


def test_qwen2_has_qkv_biases_and_qwen3_per_head_norms(tmp_path):
    (tmp_path / "q2").mkdir()
    (tmp_path / "q3").mkdir()
    q2 = load_spec(spec_file(tmp_path / "q2", {**LLAMA, "architectures": ["Qwen2ForCausalLM"]}))
    q3 = {**LLAMA, "architectures": ["Qwen3ForCausalLM"], "head_dim": 32}
    q3 = load_spec(spec_file(tmp_path / "q3", q3))
    assert (q2.model.qkv_bias, q2.model.qk_norm) == (True, False)
    assert (q3.model.qkv_bias, q3.model.qk_norm, q3.model.head_dim) == (False, True, 32)


@pytest.mark.parametrize(
    "change, field, words",
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            "model.hf",
            "'GPT2LMHeadModel' is not supported; meshkeeper trains LlamaForCausalLM",
        ),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "model.hf", "'yarn'"),
        ({"attention_bias": True}, "model.hf", "o_proj"),
        ({"hidden_act": "gelu"}, "model.hf", "'gelu'"),
        (
            {"architectures": ["MistralForCausalLM"], "sliding_window": 16},
            "model.hf",
            "set model.seq_len to at most 16",
        ),
        ({"num_hidden_layers": None}, "model.hf", "num_hidden_layers is missing"),
    ],
)
def test_what_the_model_cannot_be_is_refused_by_name(tmp_path, change, field, words):
    config = {k: v for k, v in {**LLAMA, **change}.items() if v is not None}
    got = problems(spec_file(tmp_path, config))
    assert words in got[field], got


def test_a_field_that_contradicts_the_config_names_both_values(tmp_path):
    got = problems(spec_file(tmp_path, LLAMA, layers=12))
    assert "config.json, which gives 2" in got["model.layers"], got
    assert "12" in got["model.layers"], got


def test_a_config_that_is_not_json_or_is_missing_names_the_file(tmp_path):
    got = problems(spec_file(tmp_path, "{not json"))
    assert "config.json is not JSON" in got["model.hf"], got
    (tmp_path / "model" / "config.json").unlink()
    got = problems(str(tmp_path / "job.json"))
    assert "cannot read" in got["model.hf"] and "config.json" in got["model.hf"], got


def test_a_spec_sent_without_the_architecture_is_told_to_carry_it():
    with pytest.raises(SpecError) as e:
        parse_spec({"name": "x", "model": {"hf": "/m", "seq_len": 8}, "train": {"steps": 1}})
    assert "meshkeeper submit" in str(e.value), e.value
