"""Tiny random Hugging Face checkpoints, saved by `transformers` itself, one per supported
architecture (Mixtral twice: in the hub's per-expert form, which save_pretrained writes by
default, and in transformers 5's fused form), and the layouts each is trained at: the oracle
the import and export tests compare meshkeeper with."""

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
    # four experts, two per token; the router's weights at initializer_range too, so a wrong
    # expert order or router changes the loss in its third digit
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    # the same model (same config and seed) saved as transformers 5 holds it in memory
    "mixtral-fused": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
}
# save_pretrained(save_original_format=False): experts.gate_up_proj / down_proj, mlp.gate
FUSED = {"mixtral-fused"}
MOE = {"mixtral", "mixtral-fused"}

LAYOUTS = {
    "one": {"dp": 1},
    "dp2-pp2-tp2": {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2},
    "dp2": {"dp": 2},  # a tied head needs tp 1 and pp 1
    # experts: two per EP rank, each expert's hidden width split over TP, over a pipeline
    "dp2-ep2-pp2-tp2": {"dp": 2, "ep": 2, "pp": 2, "tp": 2, "microbatches": 2},
    # FSDP (zero 3) over the two replicas of each expert shard: one expert per rank
    "dp4-ep2": {"dp": 4, "ep": 2},
}


def layouts(arch: str) -> tuple[str, ...]:
    """The layouts `arch` is checked at besides one process."""
    if arch in MOE:
        return ("dp2-ep2-pp2-tp2", "dp4-ep2")
    return ("dp2",) if arch == "qwen2-tied" else ("dp2-pp2-tp2",)


def cases(*, parallel: bool = True) -> list[tuple[str, str]]:
    """(architecture, layout) pairs: one process each, and the parallel layouts."""
    return [
        (arch, layout)
        for arch in ARCHITECTURES
        for layout in ("one", *(layouts(arch) if parallel else ()))
    ]


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
    model.save_pretrained(directory, save_original_format=name not in FUSED)
    return directory


def hf_loss(directory: Path, x: torch.Tensor, y: torch.Tensor) -> float:
    """What `transformers` computes for the batch: the mean next-token cross-entropy."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    with torch.no_grad():
        logits = model(x).logits
    return F.cross_entropy(logits.flatten(0, 1), y.flatten()).item()
