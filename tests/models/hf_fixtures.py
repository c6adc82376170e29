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
    # experts: two per EP rank, each expert's hidden width split over TP, over a pipeline
    "dp2-ep2-pp2-tp2": {"dp": 2, "ep": 2, "pp": 2, "tp": 2, "microbatches": 2},
    # FSDP (zero 3) over the two replicas of each expert shard: one expert per rank
    "dp4-ep2": {"dp": 4, "ep": 2},
}


def layouts(arch: str) -> tuple[str, ...]:
    """The layouts `arch` is checked at besides one process."""
    if arch in MOE:
        return ("dp2-ep2-pp2-tp2", "dp4-ep2")
    return ("dp2-pp2-tp2",)


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


def hf_job(name: str, directory: Path, parallel: dict, global_batch: int = 8) -> dict:
    """A one-step job that imports `directory`, at `parallel`."""
    return {
        "name": name,
        "model": {"hf": str(directory), "seq_len": SEQ},
        "data": {"source": "synthetic", "seed": 7},
        "parallel": parallel,
        "train": {"steps": 1, "global_batch": global_batch, "lr": 1e-3, "warmup_steps": 1},
    }


def each_import(name: str, directories: dict[str, str], layouts: dict[str, tuple[str, dict]]):
    """Rank side of a shard test (a `tests.launch.rank_scenarios` child): for each scenario of
    `layouts` (name -> (checkpoint, parallel)), this rank's trainer with that checkpoint
    imported. Yields (scenario, rank, spec, the full tensors by key, the parameters as
    (unwrapped name, parameter, its local tensor), what `load_into` read)."""
    from safetensors.torch import load_file
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
    from torch.distributed.tensor import DTensor

    from services.hf_config import with_hf_architecture
    from services.spec import parse_spec
    from worker.hf.weights import load_into
    from worker.trainer.distributed import init_distributed, shutdown_distributed
    from worker.trainer.parallel import ParallelDims, RankContext
    from worker.trainer.step import Trainer

    torch.set_num_threads(1)
    rank, _, device = init_distributed(timeout_s=60)
    try:
        for scenario, (checkpoint, parallel) in layouts.items():
            directory = directories[checkpoint]
            spec = parse_spec(with_hf_architecture(hf_job(name, Path(directory), parallel)))
            full = {}
            for f in sorted(Path(directory).glob("*.safetensors")):
                full.update(load_file(str(f)))
            dims = ParallelDims(spec.parallel, device.type)
            trainer = Trainer(
                spec, RankContext(dims, dims.build_mesh(), rank, device), weights=False
            )
            imported = load_into(trainer.parts, spec.model, directory)
            params = [
                (
                    n.replace(_CHECKPOINT_PREFIX, ""),
                    p,
                    p.to_local() if isinstance(p, DTensor) else p,
                )
                for part in trainer.parts
                for n, p in part.named_parameters()
            ]
            yield scenario, rank, spec, full, params, imported
    finally:
        shutdown_distributed()
