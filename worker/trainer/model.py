"""Decoder-only transformer: RMSNorm, RoPE attention, a SwiGLU MLP or a mixture of SwiGLU
experts (worker/trainer/moe.py).

Layers live in a ModuleDict keyed by their global index so parameter names survive
pipeline splitting. A stage built for pipelining keeps only its own layers and sets
`embed` / `norm` / `head` to None where another stage owns them.

Attention and MLP read their head count / widths from the weights they hold, so the
same module works before and after tensor-parallel sharding (which shrinks them).

Weights are built on the meta device and written only after the layout is applied
(docs/architecture.md, "Trainer"): `init_weights` gives each parameter values that are a
function of (seed, parameter name) alone, so every layout starts from the same model.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import _CHECKPOINT_PREFIX
from torch.distributed.tensor import DTensor

from services.spec import ModelSpec
from worker.trainer.init_rng import fill_normal
from worker.trainer.moe import MoE
from worker.trainer.vocab_embedding import VocabParallelEmbedding


def rope_frequencies(cfg: ModelSpec) -> torch.Tensor:
    """RoPE's angular frequency of each pair of a head's dimensions (float64), with Llama
    3.1's scaling where the spec asks for it."""
    d = cfg.head_size
    inv = 1.0 / cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    sc = cfg.rope_scaling
    if sc is None:
        return inv
    # Llama 3.1: wavelengths past the original context / low_freq_factor are slowed by
    # `factor`; those below original / high_freq_factor are kept; those between are blended,
    # linearly in original / wavelength.
    wavelength = 2 * math.pi / inv
    original = sc.original_max_position_embeddings
    blend = (original / wavelength - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor
    )
    blended = (1 - blend) * inv / sc.factor + blend * inv
    kept = torch.where(wavelength < original / sc.high_freq_factor, inv, blended)
    return torch.where(wavelength > original / sc.low_freq_factor, inv / sc.factor, kept)


def rope_tables(cfg: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float64), rope_frequencies(cfg))
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, T, H, D); rotate interleaved pairs (a Hugging Face checkpoint's half-split q and
    # k rows are permuted into this order on import: worker/hf/llama.py)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, : x.shape[1], None, :], sin[None, : x.shape[1], None, :]
    # the tables stay fp32 (rotation angles lose precision in bf16); the result takes x's dtype
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    """Grouped-query attention: `heads` query heads share `kv_heads` key/value heads, each
    KV head serving a consecutive run of heads/kv_heads query heads (so TP, which gives a
    rank consecutive runs of both, keeps every pairing on one rank)."""

    def __init__(self, cfg: ModelSpec):
        super().__init__()
        d, self.head_dim = cfg.d_model, cfg.head_size
        self.q = nn.Linear(d, cfg.q_width, bias=cfg.qkv_bias)
        self.k = nn.Linear(d, cfg.kv_width, bias=cfg.qkv_bias)
        self.v = nn.Linear(d, cfg.kv_width, bias=cfg.qkv_bias)
        self.o = nn.Linear(cfg.q_width, d, bias=False)
        # Qwen3: one RMSNorm over each head's q and k, before RoPE
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under TP each rank holds heads/tp and kv_heads/tp of them
        q = self.q(x).view(b, t, -1, self.head_dim)
        k = self.k(x).view(b, t, -1, self.head_dim)
        v = self.v(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        group = q.shape[2] // k.shape[2]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=False)
        self.up = nn.Linear(d_model, hidden, bias=False)
        self.down = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelSpec):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        # a mixture of experts stands where the dense MLP would (model.experts > 0)
        self.mlp = MoE(cfg) if cfg.experts else SwiGLU(cfg.d_model, cfg.ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Embedding(nn.Embedding):
    """The token embedding. Given hidden states (floating point) instead of token ids, it is a
    tied LM head: the logits from its own weight. The last stage of a pipeline computes a tied
    head that way, through the module call, so FSDP gathers the weight around it as around any
    forward (worker/trainer/pipeline.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) if x.is_floating_point() else super().forward(x)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelSpec):
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Embedding | None = Embedding(cfg.vocab, cfg.d_model)
        # False on a pipeline's later stages, which take hidden states (pipeline.py)
        self.takes_tokens = True
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        # tied: the logits are computed with the embedding's own weight (`forward`), so the
        # one tensor is trained once and FSDP holds it in one group (under TP the
        # vocab-parallel embedding computes them, worker/trainer/vocab_embedding.py; under a
        # pipeline the last stage holds a copy, kept equal: worker/trainer/tied_copies.py)
        self.tied = cfg.tie_embeddings
        self.head: nn.Linear | None = (
            None if self.tied else nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        )
        cos, sin = rope_tables(cfg)
        # non-persistent: derived from the spec, never checkpointed or sharded; on the meta
        # device until init_weights writes them
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) on the first stage, hidden states (B, T, D) on later ones."""
        h = self.embed(x) if self.takes_tokens else x
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is None:  # a pipeline stage before the last
            return h
        h = self.norm(h)
        if not self.tied:
            return self.head(h)
        if not self.takes_tokens:  # a pipeline's last stage: its own copy (pipeline.py)
            return self.embed(h)
        if isinstance(self.embed, VocabParallelEmbedding):
            return self.embed.logits(h)  # under TP: this rank's vocabulary shard
        return F.linear(h, self.embed.weight)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Write every parameter this rank holds (a whole tensor or its DTensor shard) and the
        RoPE tables. Each element's value is a function of (`param_seed`, its index in the full
        parameter), and a rank computes only the elements it holds (worker/trainer/init_rng.py):
        every layout holds what one process would, with no full parameter on any rank."""
        std = 0.02
        out_std = std / math.sqrt(2 * self.cfg.layers)  # GPT-2 style residual scaling
        for name, p in self.named_parameters():
            name = name.replace(_CHECKPOINT_PREFIX, "")  # the unwrapped model's name
            if p.dim() == 1:  # RMSNorm gains
                (p.to_local() if isinstance(p, DTensor) else p).fill_(1.0)
                continue
            resid_out = name.endswith(("attn.o.weight", "mlp.down.weight", "experts.w_down"))
            fill_normal(p, param_seed(seed, name), out_std if resid_out else std)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """The RoPE tables: derived from the spec, never restored (not in any state dict)."""
        cos, sin = rope_tables(self.cfg)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)


def param_seed(seed: int, name: str) -> int:
    """A generator seed from (train.seed, parameter name): stable across processes and runs
    (Python's hash() is salted per process)."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # manual_seed takes < 2**63


def build_model(cfg: ModelSpec, seed: int, device: str | torch.device = "cpu") -> Transformer:
    """The whole model with the seed's weights; on `meta`, unwritten (to parallelize first,
    then `to_empty` and `init_weights`: worker/trainer/step.py)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    if str(device) != "meta":
        model.to_empty(device=device)
        model.init_weights(seed)
    return model


def param_count(cfg: ModelSpec) -> int:
    return sum(p.numel() for p in build_model(cfg, 0, "meta").parameters())


def flops_per_token(cfg: ModelSpec) -> float:
    """Training FLOPs per token: 6N plus attention scores (PaLM appendix B), where N counts
    the parameters a token runs through (top_k experts of a mixture, not all of them)."""
    active = param_count(cfg) - cfg.params + cfg.active_params  # only experts are skipped
    return 6 * active + 12 * cfg.layers * cfg.d_model * cfg.seq_len
