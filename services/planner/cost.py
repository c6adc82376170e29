"""Step time of a layout: compute, pipeline bubble and communication per axis
(docs/planner.md, "Step time").

Compute is a roofline per GEMM (the slower of its FLOPs at the device's GEMM rate and its bytes
at memory bandwidth) plus a fixed cost per op (dispatch; it dominates tiny models on CPU).
Collectives are ring algorithms: a ring all-reduce moves 2(n-1)/n of the bytes per rank in
2(n-1) steps, a reduce-scatter or all-gather half of that. The pipeline runs at its slowest
stage for M*v + pp - 1 chunk-slots; DP traffic overlaps the rank's compute as far as the
device profile allows.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.planner.layout import Cluster, Layout
from services.planner.memory import (
    LOGITS_B,
    act_bytes,
    layer_activations,
    layer_params,
    selective_activations,
    vocab_sharded,
)
from services.spec import JobSpec

# ops one block runs per microbatch: forward; backward runs about twice as many
OPS_PER_BLOCK = 40
GRAD_B = 4  # gradients are reduced in fp32 (FSDP2 reduce_dtype)


@dataclass(frozen=True)
class StepCost:
    step_time_s: float
    bubble: float  # the pipeline's idle share, (pp-1)/(M*v + pp-1)
    compute_s: float  # the rank's own work on the critical path, without the bubble
    bubble_s: float
    tp_s: float  # TP collectives (all-reduce, or reduce-scatter + all-gather under SP)
    pp_s: float  # stage-to-stage sends on the critical path
    dp_s: float  # DP collectives not hidden behind compute
    optimizer_s: float
    tp_bytes: int  # per rank per step, on each axis
    pp_bytes: int
    dp_bytes: int

    def dominant(self) -> str:
        parts = {
            "compute": self.compute_s,
            "pipeline bubble": self.bubble_s,
            "TP communication": self.tp_s,
            "PP communication": self.pp_s,
            "DP communication": self.dp_s,
            "optimizer step": self.optimizer_s,
        }
        return max(parts, key=parts.__getitem__)


def bubble_fraction(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """(K-1)/(M+K-1); interleaving v chunks per rank makes it (K-1)/(v*M+K-1)."""
    if pp == 1:
        return 0.0
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)


def _gemm_s(m: int, k: int, n: int, flops: float, bw: float, elem_b: int) -> float:
    return max(2 * m * k * n / flops, (m * k + k * n + m * n) * elem_b / bw)


def _ring_s(bytes_: float, n: int, bw: float, latency: float, steps_factor: int) -> float:
    """steps_factor 2: all-reduce; 1: reduce-scatter or all-gather."""
    if n == 1 or bytes_ == 0:
        return 0.0
    return steps_factor * ((n - 1) / n * bytes_ / bw + (n - 1) * latency)


def step_cost(spec: JobSpec, layout: Layout, cluster: Cluster) -> StepCost:
    m, t, dev = spec.model, spec.train, cluster.device
    tp, pp, dp, v, mb = layout.tp, layout.pp, layout.dp, layout.virtual_stages, layout.microbatches
    d, f, s = m.d_model, m.ffn, m.seq_len
    elem = act_bytes(spec)
    flops = dev.flops[spec.parallel.matmul_precision] * dev.gemm_efficiency
    b = t.global_batch // (dp * mb)
    tokens = b * s

    def gemm(k: int, n: int) -> float:
        return _gemm_s(tokens, k, n, flops, dev.memory_bw, elem)

    # one block, one microbatch, forward
    q, kv = m.q_width // tp, m.kv_width // tp
    attn = 2 * b * s * s * q / flops  # causal SDPA: half of QK^T and PV
    block_fwd = gemm(d, q) + 2 * gemm(d, kv) + gemm(q, d) + 2 * gemm(d, f // tp) + gemm(f // tp, d)
    block_fwd += attn + OPS_PER_BLOCK * dev.op_overhead_s
    if layout.activation_checkpointing == "selective":
        # the memory-bound operations between the kept matmul outputs, run again: what
        # they write, at the device's bandwidth, and their launches
        redone = layer_activations(spec, tp, tokens) - selective_activations(spec, tp, tokens)
        recompute = redone / dev.memory_bw + OPS_PER_BLOCK * dev.op_overhead_s
    else:
        recompute = block_fwd if layout.activation_checkpointing else 0.0
    block = 3 * block_fwd + recompute  # backward costs two forwards

    tp_bw, tp_lat = cluster.link(tp)
    act = tokens * d * elem  # one block's output, the unit every TP collective and PP send moves
    tp_block = 4 * _ring_s(act, tp, tp_bw, tp_lat, 2)  # 2 forward + 2 backward, per block
    vocab = m.vocab // (tp if vocab_sharded(spec, tp) else 1)
    head = 3 * gemm(d, vocab) + tokens * vocab * LOGITS_B * 3 / dev.memory_bw

    blocks_per_chunk = m.layers // (pp * v)
    chunk = blocks_per_chunk * (block + tp_block)
    pp_bw, pp_lat = cluster.link(pp * tp)
    send = (act / pp_bw + pp_lat) * 2 if pp > 1 else 0.0  # activation forward, gradient back
    slots = mb * v + pp - 1
    bubble = bubble_fraction(pp, mb, v)
    compute = mb * v * blocks_per_chunk * block + mb * head
    tp_time = mb * v * blocks_per_chunk * tp_block
    pp_time = slots * send
    bubble_s = (pp - 1) * (chunk + send) if pp > 1 else 0.0

    sharded, replicated = layer_params(spec)
    local = (m.layers // pp) * (sharded // tp + replicated) + m.vocab * d // (
        tp if vocab_sharded(spec, tp) else 1
    )
    # The trainer reduces every microbatch's gradients at pp 1, and under a pipeline at zero 3
    # too (worker/trainer/pipeline.py: ShardedStage); zero 0 and 2 under a pipeline reduce
    # once per step.
    syncs = mb if pp == 1 or layout.zero == 3 else 1
    dp_bw, dp_lat = cluster.link(layout.world)
    # one FSDP group per block, the embedding and the head (each on its own stage), the root
    groups = m.layers // pp + (3 if pp == 1 else 2)
    if layout.zero == 0:
        dp_bytes = 2 * syncs * local * GRAD_B
        dp_time = syncs * _ring_s(local * GRAD_B, dp, dp_bw, dp_lat * groups, 2)
    else:
        gathers = mb * (2 if layout.zero == 3 else 1)
        dp_bytes = syncs * local * GRAD_B + gathers * local * elem
        dp_time = syncs * _ring_s(local * GRAD_B, dp, dp_bw, dp_lat * groups, 1)
        dp_time += gathers * _ring_s(local * elem, dp, dp_bw, dp_lat * groups, 1)
    hidden = min(dp_time * dev.comm_overlap, compute)
    dp_exposed = dp_time - hidden

    shard = local / dp if layout.zero in (2, 3) else local
    optimizer = shard * 28 / dev.memory_bw  # AdamW reads ~16 B and writes ~12 B per parameter
    total = compute + tp_time + pp_time + bubble_s + dp_exposed + optimizer
    return StepCost(
        step_time_s=total,
        bubble=bubble,
        compute_s=compute,
        bubble_s=bubble_s,
        tp_s=tp_time,
        pp_s=pp_time,
        dp_s=dp_exposed,
        optimizer_s=optimizer,
        tp_bytes=int(mb * v * blocks_per_chunk * 4 * 2 * (tp - 1) / tp * act) if tp > 1 else 0,
        pp_bytes=int(2 * mb * v * act) if pp > 1 else 0,
        dp_bytes=int(dp_bytes * (dp - 1) / dp),
    )
