"""What per-step in-memory snapshots cost in steady state (docs/architecture.md, "Hot recovery").

The same dp=2 job trained under torchrun twice per round, without snapshots and with a snapshot
after every step (own ring in /dev/shm plus the buddy rank's copy: both ranks on one host, so
a hard link to the ward's file), and with `--apart` a third time with each rank in memory of
its own, as on two hosts, so the buddy's copy goes through the network stack (loopback, on
these 2 cores), rounds alternating so drift on a shared host hits both arms alike. Step time
is the median over every rank's steps after the first few (warm-up), from one step's end to
the next: it counts what the training thread does between steps (capturing the state for a
snapshot) too.

Separate runs on a shared host drift apart by more than a few percent (on 2 cores, the same
code gave 0.94x to 1.10x on different days), so each round also makes one paired
measurement that drift cannot reach: a run with a snapshot after every second step, where
each step that follows a snapshot is compared with the plain step right after it, on the
same rank. The median of those ratios is a snapshot's cost per step (a snapshot's copy and
exchange end well within one step, so taking one every step costs each step the same); the
interval around it is a bootstrap of the median over the pairs. The same ratio over the run
without snapshots is the control: what the method reads when there is nothing to find.

A snapshot every second step is always whole: logged steps (`snapshot.full_every`,
worker/snapshots.py) need one after every step. So the steady state with logged steps is
measured inside the ranks (this script, `--ranks`, under torchrun): the real trainer and
snapshotter, with snapshots after every step in one block of `--block` steps of each pair of
blocks (which one: a coin per pair, tossed anew each round) and none in the other. Each
step that follows a snapshot, in a block with blocks without snapshots on both sides, is
compared with the mean of the steps at the same place in those two, which follow none.
Whole snapshots and logged steps are paired apart, and the cost is their medians weighted
by how often each is taken (one in `full_every` whole, as in a run that never stops taking
them). The same method with `full_every` 1 (every snapshot whole) is the baseline, and a run
with the snapshots never on the control.

    python bench/snapshot_cost.py [--preset small] [--d-model 512 ...] [--steps 40] [--rounds 2]
        [--block-steps 160] [--block 8] [--full-every K] [--blocks-only]

Summary lines (stable): `snapshots / none (<model>): X.XXx (median step time)`,
`snapshot step / next step, same run (<model>): X.XXXx (median of N pairs, 90% A-B; control
C.CCCx)`, `snapshots every step, full_every K / none, same run (<model>): X.XXXx (whole W.WWWx,
logged L.LLLx; N pairs, 90% A-B; control C.CCCx)`, the same for `full_every 1` (whole only),
`snapshots every step, full_every K / none, whole blocks (<model>): X.XXXx (N block pairs, 90%
A-B; control C.CCCx)` (every step of each block against every step of the other block of its
pair, `block_means`) for both, and with
`--apart` `snapshots, buddy on another host / none (<model>): X.XXx (median step time)`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import spec_file, start_apart, torchrun  # noqa: E402
from services.procs import free_port  # noqa: E402
from services.spec import SnapshotSpec  # noqa: E402

WARMUP = 3
PAIRED_EVERY = 2  # the paired run's snapshots: after even steps, so odd steps follow one


def job(model: dict, steps: int) -> dict:
    return {
        "name": "bench-snapshot",
        "model": model,
        "data": {"source": "synthetic", "seed": 7},
        "parallel": {"dp": 2},
        "train": {"steps": steps, "global_batch": 4, "lr": 1e-3, "warmup_steps": 2},
    }


def run(
    spec: dict, snapshots: bool, apart: bool = False, every: int = 1
) -> tuple[list[dict[int, float]], int]:
    """Per rank, each step's time (step number -> seconds) after warm-up, and one rank's
    snapshot size in bytes (0 when `apart`: each rank then runs in memory of its own, which
    this process cannot see); with `snapshots`, one after every `every` steps."""
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        d = Path(d)
        args = ["-m", "worker.trainer", "--spec", str(spec_file(spec, d))]
        args += ["--metrics-out", str(d / "steps-{rank}.jsonl"), "--quiet"]
        if snapshots:
            plan = {"dir": shm, "generation": 1, "every": every, "keep": 2}
            plan["holders"] = {0: 1, 1: 0}
            (d / "plan.json").write_text(json.dumps(plan))
            args += ["--snapshot-plan", str(d / "plan.json")]
        if apart:
            two_hosts(args)
        else:
            torchrun(2, args)
        ranks = []
        for f in sorted(d.glob("steps-*.jsonl")):
            ends = [
                (r["step"], r["time"])
                for r in map(json.loads, f.read_text().splitlines())
                if "step_s" in r and r["step"] > WARMUP
            ]
            ranks.append({s: t - t0 for (_, t0), (s, t) in pairwise(ends)})
        size = sum(p.stat().st_size for p in Path(shm).glob("g1/r0/slot-0.bin"))
        return ranks, size


def pooled(ranks: list[dict[int, float]]) -> list[float]:
    return [t for steps in ranks for t in steps.values()]


def pair_ratios(ranks: list[dict[int, float]]) -> list[float]:
    """Each step that follows a snapshot in the paired run (an odd one: its interval holds the
    capture and the copy), over the step right after it, on the same rank."""
    return [
        steps[s] / steps[s + 1]
        for steps in ranks
        for s in steps
        if s % PAIRED_EVERY == 1 and s + 1 in steps
    ]


def interval(
    ratios: list[float], of: Callable[[list[float]], float] = statistics.median, draws: int = 2000
) -> tuple[float, float]:
    """A 90% bootstrap interval for `of` (the median) of `ratios` (seeded: runs compare)."""
    rng = random.Random(0)
    got = sorted(of(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return got[draws // 20], got[-draws // 20]


def rank_side(spec_path: str, plan_path: str, out: str, blocks: Blocks, on: bool) -> None:
    """One rank of a blocks run (`--ranks`): snapshots after every step in the blocks that
    `blocks` turns on (none at all without `on`); writes {step: end time} and {step: kind}."""
    from services.spec import load_spec
    from worker.snapshots import SnapshotPlan
    from worker.trainer.distributed import init_distributed, shutdown_distributed
    from worker.trainer.memory import return_freed_memory
    from worker.trainer.parallel import ParallelDims, RankContext
    from worker.trainer.snapshot import Snapshotter
    from worker.trainer.step import Trainer

    spec = load_spec(spec_path)
    return_freed_memory()  # as the trainer does (worker/trainer/main.py): the same allocator
    rank, _, device = init_distributed(timeout_s=60)
    try:
        dims = ParallelDims(spec.parallel, device.type)
        trainer = Trainer(spec, RankContext(dims, dims.build_mesh(), rank, device))
        plan = SnapshotPlan.from_json(json.loads(Path(plan_path).read_text()))
        kinds: dict[int, str] = {}
        snaps = Snapshotter(
            plan, rank, device, lambda line: kinds.update({line["step"]: line}), trainer.parts
        )
        ends: dict[int, float] = {}
        parts = (trainer.parts, trainer.optimizers, trainer.schedulers)

        def taken(step: int) -> bool:  # a snapshot after `step`
            return on and blocks.snapshot_after(step)

        def before_update(step: int) -> None:
            if taken(step):  # keeps the step's gradients for a logged step
                snaps.before_update(step, trainer.optimizers)
            else:
                snaps.wait_held()

        for index in range(spec.train.steps):
            step = index + 1
            trainer.train_step(index, before_update=lambda s=step: before_update(s))
            ends[step] = time.perf_counter()
            snaps.poll()
            if taken(step):
                snaps.take(step, *parts, {"step": step})
        snaps.close()
        result = {"ends": ends, "kinds": {s: line.get("kind") for s, line in kinds.items()}}
        Path(out.format(rank=rank)).write_text(json.dumps(result))
    finally:
        shutdown_distributed()


def blocks_run(spec: dict, full_every: int, on: bool, blocks: Blocks) -> list[dict]:
    """Each rank's {"ends": {step: time}, "kinds": {step: kind}} from a blocks run."""
    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        d = Path(d)
        plan = {"dir": shm, "generation": 1, "every": 1, "keep": 2, "full_every": full_every}
        plan["holders"] = {0: 1, 1: 0}
        (d / "plan.json").write_text(json.dumps(plan))
        out = str(d / "blocks-{rank}.json")
        args = [str(spec_file(spec, d)), str(d / "plan.json"), out]
        args += [str(blocks.size), str(blocks.seed), str(int(on))]
        torchrun(2, [str(Path(__file__).resolve()), "--ranks", *args])
        return [
            {k: {int(s): v for s, v in x.items()} for k, x in json.loads(f.read_text()).items()}
            for f in sorted(d.glob("blocks-*.json"))
        ]


