"""The state-dict adapter of the Llama family (Llama 2/3/3.1, Mistral, Qwen2, Qwen3): the
names `transformers` gives meshkeeper's parameters, and the one change of layout between
them.

That change is RoPE's. `transformers` rotates each head's dimension i with dimension
i + head_dim/2 (the half-split rotation); meshkeeper rotates interleaved pairs (2i, 2i+1)
(worker/trainer/model.py, `apply_rope`). The rows of q and k (their weights, their biases,
and Qwen3's per-head norm gains) are permuted within each head on the way in, and back on
the way out. Attention scores are dot products of q and k over a head's dimensions, which a
permutation applied to both leaves unchanged, so the imported model computes what the
checkpoint computes, and every existing layout, checkpoint and test keeps its numbers:
adopting the half-split rotation instead would have changed every trained number here.
"""

from __future__ import annotations

import re

import torch

from services.model_spec import ModelSpec

_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "attn.q.weight": "self_attn.q_proj.weight",
    "attn.k.weight": "self_attn.k_proj.weight",
    "attn.v.weight": "self_attn.v_proj.weight",
    "attn.o.weight": "self_attn.o_proj.weight",
    "attn.q.bias": "self_attn.q_proj.bias",
    "attn.k.bias": "self_attn.k_proj.bias",
    "attn.v.bias": "self_attn.v_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp.gate.weight": "mlp.gate_proj.weight",
    "mlp.up.weight": "mlp.up_proj.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}
_ENDS = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
_HEAD = {"head.weight": "lm_head.weight"}
# rows laid out per head in the rotation's order
_ROTATED = ("attn.q.weight", "attn.q.bias", "attn.k.weight", "attn.k.bias")
_ROTATED_GAINS = ("attn.q_norm.weight", "attn.k_norm.weight")
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# buffers some checkpoints carry that are derived, never trained
IGNORED_HF = re.compile(r"rotary_emb\.inv_freq$")


def hf_name(name: str) -> str:
    """The `transformers` key of a meshkeeper parameter name (the unwrapped model's)."""
    if name in _ENDS:
        return _ENDS[name]
    if name in _HEAD:
        return _HEAD[name]
    m = _LAYER.match(name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"
    raise KeyError(f"{name}: no Hugging Face name (not a Llama-family parameter)")


def meshkeeper_name(key: str) -> str:
    """The meshkeeper parameter name of a `transformers` key."""
    for ours, theirs in (*_ENDS.items(), *_HEAD.items()):
        if key == theirs:
            return ours
    m = _HF_LAYER.match(key)
    if m:
        for ours, theirs in _BLOCK.items():
            if m.group(2) == theirs:
                return f"layers.{m.group(1)}.{ours}"
    raise KeyError(f"{key}: not a Llama-family weight meshkeeper has")


def _kind(name: str) -> str:
    m = _LAYER.match(name)
    return m.group(2) if m else name


def from_hf(name: str, tensor: torch.Tensor, cfg: ModelSpec) -> torch.Tensor:
    """A checkpoint tensor in meshkeeper's layout (`name`: meshkeeper's)."""
    if _kind(name) in _ROTATED + _ROTATED_GAINS:
        return _per_head(tensor, cfg.head_size, (2, cfg.head_size // 2))
    return tensor


def to_hf(name: str, tensor: torch.Tensor, cfg: ModelSpec) -> torch.Tensor:
    """A meshkeeper tensor in the checkpoint's layout (the inverse of `from_hf`)."""
    if _kind(name) in _ROTATED + _ROTATED_GAINS:
        return _per_head(tensor, cfg.head_size, (cfg.head_size // 2, 2))
    return tensor


def _per_head(rows: torch.Tensor, head_dim: int, split: tuple[int, int]) -> torch.Tensor:
    """Within each head's `head_dim` rows, read the rows as a `split` grid and transpose it:
    (2, d/2) takes half-split order to interleaved pairs, (d/2, 2) takes it back."""
    shape = rows.shape
    grid = rows.reshape(-1, *split, *shape[1:])
    return grid.transpose(1, 2).reshape(shape).contiguous()


def architecture_name(cfg: ModelSpec) -> str:
    """The `architectures` entry of an export's config.json, from the fields that tell the
    families apart (a checkpoint imported from a Mistral directory keeps that directory's).
    A mixture of experts is Mixtral's (worker/hf/mixtral.py maps its router and experts)."""
    if cfg.experts:
        return "MixtralForCausalLM"
    if cfg.qk_norm:
        return "Qwen3ForCausalLM"
    if cfg.qkv_bias:
        return "Qwen2ForCausalLM"
    return "LlamaForCausalLM"
