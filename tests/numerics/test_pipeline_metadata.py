"""Pipeline stages built with their boundaries' metadata (worker/trainer/pipeline.py,
`stage_io`) against torch's own: at each layout, a trainer whose stages infer their metadata
(torch's dynamic mode, `stage_io` withheld) and one built with it train the same batches for
three steps on real gloo ranks. The metadata `stage_io` gives is what torch inferred, field for
field (shape, stride, dtype, requires_grad, and the gradients' derived from them); the built
stages never run torch's inference; and both trainers' losses and parameters agree bit for bit
at every step, the second and third too (a float input that did not require grad would leave
step 1 alike and change step 2).

The rank side is this module's `__main__`, under tests/rankrun.py.
"""

from __future__ import annotations

import json

import pytest

from tests.launch import rank_scenarios

STEPS = 3
LAYOUTS = {
    "pp2": ({"pp": 2, "microbatches": 2}, {}),
    "pp2-bf16": ({"pp": 2, "microbatches": 2, "precision": "bf16"}, {}),
    "dp2-pp2-zero0": ({"dp": 2, "pp": 2, "zero": 0, "microbatches": 2}, {}),
    "pp2-tp2-sp": ({"pp": 2, "tp": 2, "microbatches": 2}, {}),
    "pp2-tp2-plain": (
        {"pp": 2, "tp": 2, "microbatches": 2, "sequence_parallel": False, "loss_parallel": False},
        {},
    ),
    "pp2-v2": (
        {"pp": 2, "microbatches": 2, "virtual_stages": 2, "pp_schedule": "interleaved_1f1b"},
        {},
    ),
    "pp2-moe-tied": (
        {"pp": 2, "microbatches": 2},
        {"experts": 4, "top_k": 2, "tie_embeddings": True},
    ),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_static_stage_metadata_is_what_torch_infers_and_trains_the_same_bits(layout):
    parallel, model = LAYOUTS[layout]
    world = parallel.get("dp", 1) * parallel["pp"] * parallel.get("tp", 1)
    rows = rank_scenarios(world, "tests.numerics.test_pipeline_metadata", [layout], [layout])[
        layout
    ]
    for r in rows:
        assert r["inferred"] == r["given"], r
        assert r["inference_runs"]["given"] == 0 < r["inference_runs"]["inferred"], r
        assert r["same_bits"], r


# -- the rank side -----------------------------------------------------------------------
def _stage_metas(trainer) -> list[dict]:
    """Each stage's metadata as torch holds it. The last stage's output gradients are left out:
    its loss gives them, and torch derives a description only from static metadata."""
    stages = getattr(trainer.schedule, "_stages", None) or [trainer.schedule._stage]
    return [
        {
            "stage": s.stage_index,
            **{
                k: [repr(t) for t in getattr(s._stage_meta, k) or ()]
                for k in ("inputs", "outputs", "input_grads", "output_grads")
                if not (k == "output_grads" and s.is_last)
            },
        }
        for s in stages
    ]


def _run(layout: str, rank: int, device) -> dict:
    import torch
    from torch.distributed.pipelining.stage import PipelineStage

    from services.spec import parse_spec
    from worker.trainer import pipeline
    from worker.trainer.parallel import ParallelDims, RankContext
    from worker.trainer.sdc import state_tensors
    from worker.trainer.step import Trainer

    parallel, model = LAYOUTS[layout]
    spec = parse_spec(
        {
            "name": "stage-meta",
            "model": {"preset": "tiny", **model},
            "data": {"source": "synthetic", "seed": 7},
            "parallel": parallel,
            "train": {"steps": STEPS, "global_batch": 8, "lr": 3e-3, "warmup_steps": 1},
        }
    )
    dims = ParallelDims(spec.parallel, device.type)
    mesh = dims.build_mesh()
    runs = {"n": 0}
    infer = PipelineStage._forward_metadata_inference

    def counted(self, *args, **kwargs):
        runs["n"] += 1
        return infer(self, *args, **kwargs)

    PipelineStage._forward_metadata_inference = counted
    given = Trainer(spec, RankContext(dims, mesh, rank, device))
    static = pipeline.stage_io
    pipeline.stage_io = lambda spec, stage, n: (None, None)  # torch infers
    inferred = Trainer(spec, RankContext(dims, mesh, rank, device))
    pipeline.stage_io = static
    losses, counts = {"given": [], "inferred": []}, {}
    for name, t in (("given", given), ("inferred", inferred)):
        runs["n"] = 0
        for index in range(STEPS):
            losses[name].append(t.train_step(index).loss)
        counts[name] = runs["n"]
    pairs = zip(
        state_tensors(given.parts, given.optimizers),
        state_tensors(inferred.parts, inferred.optimizers),
        strict=True,
    )
    return {
        "scenario": layout,
        "rank": rank,
        "given": _stage_metas(given),
        "inferred": _stage_metas(inferred),
        "inference_runs": counts,
        "same_bits": losses["given"] == losses["inferred"]
        and all(torch.equal(a, b) for (_, a), (_, b) in pairs),
        "losses": losses,
    }


def _main() -> None:
    import sys

    import torch

    from worker.trainer.distributed import init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    rank, _, device = init_distributed(timeout_s=60)
    try:
        print(json.dumps(_run(sys.argv[1], rank, device)), flush=True)
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    _main()
