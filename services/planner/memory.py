"""Bytes one rank holds at its peak (docs/planner.md, "Memory anatomy").

The model follows what the trainer builds (docs/architecture.md, "Trainer"): fp32 master
weights, gradients and AdamW's two moments, sharded over dp by ZeRO 2/3 (FSDP2); the
unsharded copies FSDP2 gathers to compute with; the activations each schedule keeps in flight;
the pipeline's receive buffers and the loss's logits; and the process's own runtime. The rank
reported is the worst pipeline position: the first (embedding, most microbatches in flight)
or the last (LM head, logits).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.planner.layout import Cluster, Layout
from services.spec import JobSpec

MASTER_B, GRAD_B, ADAM_B = 4, 4, 8  # fp32 weights, fp32 gradients, AdamW exp_avg + exp_avg_sq
LOGITS_B = 4  # the loss upcasts logits to fp32 (worker/trainer/step.py)


@dataclass(frozen=True)
class MemoryAnatomy:
    params: int  # fp32 master weights this rank stores (its ZeRO shard)
    grads: int
    optimizer: int
    gathered: int  # unsharded parameters FSDP2 holds while computing (and bf16 copies)
    activations: int  # saved for backward, every microbatch in flight
    buffers: int  # pipeline receive buffers, logits, one layer's backward workspace
    runtime: int  # the process before any model byte (the device profile's, measured on CPU)
    position: str  # which pipeline rank this is: "first", "last" or "only"

    @property
    def total(self) -> int:
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.gathered
            + self.activations
            + self.buffers
            + self.runtime
        )


def layer_params(spec: JobSpec) -> tuple[int, int]:
    """(TP-sharded, replicated) parameters of one transformer block."""
    m = spec.model
    norms = 2 * m.head_size if m.qk_norm else 0  # per-head q/k gains: every TP rank holds them
    return m.attention_params - norms + 3 * m.d_model * m.ffn, 2 * m.d_model + norms


def vocab_sharded(spec: JobSpec, tp: int) -> bool:
    return spec.parallel.loss_parallel and tp > 1


def act_bytes(spec: JobSpec) -> int:
    return 2 if spec.parallel.precision == "bf16" else 4


def layer_activations(spec: JobSpec, tp: int, tokens: int) -> int:
    """Bytes one block saves for backward for `tokens` tokens. Counted from the model
    (worker/trainer/model.py): per token, q and k before and after RoPE, v, the attention
    output and its contiguous copy (4 q_width + 3 kv_width: 7 d without grouped-query
    attention, split over tp) and the SwiGLU gate, its SiLU, up and
    their product (4 ffn, split over tp); the two RMSNorms keep their input, the normalized
    input and their output (6 d, split over tp only under sequence parallelism, which then
    all-gathers the attention's and the MLP's inputs whole: 2 d more; see
    worker/trainer/parallel.py)."""
    m = spec.model
    d, f = m.d_model, m.ffn
    sequence_parallel = spec.parallel.sequence_parallel and tp > 1
    norms = 6 * d / tp + 2 * d if sequence_parallel else 6 * d
    attention = 4 * m.q_width + 3 * m.kv_width
    return int(tokens * ((attention + 4 * f) / tp + norms) * act_bytes(spec))


def selective_activations(spec: JobSpec, tp: int, tokens: int) -> int:
    """Bytes one block keeps under selective AC (worker/trainer/activation_checkpoint.py): the
    outputs of its matmuls and of attention, the ones recomputing would cost most. Per token
    q, k and v, the attention output (2 q_width + 2 kv_width), the gate and up projections
    (2 ffn), split over tp; the two output projections and the block's input (3 d, split over
    tp only under sequence parallelism, whose reduce-scatters they then are)."""
    m = spec.model
    seq_split = tp if spec.parallel.sequence_parallel and tp > 1 else 1
    matmuls = (2 * m.q_width + 2 * m.kv_width + 2 * m.ffn) / tp + 3 * m.d_model / seq_split
    return int(tokens * matmuls * act_bytes(spec))


def in_flight(layout: Layout, position: str, layers: int) -> float:
    """Block-microbatches whose activations a pipeline rank holds at its peak.
    GPipe runs every forward first; 1F1B keeps pp - r; interleaved 1F1B keeps
    2(pp - r - 1) + (v - 1) pp + 1 chunks of layers/(pp v) blocks (Narayanan et al., 2021)."""
    pp, m, v = layout.pp, layout.microbatches, layout.virtual_stages
    per_rank = layers // pp
    if pp == 1:
        return per_rank  # one microbatch at a time: forward, backward, next
    r = 0 if position == "first" else pp - 1
    if layout.pp_schedule == "gpipe":
        return m * per_rank
    if layout.pp_schedule == "1f1b":
        return min(pp - r, m) * per_rank
    chunks = min(m * v, 2 * (pp - r - 1) + (v - 1) * pp + 1)
    return chunks * per_rank / v


def rank_memory(spec: JobSpec, layout: Layout, cluster: Cluster) -> MemoryAnatomy:
    """The worst pipeline rank's anatomy (the largest total)."""
    positions = ["only"] if layout.pp == 1 else ["first", "last"]
    return max((memory_at(spec, layout, cluster, pos) for pos in positions), key=lambda a: a.total)


