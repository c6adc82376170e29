"""Decoder-only transformer: RMSNorm, RoPE attention, SwiGLU MLP.

Layers live in a ModuleDict keyed by their global index so parameter names survive
pipeline splitting. A stage built for pipelining keeps only its own layers and sets
`embed` / `norm` / `head` to None where another stage owns them.

Attention and MLP read their head count / widths from the weights they hold, so the
same module works before and after tensor-parallel sharding (which shrinks them).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from services.spec import ModelSpec


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv)
    return ang.cos().float(), ang.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, T, H, D); rotate interleaved pairs
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, : x.shape[1], None, :], sin[None, : x.shape[1], None, :]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.head_dim = d_model // heads
        self.q = nn.Linear(d_model, d_model, bias=False)
        self.k = nn.Linear(d_model, d_model, bias=False)
        self.v = nn.Linear(d_model, d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under TP each rank holds heads/tp of them
        q = apply_rope(self.q(x).view(b, t, -1, self.head_dim), cos, sin)
        k = apply_rope(self.k(x).view(b, t, -1, self.head_dim), cos, sin)
        v = self.v(x).view(b, t, -1, self.head_dim)
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
        self.attn = Attention(cfg.d_model, cfg.heads)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelSpec):
        super().__init__()
        self.cfg = cfg
        self.embed: nn.Embedding | None = nn.Embedding(cfg.vocab, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.head: nn.Linear | None = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
        # non-persistent: derived from the spec, never checkpointed or sharded
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) on the first stage, hidden states (B, T, D) on later ones."""
        h = self.embed(x) if self.embed is not None else x
        for layer in self.layers.values():
            h = layer(h, self.rope_cos, self.rope_sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h) if self.head is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic full init from `seed`, independent of how the model is later split."""
        g = torch.Generator().manual_seed(seed)
        std = 0.02
        out_std = std / math.sqrt(2 * self.cfg.layers)  # GPT-2 style residual scaling
        for name, p in sorted(self.named_parameters()):
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                resid_out = name.endswith(("attn.o.weight", "mlp.down.weight"))
                p.copy_(torch.randn(p.shape, generator=g) * (out_std if resid_out else std))


def build_model(cfg: ModelSpec, seed: int, device: str | torch.device = "cpu") -> Transformer:
    """The full model with the seed's weights; `meta` builds it without memory (planning)."""
    with torch.device(device):
        model = Transformer(cfg)
    if str(device) != "meta":
        model.init_weights(seed)
    return model


def param_count(cfg: ModelSpec) -> int:
    return sum(p.numel() for p in build_model(cfg, 0, "meta").parameters())


def flops_per_token(cfg: ModelSpec) -> float:
    """Training FLOPs per token: 6N plus attention scores (PaLM appendix B)."""
    return 6 * param_count(cfg) + 12 * cfg.layers * cfg.d_model * cfg.seq_len
