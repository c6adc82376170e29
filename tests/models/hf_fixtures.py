"""Tiny random Hugging Face checkpoints, saved by `transformers` itself, one per supported
architecture: the oracle the import and export tests compare meshkeeper with."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

VOCAB, SEQ = 256, 32
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention: two query heads per KV head
    max_position_embeddings=64,
    # far from transformers' 0.02: at that scale every logit is near 0, the loss is ln(vocab)
    # to 5 digits whatever the attention does, and a wrong RoPE layout would still pass
    initializer_range=0.3,
)
# name -> (config class name, its extra fields)
ARCHITECTURES = {
    "llama3": (
        "LlamaConfig",
        dict(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "mistral": ("MistralConfig", dict(sliding_window=None)),
    "qwen2-tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", dict(head_dim=32)),  # head_dim apart from hidden/heads (16)
}


def save_checkpoint(name: str, directory: Path) -> Path:
    """A randomly initialised model of architecture `name`, saved with save_pretrained."""
    import transformers

    config_class, extra = ARCHITECTURES[name]
    config = getattr(transformers, config_class)(**COMMON, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # the norms start at 1; random gains test their mapping too
        for key, p in model.named_parameters():
            if key.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif key.endswith("bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(directory)
    return directory


def hf_loss(directory: Path, x: torch.Tensor, y: torch.Tensor) -> float:
    """What `transformers` computes for the batch: the mean next-token cross-entropy."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        logits = model(x).logits
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
