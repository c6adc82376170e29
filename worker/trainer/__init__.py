"""The trainer: one process per rank, run by torchrun or handed a rank by the agent.

    __main__.py / main.py   the entry (`python -m worker.trainer`): arguments, the loop, exit codes
    distributed.py          process group set-up and teardown
    metrics_file.py         the per-step StepRecord lines and milestones the agent reads
    run_record.py           rank 0's TensorBoard record of the job (--run-record)
    step.py                 Trainer: one rank's model, optimizer and train step for any layout
    model.py, data.py       the transformer; data as a pure function of (seed, sample index)
    optim.py                AdamW, LR schedule, mesh-wide gradient clipping
    parallel.py, pipeline.py  the (dp, pp, tp) mesh: FSDP, TP, activation checkpointing, stages
    timing.py               a rank's own compute time, collective waits excluded
    checkpoint.py           sharded DCP checkpoints: save, commit, restore
    train_state.py          what a checkpoint must match to resume (data seed, consumed samples)

Kept torch-free on import (nothing here imports a submodule): the agent reads
worker.ckpt_store and worker.progress, which sit beside this package, not inside it.
"""
