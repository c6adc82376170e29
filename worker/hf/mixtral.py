"""The state-dict adapter of Mixtral (`MixtralForCausalLM`): the names and layouts of its
router and experts. Everything else (embedding, attention, norms, head) is the Llama
family's (worker/hf/llama.py: the same names and the same RoPE row permutation).

meshkeeper stacks each layer's experts (worker/trainer/moe.py, `Experts`): `w_gate` and
`w_up` (experts, d_model, hidden) and `w_down` (experts, hidden, d_model), each a matrix the
rows are multiplied by on the right. A Mixtral checkpoint holds them in one of two forms:
- the hub's (`HUB`), which `save_pretrained` also writes by default: one tensor per expert,
  `model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight` (gate, hidden x d_model), `w3`
  (up, hidden x d_model) and `w2` (down, d_model x hidden), nn.Linear weights (out x in), and
  the router `block_sparse_moe.gate.weight` (experts x d_model);
- transformers 5's in-memory form (`FUSED`, `save_pretrained(save_original_format=False)`):
  `model.layers.{i}.mlp.experts.gate_up_proj` (experts, 2 * hidden, d_model: gate's rows,
  then up's), `mlp.experts.down_proj` (experts, d_model, hidden) and `mlp.gate.weight`.
Expert e of the checkpoint is expert e of meshkeeper (its row of the router), transposed.

A rank reads only what its shard holds (the shard's own indices along each dim,
worker/trainer/init_rng.py `_held`, as worker/hf/weights.py reads every other tensor): the
experts it holds (expert parallelism gives it experts/ep of them, FSDP over the replicas of
its expert shard possibly fewer), one tensor each in the hub's form, their box of a fused
tensor; and under TP only its slice of each expert's hidden width.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor

from services.model_spec import ModelSpec
from worker.trainer.init_rng import _held

HUB, FUSED = "hub", "fused"
_OURS = re.compile(r"^layers\.(\d+)\.mlp\.(router\.gate\.weight|experts\.w_(gate|up|down))$")
# per expert, the hub's tensor of each of meshkeeper's stacked weights
_HUB_EXPERT = {"gate": "w1", "up": "w3", "down": "w2"}


def owns(name: str) -> bool:
    """Whether meshkeeper parameter `name` is a router's or experts' (mapped here)."""
    return _OURS.match(name) is not None


def form(keys: Iterable[str]) -> str:
    """The directory's form: FUSED where it holds fused experts and no hub-named ones, else
    HUB (also for a directory with neither, so that errors name the hub's keys)."""
    keys = list(keys)
    fused = any(k.endswith(".mlp.experts.gate_up_proj") for k in keys)
    hub = any(".block_sparse_moe." in k for k in keys)
    return FUSED if fused and not hub else HUB


def hf_keys(name: str, shape: list[int], form: str) -> dict[str, tuple[str, list[int]]]:
    """Checkpoint key -> (`name`, the key's shape) of every tensor that meshkeeper parameter
    `name` (of `shape`) is read from; in expert order."""
    layer, kind = _split(name)
    if kind == "router":
        moe = "block_sparse_moe" if form == HUB else "mlp"
        return {f"model.layers.{layer}.{moe}.gate.weight": (name, shape)}
    experts, rows, cols = shape  # (E, d, h) for gate and up, (E, h, d) for down
    if form == HUB:
        prefix = f"model.layers.{layer}.block_sparse_moe.experts"
        w = _HUB_EXPERT[kind]
        return {f"{prefix}.{e}.{w}.weight": (name, [cols, rows]) for e in range(experts)}
    prefix = f"model.layers.{layer}.mlp.experts"
    if kind == "down":
        return {f"{prefix}.down_proj": (name, [experts, cols, rows])}
    return {f"{prefix}.gate_up_proj": (name, [experts, 2 * cols, rows])}


def load(weights, name: str, p: torch.Tensor, form: str) -> dict[str, int]:
    """Write this rank's shard of parameter `name` (`p`: its DTensor or plain tensor) from
    `weights` (worker/hf/weights.py's SafetensorsDir); the bytes read per checkpoint key.
    Each read is the box (`SafetensorsDir.box`) spanning what the shard holds of that tensor:
    the rank's experts only, and under TP its slice of each expert's hidden width."""
    local = p.to_local() if isinstance(p, DTensor) else p
    if local.numel() == 0:  # an uneven split left this rank none of it
        return {}
    _, kind = _split(name)
    keys = list(hf_keys(name, list(p.shape), form))
    # the full tensor's indices this rank's shard holds, along each dim, in local order
    held = [_held(p, d).cpu() for d in range(p.dim())]
    read: dict[str, int] = {}
    if kind == "router":  # (E, d_model) in both forms, as meshkeeper's
        shard = _box(weights, keys[0], held, read)
    elif form == HUB:
        # expert e's (out x in) Linear weight is meshkeeper's (in x out) matrix, transposed
        experts, rows, cols = held
        pieces = [_box(weights, keys[e], [cols, rows], read).T for e in experts.tolist()]
        shard = torch.stack(pieces)
    else:
        experts, rows, cols = held
        if kind == "up":  # gate_up_proj holds gate's hidden rows, then up's
            cols = cols + p.shape[2]
        shard = _box(weights, keys[0], [experts, cols, rows], read).transpose(1, 2)
    local.copy_(shard)
    return read


def _box(weights, key: str, at: list[torch.Tensor], read: dict[str, int]) -> torch.Tensor:
    """The elements of checkpoint tensor `key` at indices `at` (one index tensor per dim), in
    fp32: the box spanning them is read (counted in `read`) and gathered where they are not
    the whole box in order."""
    index = tuple(slice(int(i.min()), int(i.max()) + 1) for i in at)
    with weights.box(key, index) as part:
        read[key] = read.get(key, 0) + part.numel() * part.element_size()
        for d, (i, span) in enumerate(zip(at, index, strict=True)):
            if not torch.equal(i - span.start, torch.arange(len(i))):
                part = part.index_select(d, i - span.start)
        return part.to(torch.float32, copy=True)  # off the mapping, which closes here


def to_hf(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Checkpoint key -> tensor (HUB form, what `save_pretrained` writes and the hub holds) of
    meshkeeper parameter `name`, whole (the inverse of `load` on one rank)."""
    keys = hf_keys(name, list(tensor.shape), HUB)
    if _split(name)[1] == "router":
        return {k: tensor for k in keys}
    return {k: tensor[e].T for e, k in enumerate(keys)}


def architecture_fields(cfg: ModelSpec) -> dict:
    """The config.json fields of a Mixtral export made from meshkeeper's own spec (no
    model.hf); `worker/hf/export.py` adds them to the Llama family's."""
    return {
        "num_local_experts": cfg.experts,
        "num_experts_per_tok": cfg.top_k,
        "output_router_logits": False,  # meshkeeper's balance loss is not transformers'
        "router_jitter_noise": 0.0,
        "sliding_window": None,
    }


def _split(name: str) -> tuple[str, str]:
    """(layer, kind) of one of the names this module owns; kind is router, gate, up, down."""
    m = _OURS.match(name)
    if m is None:
        raise KeyError(f"{name}: not a router or experts weight")
    return m.group(1), m.group(3) or "router"
