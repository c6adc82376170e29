"""A Hugging Face model directory's `config.json`, read as the `model` section of a job spec
(docs/models.md, "Bring your model"). Torch-free: `meshkeeper submit` (through `load_spec`)
and the trainer both read it, and every problem is a `SpecError` naming the file or field.

Both forms found in the wild are read: `rope_theta` with `rope_scaling` (what checkpoints on
the hub carry) and transformers 5's `rope_parameters`. `seq_len` and the training fields stay
the spec's. A field the spec gives as well must agree with the config: an error names both.

Mixtral's mixture of experts maps onto meshkeeper's (worker/trainer/moe.py), whose router is
Mixtral's: softmax over the top_k logits (transformers' softmax over all of them, then
renormalised over the top_k, is the same number), dropless (capacity_factor 0), no shared
experts. What transformers would compute differently is refused by name: router jitter noise,
and its load-balancing loss (`output_router_logits`), unless the spec says which balance loss
to train with (`model.aux_loss_coef`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from services.spec_types import Problem, SpecError

# the architectures whose weights map onto meshkeeper's model (worker/hf/llama.py; Mixtral's
# router and experts: worker/hf/mixtral.py)
MIXTRAL = "MixtralForCausalLM"
SUPPORTED = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    MIXTRAL,
)
# those whose attention has Mistral's sliding window unless use_sliding_window says otherwise
SLIDING = ("MistralForCausalLM", MIXTRAL)
CONFIG = "config.json"


def read_config(directory: str | Path) -> dict[str, Any]:
    """`directory`/config.json as a dict; SpecError (field model.hf) when it cannot be."""
    path = Path(directory) / CONFIG
    try:
        config = json.loads(path.read_text())
    except OSError as e:
        raise _refused(
            f"cannot read {path}: {e.strerror}; point model.hf at a model directory"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _refused(
            f"{path} is not JSON ({e}); it should be the model's own config.json"
        ) from None
    if not isinstance(config, dict):
        raise _refused(f"{path} holds no JSON object; it should be the model's own config.json")
    return config


def architecture(config: dict[str, Any], seq_len: int, where: str) -> dict[str, Any]:
    """The spec's model fields that `config` fixes; `where` names the file in errors."""
    arch = (config.get("architectures") or [None])[0]
    if arch not in SUPPORTED:
        raise _refused(
            f"{where}: architecture {arch!r} is not supported; meshkeeper trains "
            f"{', '.join(SUPPORTED)}"
        )
    problems = []

    def refuse(key: str, why: str) -> None:
        problems.append(Problem("model.hf", f"{where}: {key} {why}"))

    if config.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", f"{config['hidden_act']!r}: only SwiGLU with silu is implemented")
    qkv_bias = arch == "Qwen2ForCausalLM"  # Qwen2's q, k and v always have biases
    if config.get("attention_bias"):
        refuse("attention_bias", "true also puts a bias on o_proj, which is not implemented")
    if config.get("mlp_bias"):
        refuse("mlp_bias", "true is not implemented (the MLP has no biases)")
    if config.get("attention_dropout"):
        refuse(
            "attention_dropout",
            f"{config['attention_dropout']}: dropout is not implemented; set it to 0",
        )
    window = config.get("sliding_window")
    sliding = config.get("use_sliding_window", arch in SLIDING)
    if sliding and window is not None and window < seq_len:
        refuse(
            "sliding_window",
            f"{window} is shorter than model.seq_len ({seq_len}), and sliding-window attention "
            f"is not implemented; set model.seq_len to at most {window}",
        )
    rope = _rope(config, refuse)
    if arch == MIXTRAL and config.get("router_jitter_noise"):
        refuse(
            "router_jitter_noise",
            f"{config['router_jitter_noise']}: transformers multiplies each MoE layer's input "
            "by uniform noise while training, which meshkeeper does not implement; set it to 0",
        )
    if problems:
        raise SpecError(problems)
    try:
        heads = config["num_attention_heads"]
        fields = {
            "layers": config["num_hidden_layers"],
            "d_model": config["hidden_size"],
            "heads": heads,
            "kv_heads": config.get("num_key_value_heads") or heads,
            "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
            "ffn_hidden": config["intermediate_size"],
            "vocab": config["vocab_size"],
            "norm_eps": float(config.get("rms_norm_eps", 1e-6)),
            "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
            "qkv_bias": qkv_bias,
            "qk_norm": arch == "Qwen3ForCausalLM",
            **rope,
        }
        if arch == MIXTRAL:
            fields.update(
                experts=config["num_local_experts"],
                top_k=config.get("num_experts_per_tok", 2),  # MixtralConfig's default
                capacity_factor=0.0,  # dropless: transformers computes every choice
            )
    except KeyError as e:
        raise _refused(f"{where}: {e.args[0]} is missing; is this a {arch} config?") from None
    return fields