def memory_at(spec: JobSpec, layout: Layout, cluster: Cluster, position: str) -> MemoryAnatomy:
    """The anatomy of the pipeline rank at `position`: "first" (pp rank 0), "last" (pp - 1)
    or "only" (pp 1)."""
    m, t = spec.model, spec.train
    tp, dp = layout.tp, layout.dp
    sharded, replicated = layer_params(spec)
    block = sharded // tp + replicated
    blocks = m.layers // layout.pp
    vocab_rows = m.vocab * m.d_model // (tp if vocab_sharded(spec, tp) else 1)
    edge = 0
    if position in ("first", "only"):
        edge += vocab_rows  # embedding
    if position in ("last", "only"):
        # a tied head is the embedding itself; the last of several stages holds a copy
        head = 0 if m.tie_embeddings and position == "only" else vocab_rows
        edge += head + m.d_model  # LM head and final norm
    local = blocks * block + edge  # parameters of this rank's stage(s), before ZeRO
    shard = local / dp if layout.zero in (2, 3) else local
    # zero 2 under a pipeline accumulates unsharded gradients until the step's last
    # microbatch and reduces them once (torch's stage); zero 3 reduces every microbatch
    # (worker/trainer/pipeline.py: ShardedStage)
    grads = local if layout.zero == 2 and layout.pp > 1 else shard
    compute_b = act_bytes(spec)
    if layout.zero == 2:
        gathered = local * compute_b  # kept unsharded from forward to the end of backward
    elif layout.zero == 3:
        gathered = (2 * block + edge) * compute_b  # the block computing, the next prefetched
    else:
        gathered = local * 2 if compute_b == 2 else 0  # bf16 compute copies of the weights
    tokens = (t.global_batch // (dp * layout.microbatches)) * m.seq_len
    per_block = layer_activations(spec, tp, tokens)
    if layout.activation_checkpointing == "selective":
        saved = selective_activations(spec, tp, tokens)
    elif layout.activation_checkpointing:
        shard_seq = tp if spec.parallel.sequence_parallel and tp > 1 else 1
        saved = tokens * m.d_model * compute_b // shard_seq  # each block's input only
    else:
        saved = per_block
    activations = in_flight(layout, position, m.layers) * saved
    # one block's backward workspace (the gradients it produces); under AC the block's
    # recomputed activations are live beside it
    buffers = per_block * (2 if layout.activation_checkpointing else 1)
    if layout.pp > 1:
        # PipelineStage allocates an activation and a gradient receive buffer per microbatch
        buffers += 2 * layout.microbatches * layout.virtual_stages * tokens * m.d_model * compute_b
    if position in ("last", "only"):
        held = 1 if layout.pp == 1 or layout.pp_schedule != "gpipe" else layout.microbatches
        vocab = m.vocab // (tp if vocab_sharded(spec, tp) else 1)
        buffers += tokens * vocab * LOGITS_B * (held + 2)  # saved log-softmax; logits + grad
    return MemoryAnatomy(
        params=int(shard * MASTER_B),
        grads=int(grads * GRAD_B),
        optimizer=int(shard * ADAM_B),
        gathered=int(gathered),
        activations=int(activations),
        buffers=int(buffers),
        runtime=cluster.device.runtime_bytes,
        position=position,
    )
