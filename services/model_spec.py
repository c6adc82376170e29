"""The `model` section of the job spec: the architecture's fields, the presets, and the
parameter counts admission and the planner use without torch (services/spec.py checks the
fields against the layout)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from services.spec_types import PathText, Strict

# tiny: tests; small: demo on 2 CPU cores; the rest exist for planning (parameter and FLOP
# counts), built on `meta`. 8b and 70b are Llama 3's shapes (its config.json files): grouped-
# query attention with 8 KV heads, its MLP widths and RoPE base.
PRESETS: dict[str, dict[str, float]] = {
    "tiny": dict(layers=4, d_model=64, heads=4, vocab=256, seq_len=32),
    "small": dict(layers=8, d_model=256, heads=8, vocab=1024, seq_len=128),
    "1b": dict(layers=16, d_model=2048, heads=32, vocab=128256, seq_len=4096),
    "8b": dict(
        layers=32,
        d_model=4096,
        heads=32,
        kv_heads=8,
        ffn_hidden=14336,
        vocab=128256,
        seq_len=8192,
        rope_theta=500000.0,
    ),
    "70b": dict(
        layers=80,
        d_model=8192,
        heads=64,
        kv_heads=8,
        ffn_hidden=28672,
        vocab=128256,
        seq_len=8192,
        rope_theta=500000.0,
    ),
}


class Llama3RopeScaling(Strict):
    """Llama 3.1's RoPE scaling (`rope_type: llama3` in its config.json): frequencies whose
    wavelength exceeds the original context are divided by `factor`, those far below it are
    kept, and those between are blended."""

    type: Literal["llama3"] = Field(
        default="llama3", description="The only scaling meshkeeper implements."
    )
    factor: float = Field(gt=0, le=1024, description="How much longer the context is made.")
    low_freq_factor: float = Field(
        gt=0, le=1024, description="Wavelengths above original / this are scaled fully."
    )
    high_freq_factor: float = Field(
        gt=0, le=1024, description="Wavelengths below original / this are kept as they are."
    )
    original_max_position_embeddings: int = Field(
        gt=0, le=1_048_576, description="The context length the model was first trained at."
    )

    @model_validator(mode="after")
    def _ordered(self) -> Llama3RopeScaling:
        if self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                f"({self.low_freq_factor})"
            )
        return self


class ModelSpec(Strict):
    preset: Literal["tiny", "small", "1b", "8b", "70b"] | None = None
    layers: int = Field(gt=0, le=1024)
    d_model: int = Field(gt=0, le=65536)
    heads: int = Field(gt=0, le=1024)
    vocab: int = Field(ge=2, le=1_048_576)
    seq_len: int = Field(ge=2, le=1_048_576)
    ffn_hidden: int | None = Field(default=None, gt=0, le=1_048_576)
    rope_theta: float = Field(default=10000.0, gt=0, le=1e12)
    norm_eps: float = Field(default=1e-5, gt=0, lt=1)
    kv_heads: int | None = Field(
        default=None,
        gt=0,
        le=1024,
        description="Key and value heads (grouped-query attention): each serves heads/kv_heads "
        "query heads. Unset: one per query head (multi-head attention). Under TP each rank "
        "holds kv_heads/tp of them, so tp must divide it.",
    )
    head_dim: int | None = Field(
        default=None,
        gt=0,
        le=4096,
        description="Width of one attention head. Unset: d_model/heads. Qwen3 sets it apart "
        "from d_model/heads; q and the attention output are then heads*head_dim wide.",
    )
    tie_embeddings: bool = Field(
        default=False,
        description="The LM head reuses the token embedding's weight (one tensor, trained "
        "once), as small Llama 3.2 and Qwen models do. Under TP it needs loss_parallel (the head "
        "is the vocab-parallel embedding's weight); under a pipeline the last stage holds a copy, "
        "kept equal to the first stage's.",
    )
    qkv_bias: bool = Field(
        default=False, description="Biases on the q, k and v projections (Qwen2)."
    )
    qk_norm: bool = Field(
        default=False,
        description="RMSNorm over each head of q and of k before RoPE (Qwen3), one gain per "
        "head_dim element shared by the heads.",
    )
    rope_scaling: Llama3RopeScaling | None = Field(
        default=None, description="Llama 3.1's long-context RoPE scaling; unset: plain RoPE."
    )
    hf: PathText | None = Field(
        default=None,
        max_length=4096,
        description="A Hugging Face model directory (config.json and *.safetensors) under a "
        "data root: its config.json gives the architecture (`meshkeeper submit` and the trainer "
        "read it; a field given here must agree with it), and its weights are the starting "
        'point (docs/models.md, "Bring your model").',
    )
    hf_weights: bool = Field(
        default=True,
        description="With hf: start from its weights. false: its architecture with "
        "meshkeeper's own seeded initialisation (pretraining a known shape from scratch).",
    )
    experts: int = Field(
        default=0,
        ge=0,
        le=4096,
        description="Experts per layer: 0 is a dense model; above 0 every block's MLP is a "
        "mixture of this many SwiGLU experts of hidden size ffn_hidden, behind a top_k router "
        '(docs/architecture.md, "Experts").',
    )
    top_k: int = Field(
        default=2,
        ge=1,
        le=64,
        description="Experts each token is routed to (with experts > 0); their outputs are "
        "summed, weighted by the softmax of the router logits of the chosen experts.",
    )
    capacity_factor: float = Field(
        default=0.0,
        ge=0,
        le=64,
        description="0: dropless routing, every choice is computed. c > 0: each expert takes "
        "at most ceil(c * seq_len * top_k / experts) of one sequence's choices (first choices "
        "first, then by position); the rest are dropped and counted in the drop-rate metric.",
    )
    aux_loss_coef: float = Field(
        default=0.01,
        ge=0,
        le=10,
        description="Weight of the load-balancing loss (Switch's, computed per sequence) in the "
        "training objective; 0 turns it off. The reported loss is the cross-entropy alone. "
        "With model.hf of a Mixtral, unset means 0 (what transformers trains with "
        "output_router_logits false; with it true the spec must set this: docs/models.md).",
    )

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("hf") and "layers" not in data:
            raise ValueError(
                "with model.hf the architecture comes from its config.json, which `meshkeeper "
                "submit` and the trainer read (services/hf_config.py); a spec sent to the API "
                "directly must carry it: submit with the CLI, or add layers, d_model, heads, "
                "kv_heads, head_dim, ffn_hidden, vocab and the rest"
            )
        # a non-string preset (a list, a dict: unhashable) is left to the field's own check
        if (
            isinstance(data, dict)
            and isinstance(data.get("preset"), str)
            and data["preset"] in PRESETS
        ):
            return {**PRESETS[data["preset"]], **data}
        return data

    @property
    def params(self) -> int:
        """Embedding + per layer (2 RMSNorms, q/k/v/o, SwiGLU gate/up/down, or the router and
        every expert's) + final norm + head; analytic (no torch), so admission can use it."""
        return self._count(max(1, self.experts))

    @property
    def active_params(self) -> int:
        """The parameters one token runs through: `params` with top_k experts, not all."""
        return self._count(min(self.top_k, self.experts) if self.experts else 1)

    def _count(self, ffns: int) -> int:
        d = self.d_model
        router = d * self.experts
        per_layer = 2 * d + self.attention_params + ffns * 3 * d * self.ffn + router
        head = 0 if self.tie_embeddings else d * self.vocab
        return self.vocab * d + self.layers * per_layer + d + head

    @property
    def head_size(self) -> int:
        """One attention head's width: head_dim, or d_model/heads."""
        return self.head_dim or self.d_model // self.heads

    @property
    def key_value_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def q_width(self) -> int:
        """Width of q and of the attention output: heads * head_size."""
        return self.heads * self.head_size

    @property
    def kv_width(self) -> int:
        """Width of k and of v: key_value_heads * head_size."""
        return self.key_value_heads * self.head_size

    @property
    def attention_params(self) -> int:
        """q, k, v and o of one block, their biases, and the per-head q/k norms."""
        d, q, kv = self.d_model, self.q_width, self.kv_width
        biases = q + 2 * kv if self.qkv_bias else 0
        norms = 2 * self.head_size if self.qk_norm else 0
        return 2 * d * q + 2 * d * kv + biases + norms

    @property
    def ffn(self) -> int:
        """SwiGLU hidden size: ~8/3 d_model rounded up to a multiple of 64."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        return -(-int(8 * self.d_model / 3) // 64) * 64
