"""The pure parts of silent-data-corruption checking (worker/trainer/sdc.py,
worker/trainer/anomaly.py): which replicas disagree, whom a replay blames, what a robust
z-score flags."""

from __future__ import annotations

import math
import random

import pytest
import torch

from worker.trainer.anomaly import AnomalyWatch
from worker.trainer.chaos import flip_bit
from worker.trainer.sdc import blame, disagreement, drifted, fingerprint

NAMES = ["a", "b", "c"]


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.randn(1000),  # read as 8-byte words
        lambda: torch.randn(999),  # an odd size: as 4-byte words
        lambda: torch.randn(1001)[1:],  # 8-byte size at an offset of 4 bytes: 4-byte words
        lambda: torch.randn(1000).bfloat16(),
    ],
    ids=["fp32-even", "fp32-odd", "fp32-offset", "bf16"],
)
def test_one_flipped_bit_always_changes_the_fingerprint(make):
    t = make()
    before = fingerprint([("t", t)])
    word = torch.int32 if t.element_size() == 4 else torch.int16
    for bit in (0, 7, 13) if word == torch.int16 else (0, 22, 30, 31):
        u = t.clone()
        flip_bit(u, bit)
        assert int((u.view(word) != t.view(word)).sum()) == 1
        assert fingerprint([("t", u)]) != before, bit


def test_replicas_that_agree_have_no_disagreement():
    rows = torch.tensor([[1, 2, 3], [1, 2, 3]])
    assert disagreement(rows, [0, 1], NAMES) is None


def test_two_replicas_name_the_first_tensor_and_outvote_nobody():
    rows = torch.tensor([[1, 2, 3], [1, 5, 6]])
    d = disagreement(rows, [4, 6], NAMES)
    assert (d.tensor, d.ranks, d.outvoted) == ("b", [4, 6], [])


def test_three_replicas_outvote_the_odd_one():
    rows = torch.tensor([[1, 2, 3], [1, 9, 3], [1, 2, 3]])
    d = disagreement(rows, [0, 2, 4], NAMES)
    assert (d.tensor, d.outvoted) == ("b", [2])


def _report(rank, diverged_at=None, changed=True):
    return {"rank": rank, "diverged_at": diverged_at, "changed": changed}


def test_replay_blames_the_rank_that_left_the_clean_trajectory_first():
    # rank 1 corrupted at step 6; the reduction carried it to every other rank at step 7
    reports = [_report(0, 7), _report(1, 6), _report(2, 7), _report(3, 7)]
    assert blame(reports, disagreeing=[1, 3]) == [1]


def test_without_a_parameter_divergence_the_changed_rank_is_blamed():
    # an optimizer-state flip found before the next update moved any parameter
    reports = [_report(0, None, changed=False), _report(1, None, changed=True)]
    assert blame(reports, disagreeing=[0, 1]) == [1]


def test_a_replay_that_reproduces_no_history_blames_nobody():
    # non-deterministic kernels (a GPU's attention backward): every rank's replay leaves its
    # own history at the first replayed step, corrupted or not
    reports = [_report(0, 6), _report(1, 6), _report(2, 6), _report(3, 6)]
    assert blame(reports, disagreeing=[1, 3]) == []


def test_a_fault_that_repeats_on_replay_blames_nobody():
    reports = [_report(0, None, changed=False), _report(1, None, changed=False)]
    assert blame(reports, disagreeing=[0, 1]) == []


def _drifts(**by_rank):
    return [{"rank": int(r[1:]), "drift": d} for r, d in by_rank.items()]


NOISE = [3e-7, 4e-7, 5e-7]  # a re-execution's distance from history, step by step


def test_a_nondeterministic_replay_blames_the_replica_that_moved_away_where_they_part():
    # equal until the third replayed step, where rank 1's state lies far from the replay
    reports = _drifts(r0=NOISE, r1=NOISE[:2] + [4e-5])
    blamed, said = drifted(reports, [(0, 1)])
    assert blamed == [1]
    assert said == "3 step(s) into the replay rank(s) [1] lay 4e-05 from it, their replicas 5e-07"


def test_where_replicas_part_by_no_more_than_noise_nobody_is_blamed():
    reports = _drifts(r0=NOISE, r1=NOISE[:2] + [2e-6])  # 4x: a re-execution's own spread
    assert drifted(reports, [(0, 1)]) == ([], "")


def test_only_the_step_where_replicas_part_decides():
    # rank 0 parts first, by noise only; rank 1's later jump is the corruption's spread
    reports = _drifts(r0=[3e-7, 5e-7, 9e-5], r1=[3e-7, 4e-7, 1e-4])
    assert drifted(reports, [(0, 1)]) == ([], "")


def test_replicas_that_never_part_blame_nobody_by_distance():
    # the replay reproduced every history (a fault that repeats), or a step's sums were lost
    assert drifted(_drifts(r0=[0.0, 0.0], r1=[0.0, 0.0]), [(0, 1)]) == ([], "")
    assert drifted(_drifts(r0=[math.nan, 1.0], r1=[math.nan, 9.0]), [(0, 1)]) == ([], "")


def test_each_disagreeing_group_is_judged_among_its_own_replicas():
    # dp2 x tp2: replicas (0, 2) and (1, 3); only rank 2's group holds the corruption
    reports = _drifts(r0=NOISE, r1=[1e-3] * 3, r2=[3e-7, 6e-5, 7e-5], r3=[1e-3] * 3)
    assert drifted(reports, [(0, 2), (1, 3)])[0] == [2]


def test_a_loss_spike_is_an_anomaly_and_ordinary_noise_is_not():
    rng = random.Random(0)
    watch = AnomalyWatch(window=50, z=8.0)
    lines = [watch.observe(s, 3.0 - s * 0.001 + rng.gauss(0, 0.01), 1.0) for s in range(200)]
    assert not any(lines)
    [line] = watch.observe(200, 9.0, 1.0)
    assert (line["signal"], line["step"]) == ("loss", 200) and line["z"] > 8.0


def test_a_constant_signal_has_no_scale_and_flags_nothing():
    watch = AnomalyWatch(window=8, z=3.0)
    for s in range(8):
        watch.observe(s, 1.0, 1.0)
    assert watch.observe(8, 1.5, 1.0) == []