@dataclass(frozen=True)
class Blocks:
    """Where a blocks run takes snapshots: blocks of `size` steps go in pairs, and a coin per
    pair says which of the two is on, so nothing that recurs at a fixed place in the run (a
    fixed alternation read 0.98 without any snapshots) lines up with the snapshots. The
    coins are seeded (every rank and this process toss the same), by the round: with one
    seed for all, a run of 160 steps has 10 coins, the same 10 in every round, and whatever
    a run's drift does with that one pattern would lean every round the same way."""

    size: int
    seed: int

    def snapshot_after(self, step: int) -> bool:
        pair = step // (2 * self.size)
        first_on = random.Random(f"{self.seed}:{pair}").random() < 0.5
        return ((step // self.size) % 2 == 0) == first_on

    def around(self, p: int, steps: int) -> tuple[int, int] | None:
        """For a snapshot after step p, the steps at its place in the blocks on both sides,
        when neither block takes snapshots and all are measured (after warm-up, with a step
        after each, in a run of `steps`); else None (`block_pairs`)."""
        if p <= WARMUP or p >= steps or not self.snapshot_after(p):
            return None
        both = (p - self.size, p + self.size)
        if all(WARMUP < q < steps and not self.snapshot_after(q) for q in both):
            return both
        return None


def block_pairs(result: list[dict], blocks: Blocks) -> dict[str, list[float]]:
    """kind -> for each snapshot of that kind (after step p) whose block has blocks without
    snapshots on both sides, the step after it over the mean of the steps at the same place
    in those two, which follow none: a drift over the three blocks cancels. Against the
    other block of its pair alone, two arms of the same code in one invocation read 1.035x
    and 1.060x; against both neighbours, 1.049x and 1.048x. Kind "none" where no snapshot
    was taken at p though the blocks would have one there (the control)."""
    out: dict[str, list[float]] = {}
    for r in result:
        ends, kinds = r["ends"], r["kinds"]
        took = durations(ends)
        for p in ends:
            if around := blocks.around(p, max(ends)):
                base = statistics.fmean(took[q + 1] for q in around)
                out.setdefault(kinds.get(p) or "none", []).append(took[p + 1] / base)
    return out


def block_means(result: list[dict], blocks: Blocks) -> list[float]:
    """For each pair of blocks after warm-up, the mean of the steps that follow the
    snapshots of its block with them over the mean of the steps that follow its block
    without (the ranks' times averaged per step: they run in lockstep, and a pair counts
    once). Every step counts, not only those with blocks without snapshots on both sides,
    and whole snapshots and logged steps in the proportions of a run that never stops
    taking them (a block of 8 with `full_every` 4 takes one whole in 4): about four times
    the steps of `block_pairs` per run."""
    took = [durations(r["ends"]) for r in result]
    last = min(max(r["ends"]) for r in result)
    span = 2 * blocks.size
    pairs: dict[int, dict[bool, list[float]]] = {}
    for p in range(WARMUP + 1, last):
        pair = p // span
        if pair * span > WARMUP and (pair + 1) * span <= last:
            t = statistics.fmean(d[p + 1] for d in took)
            pairs.setdefault(pair, {True: [], False: []})[blocks.snapshot_after(p)].append(t)
    return [statistics.fmean(x[True]) / statistics.fmean(x[False]) for x in pairs.values()]


def durations(ends: dict[int, float]) -> dict[int, float]:
    """Each step's time, from one step's end to the next (what a snapshot's capture adds to
    the training thread counts too)."""
    return {s: ends[s] - ends[s - 1] for s in ends if s - 1 in ends}


def step_times(result: list[dict]) -> list[float]:
    """Every rank's step times after warm-up, from a blocks run."""
    return [t for r in result for s, t in durations(r["ends"]).items() if s - 1 > WARMUP]


def weighted(pairs: dict[str, list[float]], full_every: int) -> float:
    """A snapshot's cost per step when one in `full_every` is whole: the kinds' medians."""
    whole = statistics.median(pairs["whole"])
    if full_every == 1:
        return whole
    return (whole + (full_every - 1) * statistics.median(pairs["grads"])) / full_every


def weighted_interval(
    pairs: dict[str, list[float]], full_every: int, draws: int = 2000
) -> tuple[float, float]:
    """A 90% bootstrap interval of `weighted`, each kind's pairs resampled (seeded)."""
    rng = random.Random(0)
    got = sorted(
        weighted({k: rng.choices(v, k=len(v)) for k, v in pairs.items()}, full_every)
        for _ in range(draws)
    )
    return got[draws // 20], got[-draws // 20]


def two_hosts(args: list[str]) -> None:
    """The two ranks as if on two hosts: each in memory of its own (bench/common.py), so the
    buddy copies cross the network stack (loopback here) instead of being memory copies."""
    procs = start_apart([sys.executable, *args], 2, free_port())
    errors = [p.communicate()[1] for p in procs]
    if any(p.returncode for p in procs):
        sys.exit(f"benchmark run on two hosts failed:\n{errors[0][-1500:]}\n{errors[1][-1500:]}")


def separate_runs(a: argparse.Namespace, model: dict, name: str) -> None:
    """The A/B of separate runs, the paired run (a snapshot every second step) and `--apart`."""
    spec = job(model, a.steps)
    none, snap, apart, size = [], [], [], 0
    pairs, control = [], []
    for i in range(a.rounds):
        ranks = run(spec, False)[0]
        none += pooled(ranks)
        control += pair_ratios(ranks)
        ranks, size = run(spec, True)
        snap += pooled(ranks)
        pairs += pair_ratios(run(spec, True, every=PAIRED_EVERY)[0])
        line = f"  round {i + 1}: none {statistics.median(none) * 1e3:.1f} ms, snapshots "
        line += f"{statistics.median(snap) * 1e3:.1f} ms, paired {statistics.median(pairs):.3f}x"
        if a.apart:
            apart += pooled(run(spec, True, apart=True)[0])
            line += f", buddy on another host {statistics.median(apart) * 1e3:.1f} ms"
        print(line, flush=True)
    m0, m1 = statistics.median(none), statistics.median(snap)
    print(
        f"model {name}, dp=2, {a.steps} steps x {a.rounds} rounds; a rank's snapshot "
        f"{size / 2**20:.1f} MiB (own slot; on one host its buddy links the same file)"
    )
    print(f"  median step: none {m0 * 1e3:.1f} ms, snapshots {m1 * 1e3:.1f} ms")
    print(f"snapshots / none ({name}): {m1 / m0:.2f}x (median step time)")
    lo, hi = interval(pairs)
    print(
        f"snapshot step / next step, same run ({name}): {statistics.median(pairs):.3f}x "
        f"(median of {len(pairs)} pairs, 90% {lo:.3f}-{hi:.3f}; "
        f"control {statistics.median(control):.3f}x)"
    )
    if a.apart:
        m2 = statistics.median(apart)
        print(
            f"snapshots, buddy on another host / none ({name}): {m2 / m0:.2f}x (median step time)"
        )


def blocks(a: argparse.Namespace, model: dict, name: str) -> None:
    """Snapshots every step in blocks, with logged steps (`--full-every`) and all whole."""
    spec, k = job(model, a.block_steps), a.full_every
    rounds = [Blocks(a.block, seed=i) for i in range(a.rounds)]  # each round's coins
    if not any(b.around(p, a.block_steps) for b in rounds for p in range(a.block_steps)):
        sys.exit(
            f"no block of {a.block} steps in {a.block_steps} has blocks without snapshots on "
            f"both sides in {a.rounds} rounds: raise --block-steps (default 160) or --rounds"
        )
    got: dict[int, dict[str, list[float]]] = {k: {}, 1: {}}
    means: dict[int, list[float]] = {k: [], 1: []}  # `block_means`
    off: list[float] = []
    off_means: list[float] = []
    took: dict[str, list[float]] = {}  # each run's step times, for the host's pace
    for i, b in enumerate(rounds):  # the round's coins, the same for its three runs
        for every in got:
            result = blocks_run(spec, every, True, b)
            took.setdefault(f"full_every {every}", []).extend(step_times(result))
            for kind, r in block_pairs(result, b).items():
                got[every].setdefault(kind, []).extend(r)
            means[every] += block_means(result, b)
        result = blocks_run(spec, k, False, b)
        took.setdefault("none", []).extend(step_times(result))
        off += block_pairs(result, b).get("none", [])
        off_means += block_means(result, b)
        if not off or not all(got.values()):
            continue  # no block of this round had both neighbours without snapshots
        print(
            f"  round {i + 1}: full_every {k} {weighted(got[k], k):.3f}x, full_every 1 "
            f"{weighted(got[1], 1):.3f}x, control {statistics.median(off):.3f}x",
            flush=True,
        )
    print(f"model {name}, dp=2, {a.block_steps} steps x {a.rounds} rounds, blocks of {a.block}")
    pace = ", ".join(f"{arm} {statistics.median(t) * 1e3:.1f} ms" for arm, t in took.items())
    print(f"  median step (half the steps of a run follow a snapshot): {pace}")
    for every, pairs in got.items():
        lo, hi = weighted_interval(pairs, every)
        kinds = f"whole {statistics.median(pairs['whole']):.3f}x"
        if "grads" in pairs:
            kinds += f", logged {statistics.median(pairs['grads']):.3f}x"
        print(
            f"snapshots every step, full_every {every} / none, same run ({name}): "
            f"{weighted(pairs, every):.3f}x ({kinds}; {sum(map(len, pairs.values()))} pairs, "
            f"90% {lo:.3f}-{hi:.3f}; control {statistics.median(off):.3f}x)"
        )
    for every, ratios in means.items():
        lo, hi = interval(ratios, statistics.fmean)
        print(
            f"snapshots every step, full_every {every} / none, whole blocks ({name}): "
            f"{statistics.fmean(ratios):.3f}x ({len(ratios)} block pairs, 90% {lo:.3f}-{hi:.3f}; "
            f"control {statistics.fmean(off_means):.3f}x)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--d-model", type=int, help="a custom model of --layers layers instead")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--block-steps", type=int, default=160, help="steps of each blocks run")
    ap.add_argument("--block", type=int, default=8, help="steps per block")
    ap.add_argument(
        "--full-every",
        type=int,
        default=SnapshotSpec().full_every,
        help="snapshot.full_every of the blocks run with logged steps (default: the spec's)",
    )
    ap.add_argument(
        "--blocks-only", action="store_true", help="only the blocks runs (the steady state)"
    )
    ap.add_argument("--ranks", nargs=6, help=argparse.SUPPRESS)  # the rank side of a blocks run
    ap.add_argument(
        "--apart",
        action="store_true",
        help="also run each rank in memory of its own (needs root): the buddy copies then go "
        "through the network stack, as between two hosts",
    )
    a = ap.parse_args()
    if a.ranks:
        spec_path, plan_path, out, size, seed, on = a.ranks
        rank_side(spec_path, plan_path, out, Blocks(int(size), int(seed)), on == "1")
        return
    if a.d_model:
        model = {"layers": a.layers, "d_model": a.d_model, "heads": 8, "vocab": 4096}
        model["seq_len"] = 128
        name = f"{a.layers} layers, d_model {a.d_model}"
    else:
        model, name = {"preset": a.preset}, a.preset
    if not a.blocks_only:
        separate_runs(a, model, name)
    blocks(a, model, name)


if __name__ == "__main__":
    main()
