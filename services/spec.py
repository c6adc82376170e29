"""The job spec: pydantic models, presets, and checks that name the field and the fix.

`load_spec(path)` and `parse_spec(dict)` are the only entry points; both raise
`SpecError` (a list of `Problem(field, message)`) and never a raw traceback.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal, get_args, get_origin

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
)

from services.epochs import with_epochs
from services.hf_config import with_hf_architecture
from services.model_spec import PRESETS, ModelSpec  # noqa: F401  (PRESETS: re-exported)
from services.spec_types import (  # noqa: F401
    FILE_SOURCES,
    PathText,
    Problem,
    SpecError,
    Strict,
    printable_path,
)

MAX_WORLD = 65536
# Beyond any model this service could train (70b is the largest preset); a spec above it is a
# typo or an attempt to make the planner and admission do absurd arithmetic.
MAX_PARAMS = 2 * 10**12
MAX_STEPS = 10**9


Beta = Annotated[float, Field(strict=True, ge=0, lt=1)]


DataSource = str  # "synthetic" | "text:PATH" | "tokens:PATH" | "dataset:DIR"


class DataSpec(Strict):
    source: Annotated[DataSource, AfterValidator(printable_path)] = Field(
        default="synthetic",
        max_length=4096,
        description="'synthetic' (a seeded Markov chain), 'text:PATH' (a file's bytes), "
        "'tokens:PATH' (a flat file of token ids) or 'dataset:DIR' (what `meshkeeper data "
        "prepare` wrote, with a held-out split); paths lie under a data root (docs/data.md)",
    )
    seed: int = Field(
        default=0,
        ge=0,
        lt=2**63,
        description="Keys the sample order: each epoch visits every window once, in an order "
        "that depends on (seed, epoch) alone",
    )
    token_dtype: Literal["uint16", "uint32"] = Field(
        default="uint16", description="The ids' width in a tokens: file"
    )

    @field_validator("source")
    @classmethod
    def _source_form(cls, source: str) -> str:
        kind, _, path = source.partition(":")
        if (kind == "synthetic" and not path) or (kind in FILE_SOURCES and path):
            return source
        raise ValueError(
            f"{source!r} is not understood; use 'synthetic', 'text:PATH', 'tokens:PATH' or "
            "'dataset:DIR'"
        )

    @property
    def kind(self) -> str:
        return self.source.partition(":")[0]

    @property
    def path(self) -> str:
        return self.source.partition(":")[2]


class ParallelSpec(Strict):
    dp: int = Field(default=1, ge=1, le=MAX_WORLD)
    pp: int = Field(default=1, ge=1, le=1024)
    tp: int = Field(default=1, ge=1, le=1024)
    ep: int = Field(
        default=1,
        ge=1,
        le=MAX_WORLD,
        description="Expert parallelism, carved out of dp (torchtitan's way): the dp ranks form "
        "dp/ep groups of ep ranks, each rank holding experts/ep of every layer's experts, and "
        "tokens travel to their experts by all-to-all. Needs model.experts > 0; ep must divide "
        "dp and model.experts. Everything but the experts stays data parallel over all of dp.",
    )
    zero: Literal[0, 2, 3] = 3
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b"] = "1f1b"
    virtual_stages: int = Field(default=1, ge=1, le=64)
    microbatches: int = Field(default=1, ge=1, le=4096)
    activation_checkpointing: Literal[False, True, "selective"] = Field(
        default=False,
        description="Recompute activations in backward instead of holding them: true "
        "recomputes each block whole from its input (the least memory, about a third more "
        'compute); "selective" keeps the outputs of every matmul, attention and TP '
        "collective and recomputes only the cheap operations between them (norms, RoPE, SiLU, "
        "products: about half a block's activations for a few percent of its time, "
        "torchtitan's op-level SAC); false holds everything.",
    )
    precision: Literal["fp32", "bf16"] = Field(
        default="fp32",
        description="Compute precision. bf16: forward and backward in bf16, with fp32 master "
        "weights, optimizer state and gradient reductions (FSDP2's MixedPrecisionPolicy). "
        "fp32 is bit-reproducible and what the parity tests compare.",
    )
    tf32: bool = Field(
        default=True,
        description="On CUDA with precision fp32: matmuls run on TF32 tensor cores (10-bit "
        "mantissa inputs, fp32 accumulation), about 7x fp32's peak on an H100. Still "
        "deterministic run to run, but layouts no longer agree to fp32's rounding: set false "
        "for strict fp32, as the GPU parity tests do. No effect on CPU or in bf16.",
    )
    loss_parallel: bool = Field(
        default=True,
        description="With tp > 1: shard the embedding and the LM head over the vocabulary and "
        "compute the cross-entropy on the vocab shards (torch's loss_parallel), so no rank "
        "holds the whole vocabulary's logits. No effect at tp 1.",
    )
    sequence_parallel: bool = Field(
        default=True,
        description="With tp > 1: split the norms' activations over the sequence on the TP "
        "axis (Megatron-style sequence parallelism), so they are not computed tp times.",
    )
    auto: bool = Field(
        default=False,
        description="Let the controller choose dp, pp, tp, zero, microbatches, virtual stages "
        "and activation checkpointing at admission from the live pool (the planner); the "
        "degrees given here are then ignored.",
    )

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    @property
    def matmul_precision(self) -> Literal["fp32", "tf32", "bf16"]:
        """What a GPU's matmuls run in: the key of a device's peak (services/planner)."""
        if self.precision == "fp32" and self.tf32:
            return "tf32"
        return self.precision


class TrainSpec(Strict):
    steps: int = Field(gt=0, le=MAX_STEPS)
    global_batch: int = Field(gt=0, le=10**7)
    lr: float = Field(default=3e-4, gt=0, le=1)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup_steps: int = Field(default=0, ge=0, le=MAX_STEPS)
    weight_decay: float = Field(default=0.1, ge=0, le=1)
    # a YAML/JSON list becomes the tuple (strict would want a tuple); each item stays strict
    betas: Annotated[tuple[Beta, Beta], Field(strict=False)] = (0.9, 0.95)
    grad_clip: float | None = Field(default=1.0, gt=0, le=1e6)
    seed: int = Field(default=0, ge=0, lt=2**63)


class EvalSpec(Strict):
    every_steps: int = Field(
        gt=0,
        le=MAX_STEPS,
        description="Measure the loss on held-out data after every this many optimizer steps "
        "(and after the last)",
    )
    batches: int = Field(
        default=4,
        gt=0,
        le=10_000,
        description="Global batches per measurement: the same ones every time, on every layout "
        "(the held-out split must hold batches x train.global_batch windows)",
    )


class CheckpointSpec(Strict):
    every_steps: int = Field(default=50, gt=0, le=MAX_STEPS)
    keep: int = Field(default=3, ge=1, le=1000)
    mode: Literal["sync", "async"] = "async"
    root: PathText | None = Field(default=None, min_length=1, max_length=4096)
    export_hf: PathText | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description="When the job succeeds, write its final checkpoint here as a Hugging Face "
        "model directory (what `meshkeeper export-hf` writes: config.json, safetensors shards "
        "and their index, generation_config.json, and model.hf's tokenizer files), in the "
        "training dtype. An absolute directory under the checkpoint roots, replaced whole: "
        "the export is written beside it and renamed into place. The job's status names it.",
    )


class PrioritySpec(Strict):
    # `class` in YAML and JSON (a Python keyword, hence the attribute's name)
    model_config = ConfigDict(
        **Strict.model_config,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )
    class_: str = Field(
        default="default",
        alias="class",
        min_length=1,
        max_length=63,
        description="The job's priority class (the controller's --priority-classes; built in: "
        "low 0, default 100, high 1000, which may preempt lower jobs). Higher values are "
        "placed first.",
    )


class PreemptionSpec(Strict):
    grace_s: float = Field(
        default=120.0,
        ge=1,
        le=86400,
        description="How long a job being suspended may take to stop at a step boundary and "
        "commit that step. Past it the controller stops its trainers, and the job resumes "
        "from its previous commit instead.",
    )


# An agent's beat blocks at most 1 s (0.5 s connect + 0.5 s reply, worker/agent/heartbeat.py)
# and the next starts within heartbeat_s: silence under 1.5 s proves nothing.
MIN_DEAD_AFTER_S = 1.5


class StragglerSpec(Strict):
    slowdown: float = Field(default=1.5, gt=1, le=100)
    window_steps: int = Field(default=20, ge=1, le=10000)
    action: Literal["replace", "report"] = "replace"


class FaultToleranceSpec(Strict):
    spares: int = Field(default=0, ge=0, le=MAX_WORLD)
    heartbeat_s: float = Field(
        default=0.5,
        ge=0.05,
        le=60,
        description="Seconds between an agent's heartbeats while it serves this job; faster "
        "than 0.05 s only loads Redis (each beat is a round trip) without detecting sooner.",
    )
    dead_after_s: float = Field(default=2.0, gt=0, le=3600)
    hang_after_s: float = Field(default=60.0, gt=0, le=86400)
    straggler: StragglerSpec = StragglerSpec()
    min_dp: int = Field(default=1, ge=1, le=MAX_WORLD)
    max_restarts: int = Field(default=20, ge=0, le=10000)
    quarantine_s: float = Field(
        default=60.0,
        ge=0,
        le=7 * 86400,
        description="How long a blamed worker (hung rank, replaced straggler, repeated collateral "
        "failures) stays out of the free pool. After it, the worker returns only once its "
        "agent's health probe (matmul + gloo all-reduce self-test) passes. 0: probe at once.",
    )
    collateral_limit: int = Field(
        default=3,
        ge=1,
        le=1000,
        description="Blameless failures (every rank exits with an error, no root cause found) "
        "in which the same worker's rank exited first, within collateral_window_s, before that "
        "worker is blamed and replaced (a flaky NIC or host shows up this way).",
    )
    collateral_window_s: float = Field(
        default=900.0,
        gt=0,
        le=7 * 86400,
        description="The window over which collateral_limit is counted.",
    )


class SnapshotSpec(Strict):
    enabled: bool = Field(
        default=True,
        description="Snapshot every rank's model and optimizer shards and train state into "
        "host shared memory (/dev/shm), so a recovery that keeps the mesh restores from memory "
        'instead of the last disk checkpoint (docs/fault-tolerance.md, "Hot recovery").',
    )
    every_steps: int = Field(
        default=1,
        gt=0,
        le=MAX_STEPS,
        description="Take a snapshot after every this many optimizer steps. A recovery from "
        "memory redoes the steps since the newest complete snapshot, so the default 1 redoes "
        "at most one.",
    )
    keep: int = Field(
        default=2,
        ge=2,
        le=16,
        description="Snapshot slots per rank, used as a ring: at least 2, so one complete "
        "slot survives while the next is written. Each slot holds the rank's whole state in "
        "host memory.",
    )
    full_every: int = Field(
        default=4,
        ge=1,
        le=64,
        description="With every_steps 1, write the whole state only every this many "
        "snapshots; the ones between log what the optimizer step consumed (the clipped "
        "gradients) and the buffers, about a third of an Adam state's bytes, and a restore "
        "replays them through the optimizer, which gives the same bits. Under FSDP (zero 2 "
        "or 3, on CPU) the gradients are reduced straight into the slot, so only the buffers "
        "are copied. It costs a rank full_every + keep - 1 slots of that size for its own "
        "logged steps and full_every + keep - 3 for a ward's, beside the keep whole ones. 1: "
        "every snapshot whole.",
    )
    buddy: bool = Field(
        default=True,
        description="Send each snapshot to a rank of the job on another host (its holder), "
        "so a rank whose host died restores from the copy over the network. false: only "
        "ranks that keep their worker restore from memory.",
    )


class SdcSpec(Strict):
    enabled: bool = Field(
        default=True,
        description='Check for silent data corruption (docs/fault-tolerance.md, "Silent data '
        'corruption"): layouts with DP replicas (parallel.zero 0, dp > 1) compare a fingerprint '
        "of every parameter and optimizer-state tensor across the replicas every every_steps; "
        "layouts without them and with pp 1 run a re-execution spot check every "
        "spot_every_steps. Pipeline layouts without replicas are not checked.",
    )
    every_steps: int = Field(
        default=10,
        gt=0,
        le=MAX_STEPS,
        description="Compare fingerprints every this many optimizer steps, and before every "
        "disk checkpoint save (so no checkpoint holds unchecked state). A corruption is found "
        "within every_steps steps and the job rolls back to the newest checked state, so a "
        "smaller value redoes fewer steps after a detection but checks more often (each check "
        "hashes the rank's state and all-gathers one number per tensor).",
    )
    at_rest: bool = Field(
        default=True,
        description="Every rank seals a fingerprint of its own parameter and optimizer-state "
        "shards after each optimizer step and verifies it before the state is copied or read "
        "again (worker/trainer/at_rest.py): a bit that flips in memory between steps is found "
        "in every layout, sharded ones included, and the rank is blamed. Costs three reads of "
        "the rank's state and one one-number all-reduce per step.",
    )
    spot_every_steps: int = Field(
        default=100,
        gt=0,
        le=MAX_STEPS,
        description="Layouts without DP replicas (parallel.zero 2 or 3, or one replica; pp 1) "
        "run a re-execution spot check every this many steps instead: one microbatch forward "
        "and backward twice, compared bitwise, to catch transient compute faults. One check "
        "costs about 1.2-1.5 steps, so the default adds about 1.5% to the step time; a "
        "smaller value samples the device more often at a proportional cost.",
    )
    anomaly_window: int = Field(
        default=50,
        ge=8,
        le=10000,
        description="Steps of loss and gradient norm over which a robust z-score (median and "
        "MAD) is taken; a step beyond anomaly_z is reported as an event, never acted on.",
    )
    anomaly_z: float = Field(
        default=8.0,
        gt=0,
        le=1000,
        description="The robust z-score of the loss or gradient norm above which a step is "
        "reported as an anomaly (an event only: a loss spike is not proof of corruption).",
    )


class BitFlip(Strict):
    rank: int = Field(ge=0, description="The rank whose state is corrupted (< dp*pp*tp).")
    step: int = Field(
        ge=1,
        le=MAX_STEPS,
        description="The step at which the bit is flipped (<= train.steps; steps are counted "
        'as completed optimizer steps, docs/architecture.md, "Records").',
    )
    tensor: Literal["param", "grad", "optim", "compute", "idle"] = Field(
        description="Which state of the rank: a parameter, a gradient (before the optimizer "
        "step) or an optimizer state tensor; `idle`, a parameter again but after the step's "
        "snapshot and checkpoint copies, while the rank is between steps; or `compute`, a "
        "transient compute fault: one bit of one activation flipped in the rank's first "
        "re-execution spot-check pass at `step` (a multiple of sdc.every_steps, on a layout "
        "that runs spot checks: no DP replicas, pp 1)."
    )
    bit: int = Field(
        default=30,
        ge=0,
        le=31,
        description="Which bit of one fp32 element to flip: 30, the top exponent bit, makes "
        "the value huge (or tiny), 0 changes the last mantissa bit.",
    )


class MemoryLimit(Strict):
    rank: int = Field(ge=0, description="The rank whose trainer is limited (< dp*pp*tp).")
    mib: int = Field(
        ge=1,
        le=1 << 20,
        description="The limit in MiB on what the trainer allocates once it starts (its torch "
        "import, made earlier by its agent's trainer zygote, is charged elsewhere).",
    )


class DeviceOom(Strict):
    rank: int = Field(ge=0, description="The rank that runs out of memory (< dp*pp*tp).")
    step: int = Field(
        ge=1,
        le=MAX_STEPS,
        description="The step during which it asks its device's allocator for more bytes than "
        "the device has (<= train.steps): the allocator's own out-of-memory error.",
    )


class DeviceError(Strict):
    rank: int = Field(ge=0, description="The rank whose device fails (< dp*pp*tp).")
    step: int = Field(
        ge=1,
        le=MAX_STEPS,
        description="The step during which its trainer gets torch's AcceleratorError, the "
        "error a CUDA fault (an illegal address, an uncorrectable ECC error) raises "
        "(<= train.steps).",
    )
    repeat: bool = Field(
        default=False,
        description="Raise it again in every later generation, at the same step on whichever "
        "worker then holds the rank, as a fault of the job's own (a token id past the "
        "vocabulary's device-side assert) would; false: once, as a failing GPU would.",
    )


class ChaosSpec(Strict):
    """Fault injection for testing detection; admitted only by a controller started with
    --allow-chaos and only from an admin token (docs/security.md, "Fault injection")."""

    bitflip: list[BitFlip] = Field(
        default=[],
        max_length=64,
        description="Flip one bit of one rank's state at a chosen step, once each.",
    )
    memory_limit: list[MemoryLimit] = Field(
        default=[],
        max_length=64,
        description="Start a rank in a memory cgroup of its own that its agent creates with "
        "this limit, so the kernel's OOM killer ends it for real once it allocates more. An "
        "agent that cannot create one (no writable memory cgroup) refuses the assignment.",
    )
    device_oom: list[DeviceOom] = Field(
        default=[],
        max_length=64,
        description="Make a rank's device allocator fail for real at a chosen step, as an "
        "oversized batch or model would (torch.OutOfMemoryError on a GPU, the CPU allocator's "
        "error on a CPU).",
    )
    device_error: list[DeviceError] = Field(
        default=[],
        max_length=64,
        description="Make a rank's trainer fail with a device error at a chosen step.",
    )
    nondeterministic: bool = Field(
        default=False,
        description="Make every backward differ bitwise between executions, as a GPU's "
        "kernels that accumulate with atomics do: each microbatch's logits gradient is scaled "
        "elementwise by random factors within 2^-20 of one, on every rank, outside "
        "deterministic algorithms. A replay of the SDC check then reproduces no rank's history.",
    )
    save_delay_s: float = Field(
        default=0.0,
        ge=0,
        le=3600,
        description="Every checkpoint save's storage writer waits this long before it writes, "
        "on every rank, as slow storage would: a save longer than fault_tolerance.hang_after_s "
        "must not read as a hang.",
    )
    unwind_stall_s: float = Field(
        default=0.0,
        ge=0,
        le=600,
        description="A kept trainer whose generation failed stays this long in its unwinding "
        "before it looks for its next order, on every rank, as a rank stuck in native code "
        "would: past the agent's handover bound (10 s) it is started afresh instead.",
    )
    min_step_s: float | None = Field(
        default=None,
        gt=0,
        le=60,
        description="Every step of every rank lasts at least this long: the trainer sleeps "
        "out the rest after the step, outside its timing. A job that must still be training "
        "when injected faults end then lasts as long on a fast machine as on a slow one, "
        "without training more steps.",
    )


class JobSpec(Strict):
    name: str = Field(min_length=1, max_length=63)
    model: ModelSpec
    data: DataSpec = DataSpec()
    parallel: ParallelSpec = ParallelSpec()
    train: TrainSpec
    eval: EvalSpec | None = Field(
        default=None,
        description="Validation loss on the held-out split of a dataset: source (or on "
        "synthetic data the chain never trains on); none by default",
    )
    checkpoint: CheckpointSpec = CheckpointSpec()
    fault_tolerance: FaultToleranceSpec = FaultToleranceSpec()
    snapshot: SnapshotSpec = SnapshotSpec()
    sdc: SdcSpec = SdcSpec()
    priority: PrioritySpec = Field(
        default=PrioritySpec(),
        description="Where the job queues among others, and whether it may preempt",
    )
    preemption: PreemptionSpec = Field(
        default=PreemptionSpec(),
        description="Stopping the job to free its workers (suspend): the commit it is given",
    )
    suspend: bool = Field(
        default=False,
        description="Submit the job suspended: it waits, holding no workers, until it is "
        "resumed (POST /v1/jobs/{id}/resume, or false on a TrainingJob). A queue such as "
        "Kueue admits a workload this way.",
    )
    chaos: ChaosSpec | None = Field(
        default=None,
        description="Fault injection (tests and demonstrations only): refused unless the "
        "controller runs with --allow-chaos and the submitter is an admin.",
    )


NAME_RE = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def consistency_problems(s: JobSpec) -> list[Problem]:
    """Checks that span fields; each message says how to fix it."""
    m, p, t = s.model, s.parallel, s.train
    out: list[Problem] = []

    def bad(field: str, msg: str) -> None:
        out.append(Problem(field, msg))

    if not NAME_RE.fullmatch(s.name):
        bad(
            "name",
            f"{s.name!r} must be lowercase letters, digits and '-', starting and ending "
            "with a letter or digit (it names the checkpoint directory)",
        )
    if m.params > MAX_PARAMS:
        bad(
            "model",
            f"{m.params:.3g} parameters exceed the limit of {MAX_PARAMS:.0e}; "
            "lower model.layers or model.d_model (or use a preset)",
        )
    if p.world_size > MAX_WORLD:
        bad("parallel", f"dp*pp*tp = {p.world_size} exceeds {MAX_WORLD} ranks; lower dp, pp or tp")
    if m.head_dim is None and m.d_model % m.heads:
        bad(
            "model.heads",
            f"d_model ({m.d_model}) must be divisible by heads ({m.heads}); "
            f"choose heads in {{{_divisors(m.d_model)}}}, or set model.head_dim",
        )
    elif m.head_size % 2:
        bad(
            "model.head_dim" if m.head_dim else "model.heads",
            f"head dim {m.head_size} must be even for RoPE; "
            + ("choose an even head_dim" if m.head_dim else "halve heads or double d_model"),
        )
    if m.heads % m.key_value_heads:
        bad(
            "model.kv_heads",
            f"heads ({m.heads}) must be a multiple of kv_heads ({m.key_value_heads}): each KV "
            f"head serves the same number of query heads; choose kv_heads in "
            f"{{{_divisors(m.heads)}}}",
        )
    if m.heads % p.tp:
        bad(
            "parallel.tp",
            f"model.heads ({m.heads}) must be divisible by tp ({p.tp}); "
            f"choose tp in {{{_divisors(m.heads)}}}",
        )
    elif m.key_value_heads % p.tp:
        bad(
            "parallel.tp",
            f"model.kv_heads ({m.key_value_heads}) must be divisible by tp ({p.tp}): TP gives "
            f"each rank whole KV heads; choose tp in {{{_divisors(m.key_value_heads)}}}",
        )
    if m.tie_embeddings and p.tp > 1 and not p.loss_parallel:
        bad(
            "parallel.loss_parallel",
            f"a tied embedding and LM head at tp {p.tp} needs loss_parallel: true (the "
            "default): the head is the vocab-parallel embedding's own weight, so its logits "
            "are vocabulary shards",
        )
    if m.ffn % p.tp:
        bad(
            "parallel.tp",
            f"MLP hidden size ({m.ffn}) must be divisible by tp ({p.tp}); "
            "set model.ffn_hidden to a multiple of tp",
        )
    if p.tp > 1 and p.loss_parallel and m.vocab % p.tp:
        bad(
            "parallel.loss_parallel",
            f"vocab-parallel embedding and loss need model.vocab ({m.vocab}) divisible by tp "
            f"({p.tp}); pad model.vocab to a multiple of tp or set loss_parallel: false",
        )
    if p.tp > 1 and p.sequence_parallel and m.seq_len % p.tp:
        bad(
            "parallel.sequence_parallel",
            f"sequence parallelism needs model.seq_len ({m.seq_len}) divisible by tp "
            f"({p.tp}); choose seq_len a multiple of tp or set sequence_parallel: false",
        )
    out += _expert_problems(m, p)
    stages = p.pp * p.virtual_stages
    if m.layers % stages:
        bad(
            "model.layers",
            f"layers ({m.layers}) must be divisible by pp*virtual_stages "
            f"({p.pp}*{p.virtual_stages} = {stages}); change layers or pp",
        )
    if p.pp_schedule == "interleaved_1f1b":
        if p.virtual_stages < 2:
            bad(
                "parallel.virtual_stages",
                "interleaved_1f1b needs virtual_stages >= 2; set it or use pp_schedule 1f1b",
            )
        if p.microbatches % p.pp:
            bad(
                "parallel.microbatches",
                f"interleaved_1f1b needs microbatches ({p.microbatches}) divisible by pp ({p.pp})",
            )
    elif p.virtual_stages != 1:
        bad(
            "parallel.virtual_stages",
            f"virtual_stages > 1 needs pp_schedule interleaved_1f1b "
            f"(got {p.pp_schedule}); set virtual_stages: 1",
        )
    if p.pp > 1 and p.microbatches < p.pp:
        bad(
            "parallel.microbatches",
            f"microbatches ({p.microbatches}) must be >= pp ({p.pp}) "
            "or the pipeline never fills; raise microbatches",
        )
    if t.global_batch % (p.dp * p.microbatches):
        bad(
            "train.global_batch",
            f"global_batch ({t.global_batch}) must be divisible by "
            f"dp*microbatches ({p.dp}*{p.microbatches} = {p.dp * p.microbatches})",
        )
    if t.warmup_steps > t.steps:
        bad("train.warmup_steps", f"warmup_steps ({t.warmup_steps}) exceeds steps ({t.steps})")
    ft = s.fault_tolerance
    if ft.dead_after_s < max(2 * ft.heartbeat_s, MIN_DEAD_AFTER_S):
        bad(
            "fault_tolerance.dead_after_s",
            f"dead_after_s ({ft.dead_after_s}) must be at least 2x heartbeat_s "
            f"({ft.heartbeat_s}) and at least {MIN_DEAD_AFTER_S}s (one beat may block 1 s on "
            "a slow Redis before the next): a shorter one kills healthy ranks",
        )
    if ft.hang_after_s <= ft.dead_after_s:
        bad(
            "fault_tolerance.hang_after_s",
            f"hang_after_s ({ft.hang_after_s}) must exceed dead_after_s ({ft.dead_after_s})",
        )
    if ft.min_dp > p.dp:
        bad("fault_tolerance.min_dp", f"min_dp ({ft.min_dp}) cannot exceed parallel.dp ({p.dp})")
    if s.data.kind == "text" and m.vocab < 256:
        bad("model.vocab", f"text data is bytes and needs vocab >= 256 (got {m.vocab})")
    if s.eval and s.data.kind in ("text", "tokens"):
        bad(
            "eval",
            f"a {s.data.kind}: file has no held-out split to measure on; prepare the corpus with "
            "`meshkeeper data prepare` and use data.source dataset:DIR, or remove eval",
        )
    out += chaos_problems(s)
    return out


def _expert_problems(m: ModelSpec, p: ParallelSpec) -> list[Problem]:
    out: list[Problem] = []
    if m.experts and m.top_k > m.experts:
        out.append(
            Problem(
                "model.top_k",
                f"top_k ({m.top_k}) exceeds model.experts ({m.experts}); choose top_k from 1 "
                f"to {m.experts}",
            )
        )
    if m.experts and p.auto:
        out.append(
            Problem(
                "parallel.auto",
                "the planner does not model experts yet; set parallel.dp, pp, tp and ep and "
                "remove parallel.auto",
            )
        )
    if p.ep == 1:
        return out
    if not m.experts:
        out.append(
            Problem(
                "parallel.ep",
                f"ep ({p.ep}) shards experts, but model.experts is 0 (a dense model); set "
                "model.experts or ep: 1",
            )
        )
    elif m.experts % p.ep:
        out.append(
            Problem(
                "parallel.ep",
                f"model.experts ({m.experts}) must be divisible by ep ({p.ep}); choose ep in "
                f"{{{_divisors(m.experts)}}}",
            )
        )
    if p.dp % p.ep:
        out.append(
            Problem(
                "parallel.ep",
                f"ep is carved out of dp: dp ({p.dp}) must be divisible by ep ({p.ep}); choose "
                f"ep in {{{_divisors(p.dp)}}} or raise dp",
            )
        )
    return out


def chaos_problems(s: JobSpec) -> list[Problem]:
    """Every fault must land on a rank and a step the job has."""
    if s.chaos is None:
        return []
    p, steps = s.parallel, s.train.steps
    out: list[Problem] = []
    for name in ("bitflip", "memory_limit", "device_oom", "device_error"):
        if p.auto and getattr(s.chaos, name):
            out.append(
                Problem(
                    f"chaos.{name}",
                    "faults name ranks of a fixed layout, but parallel.auto lets the planner "
                    "choose it; set parallel.dp, pp and tp and remove parallel.auto",
                )
            )
    for i, limit in enumerate(s.chaos.memory_limit):
        out += _rank_problems(f"chaos.memory_limit[{i}].rank", limit.rank, p)
    for i, flip in enumerate(s.chaos.bitflip):
        if flip.tensor == "compute":
            out += _compute_fault_problems(s, i, flip)
    for name in ("bitflip", "device_oom", "device_error"):
        for i, fault in enumerate(getattr(s.chaos, name)):
            out += _rank_problems(f"chaos.{name}[{i}].rank", fault.rank, p)
            if fault.step > steps:
                out.append(
                    Problem(
                        f"chaos.{name}[{i}].step",
                        f"step {fault.step} is never reached: train.steps is {steps}; choose "
                        f"a step from 1 to {steps}",
                    )
                )
    return out


def _rank_problems(field: str, rank: int, p: ParallelSpec) -> list[Problem]:
    if rank < p.world_size:
        return []
    return [
        Problem(
            field,
            f"rank {rank} does not exist: dp*pp*tp = {p.dp}*{p.pp}*{p.tp} = "
            f"{p.world_size} ranks; choose a rank below {p.world_size}",
        )
    ]


def has_replicas(p: ParallelSpec) -> bool:
    """DP replicas hold bitwise-identical state: data parallel without ZeRO sharding (and,
    with experts split over ep, more than one replica of each expert shard)."""
    return p.dp // p.ep > 1 and p.zero == 0


def spot_checked(s: JobSpec) -> bool:
    """The layout runs re-execution spot checks (worker/trainer/spot_check.py): no replicas
    to compare, and one pipeline stage (a schedule built for M microbatches cannot run one)."""
    return s.sdc.enabled and not has_replicas(s.parallel) and s.parallel.pp == 1


def _compute_fault_problems(s: JobSpec, i: int, flip: BitFlip) -> list[Problem]:
    """A compute fault fires inside a spot check, so the job must run one at that step."""
    p, every, steps = s.parallel, s.sdc.spot_every_steps, s.train.steps
    field = f"chaos.bitflip[{i}]"
    if not s.sdc.enabled:
        return [
            Problem(
                f"{field}.tensor",
                "a compute fault fires inside a re-execution spot check, and sdc.enabled is "
                "false: set sdc.enabled: true or flip param, grad or optim",
            )
        ]
    if has_replicas(p) or p.pp > 1:
        why = (
            f"this layout compares DP replicas instead (dp {p.dp}, zero {p.zero})"
            if has_replicas(p)
            else f"pipeline layouts (pp {p.pp}) run none"
        )
        return [
            Problem(
                f"{field}.tensor",
                "a compute fault fires inside a re-execution spot check, which runs only on "
                f"layouts without DP replicas and with pp 1; {why}: flip param, grad or optim "
                "here, or use parallel.zero 2 or 3 (or dp 1) with pp 1",
            )
        ]
    # a step past train.steps has its own problem (chaos_problems)
    if flip.step <= steps and (flip.step % every or flip.step == steps):
        choices = list(range(every, steps, every))
        return [
            Problem(
                f"{field}.step",
                f"spot checks run at multiples of sdc.spot_every_steps ({every}) below train.steps "
                f"({steps}), so a compute fault at step {flip.step} never fires; "
                + (
                    f"choose one of {choices[:5]}{' ...' if len(choices) > 5 else ''}"
                    if choices
                    else "lower sdc.spot_every_steps below train.steps"
                ),
            )
        ]
    return []


def _walk(loc: tuple) -> tuple[str, Any]:
    """The field a pydantic error location names, as a user writes it
    (`chaos.bitflip[0].rank`: list items by index in brackets), and the annotation there
    (None where the location leaves the models)."""
    name, annotation = "", JobSpec
    for part in loc:
        if isinstance(part, int):
            bracket = get_origin(annotation) is list
            name += f"[{part}]" if bracket else f".{part}"
            continue
        field = getattr(_model_in(annotation), "model_fields", {}).get(part)
        annotation = field.annotation if field is not None else None
        name += f".{part}" if name else str(part)
    return name, annotation


def _model_in(annotation: Any) -> Any:
    """The model inside `X | None` or `list[X]`, else the annotation itself."""
    models = [a for a in get_args(annotation) if isinstance(a, type) and issubclass(a, BaseModel)]
    return models[0] if models else annotation


# Keys never suggested for a mistyped one: the fault-injection hook is for tests, and a
# user who misspelled another key should not be pointed at it.
UNLISTED_KEYS = {"chaos"}


def _known_keys(loc: tuple) -> list[str]:
    """The valid keys of the model at `loc` (for 'unknown key' messages)."""
    _, annotation = _walk(loc[:-1])
    fields = getattr(_model_in(annotation), "model_fields", {})
    return sorted({f.alias or name for name, f in fields.items()} - UNLISTED_KEYS)


# Type errors of the strict model, said with the fix.
STRICT_TYPES = {
    "int_type": (
        "must be a whole number written without quotes (not true/false, not a string, not 2.0)"
    ),
    "float_type": "must be a number written without quotes (not true/false, not a string)",
    "finite_number": "must be a finite number (not Infinity or NaN)",
    "string_type": "must be a string",
    "bool_type": "must be true or false",
    "tuple_type": "must be a list of two numbers, like [0.9, 0.95]",
    "model_type": "must be a mapping of keys to values",
}


def _shown(value: Any) -> str:
    """The offending input for a message: JSON spelling (true, "5", Infinity), bounded."""
    text = json.dumps(value) if isinstance(value, (bool, int, float, str)) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


def _problem_from_pydantic(err: dict) -> Problem:
    loc = tuple(err["loc"])
    field = _walk(loc)[0] or "(spec)"
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        keys = _known_keys(loc)
        msg = "unknown key; remove it or fix the spelling" + (
            f" (valid: {', '.join(keys)})" if keys else ""
        )
    elif kind == "missing":
        msg = "required; add it"
    elif kind == "literal_error":
        msg = f"{msg} (got {err.get('input')!r})"
    elif kind.startswith(("greater", "less")):
        msg = f"{msg} (got {err.get('input')!r})"
    elif kind in STRICT_TYPES:
        msg = f"{STRICT_TYPES[kind]} (got {_shown(err.get('input'))})"
    elif msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    return Problem(field, msg)


def parse_spec(data: Any) -> JobSpec:
    if not isinstance(data, dict):
        raise SpecError([Problem("(spec)", "must be a mapping with keys name, model, train, ...")])
    try:
        spec = JobSpec.model_validate(data)
    except ValidationError as e:
        raise SpecError([_problem_from_pydantic(err) for err in e.errors()]) from None
    problems = consistency_problems(spec)
    if problems:
        raise SpecError(problems)
    return spec


def load_spec(path: str | Path) -> JobSpec:
    """The spec file at `path`, with `model.hf`'s architecture read from its config.json
    (services/hf_config.py) and `train.epochs` counted in steps (services/epochs.py)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise SpecError([Problem("(file)", f"cannot read {path}: {e.strerror}")]) from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (yaml.YAMLError, json.JSONDecodeError) as e:
        raise SpecError([Problem("(file)", f"{path} is not valid YAML/JSON: {e}")]) from None
    return parse_spec(with_epochs(with_hf_architecture(data)))


def check_world_size(spec: JobSpec, world_size: int) -> None:
    if world_size != spec.parallel.world_size:
        p = spec.parallel
        raise SpecError(
            [
                Problem(
                    "parallel",
                    f"the launch has {world_size} ranks but dp*pp*tp = "
                    f"{p.dp}*{p.pp}*{p.tp} = {p.world_size}; launch "
                    f"{p.world_size} ranks or change the degrees",
                )
            ]
        )