def _rope(config: dict[str, Any], refuse) -> dict[str, Any]:
    """rope_theta and rope_scaling from either form."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    out: dict[str, Any] = {"rope_theta": float(theta), "rope_scaling": None}
    if kind == "llama3":
        given = {**scaling, **params}
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in given]
        if missing:
            refuse("rope_scaling", f"of type llama3 lacks {', '.join(missing)}")
            return out
        out["rope_scaling"] = {"type": "llama3", **{k: given[k] for k in keys}}
    elif kind != "default":
        refuse("rope_type", f"{kind!r} is not implemented; meshkeeper has default and llama3")
    return out


def with_hf_architecture(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec (its plain dict form) with `model.hf`'s architecture filled in; unchanged
    without `model.hf`. A field the spec sets to another value than the config's is an error
    naming both."""
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("hf"), str):
        return spec
    if not isinstance(model.get("seq_len"), int):
        raise SpecError(
            [Problem("model.seq_len", "required with model.hf: the context length to train at")]
        )
    where = str(Path(model["hf"]) / CONFIG)
    config = read_config(model["hf"])
    fields = architecture(config, model["seq_len"], where)
    conflicts = [
        Problem(
            f"model.{k}",
            f"{model[k]!r} contradicts {where}, which gives {v!r}; remove model.{k} (the "
            "config decides it) or point model.hf at the model you mean",
        )
        for k, v in fields.items()
        if k in model and model[k] != v
    ]
    if model.get("preset") is not None:
        conflicts.append(Problem("model.preset", "a preset and model.hf exclude each other"))
    if conflicts:
        raise SpecError(conflicts)
    return {**spec, "model": {**_objective(config, model, where), **model, **fields}}


def _objective(config: dict[str, Any], model: dict[str, Any], where: str) -> dict[str, Any]:
    """Training fields the config implies where the spec leaves them unset. A Mixtral's
    balance loss: transformers adds its own (over the whole batch and every layer at once,
    router_aux_loss_coef times it) only with output_router_logits, and meshkeeper's is another
    (Switch's per sequence and layer, model.aux_loss_coef): without it, aux_loss_coef is 0 as
    transformers trains; with it, the spec must choose."""
    if (config.get("architectures") or [None])[0] != MIXTRAL or "aux_loss_coef" in model:
        return {}
    if config.get("output_router_logits"):
        raise _refused(
            f"{where}: output_router_logits true adds transformers' load-balancing loss "
            f"(router_aux_loss_coef {config.get('router_aux_loss_coef', 0.001)} times one loss "
            "over the whole batch and every layer), which meshkeeper does not compute; give "
            "model.aux_loss_coef: 0 to train without a balance loss (transformers' training "
            "with output_router_logits false), or a coefficient for meshkeeper's own (Switch's "
            "per sequence and layer, docs/models.md)"
        )
    return {"aux_loss_coef": 0.0}


def _refused(message: str) -> SpecError:
    return SpecError([Problem("model.hf", message)])
