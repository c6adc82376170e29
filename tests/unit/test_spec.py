import copy
import subprocess
import sys

import pytest
import yaml

from services.spec import SpecError, load_spec, parse_spec
from tests.launch import ROOT

GOOD = {
    "name": "tiny-gpt",
    "model": {"preset": "tiny"},
    "parallel": {"dp": 2, "pp": 2, "tp": 2, "microbatches": 2},
    "train": {"steps": 10, "global_batch": 8},
}


def with_(path: str, value):
    spec = copy.deepcopy(GOOD)
    *parents, leaf = path.split(".")
    node = spec
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return spec


# (spec, field named in the error, words of the fix)
BAD = [
    (with_("parallel.tp", 3), "parallel.tp", "choose tp in {1, 2, 4}"),
    (with_("model.layers", 3), "model.layers", "divisible by pp*virtual_stages"),
    (with_("train.global_batch", 6), "train.global_batch", "divisible by dp*microbatches"),
    (with_("parallel.dp", 0), "parallel.dp", "greater than or equal to 1"),
    (with_("train.steps", -5), "train.steps", "greater than 0"),
    (with_("train.lr", 0), "train.lr", "greater than 0"),
    (with_("model.d_model", 10**7), "model.d_model", "less than or equal to 65536"),
    (with_("train.global_batch", 10**9), "train.global_batch", "less than or equal to"),
    (with_("parallel.zeroo", 3), "parallel.zeroo", "unknown key"),
    (with_("bogus", 1), "bogus", "valid: checkpoint, data, eval, fault_tolerance"),
    (with_("parallel.zero", 1), "parallel.zero", "Input should be 0, 2 or 3"),
    (
        with_("parallel.pp_schedule", "zb"),
        "parallel.pp_schedule",
        "'gpipe', '1f1b' or 'interleaved_1f1b'",
    ),
    (with_("parallel.virtual_stages", 2), "parallel.virtual_stages", "interleaved_1f1b"),
    (with_("parallel.microbatches", 1), "parallel.microbatches", "raise microbatches"),
    (with_("name", "../etc"), "name", "lowercase letters"),
    (
        with_("data.source", "s3://bucket"),
        "data.source",
        "'synthetic', 'text:PATH', 'tokens:PATH' or 'dataset:DIR'",
    ),
    (with_("model.heads", 3), "model.heads", "d_model (64) must be divisible by heads (3)"),
    (with_("model.vocab", 255), "parallel.loss_parallel", "pad model.vocab to a multiple of tp"),
    (with_("model.seq_len", 33), "parallel.sequence_parallel", "seq_len a multiple of tp"),
    (with_("fault_tolerance.min_dp", 4), "fault_tolerance.min_dp", "cannot exceed parallel.dp"),
    (with_("fault_tolerance.dead_after_s", 0.6), "fault_tolerance.dead_after_s", "2x heartbeat_s"),
    ({k: v for k, v in GOOD.items() if k != "train"}, "train", "required"),
    # strict types: no coercion of booleans or strings into numbers, finite floats only
    (
        with_("model.rope_theta", float("inf")),
        "model.rope_theta",
        "finite number (not Infinity or NaN)",
    ),
    (with_("train.lr", float("nan")), "train.lr", "finite number"),
    (with_("train.steps", True), "train.steps", "not a string, not 2.0) (got true)"),
    (
        with_("train.steps", "5"),
        "train.steps",
        'without quotes (not true/false, not a string, not 2.0) (got "5")',
    ),
    (with_("train.steps", 5.0), "train.steps", "(got 5.0)"),
    (with_("parallel.dp", False), "parallel.dp", "(got false)"),
    (with_("train.lr", "3e-4"), "train.lr", "number written without quotes"),
    (with_("train.betas", [True, 0.95]), "train.betas.0", "(got true)"),
    (
        with_("parallel.activation_checkpointing", "yes"),
        "parallel.activation_checkpointing",
        "False, True or 'selective'",
    ),
    (with_("model", "tiny"), "model", "mapping of keys to values"),
    # upper bounds on every count, and on the model as a whole
    (with_("train.warmup_steps", 10**10), "train.warmup_steps", "less than or equal to"),
    (with_("model.rope_theta", 1e300), "model.rope_theta", "less than or equal to"),
    (with_("checkpoint.every_steps", 10**12), "checkpoint.every_steps", "less than or equal to"),
    # the snapshot ring needs one complete slot while the next is written
    (with_("snapshot.keep", 1), "snapshot.keep", "greater than or equal to 2 (got 1)"),
    (with_("snapshot.keep", 17), "snapshot.keep", "less than or equal to 16"),
    (with_("snapshot.every_steps", 0), "snapshot.every_steps", "greater than 0"),
    (with_("snapshot.buddy", "yes"), "snapshot.buddy", "true or false"),
    (with_("snapshot.full_every", 0), "snapshot.full_every", "greater than or equal to 1"),
    (
        {
            **GOOD,
            "model": {"preset": "tiny", "tie_embeddings": True},
            "parallel": {"tp": 2, "loss_parallel": False},
        },
        "parallel.loss_parallel",
        "needs loss_parallel: true",
    ),
    (
        with_("snapshot.ring", 2),
        "snapshot.ring",
        "valid: buddy, enabled, every_steps, full_every, keep",
    ),
    (
        {
            **GOOD,
            "model": {"layers": 1024, "d_model": 65536, "heads": 64, "vocab": 1000, "seq_len": 16},
        },
        "model",
        "parameters exceed the limit",
    ),
]


def test_good_spec_parses():
    s = parse_spec(GOOD)
    assert (s.parallel.world_size, s.model.layers, s.model.d_model) == (8, 4, 64)


@pytest.mark.parametrize("spec,field,fix", BAD, ids=[f"{b[1]}-{i}" for i, b in enumerate(BAD)])
def test_bad_spec_names_field_and_fix(spec, field, fix):
    with pytest.raises(SpecError) as info:
        parse_spec(spec)
    matching = [p for p in info.value.problems if p.field == field]
    assert matching, f"no problem names {field}: {info.value}"
    assert any(fix in p.message for p in matching), f"{field}: {[p.message for p in matching]}"


def test_a_tied_head_runs_under_tp_and_a_pipeline():
    assert parse_spec(with_("model.tie_embeddings", True)).model.tie_embeddings  # dp2 pp2 tp2


def test_every_example_and_preset_stays_valid_and_round_trips():
    """Strictness must not refuse what the project ships, nor the stored (JSON) form of a
    spec that the agent hands to trainers (betas come back as a list)."""
    import json

    from services.spec import PRESETS

    specs = [load_spec(f) for f in sorted((ROOT / "examples").glob("*.yaml"))]
    specs += [
        parse_spec({**GOOD, "model": {"preset": name}, "parallel": {"dp": 1}}) for name in PRESETS
    ]
    assert len(specs) > len(PRESETS)
    for s in specs:
        assert parse_spec(json.loads(json.dumps(s.model_dump(mode="json")))) == s


def test_snapshots_default_to_every_step_in_two_slots_with_a_buddy_copy():
    snap = parse_spec(GOOD).snapshot
    assert (snap.enabled, snap.every_steps, snap.keep, snap.buddy) == (True, 1, 2, True)


def test_int_where_a_float_is_wanted_is_fine():
    assert parse_spec(with_("model.rope_theta", 500000)).model.rope_theta == 500000.0


def test_preset_fields_can_be_overridden():
    assert parse_spec(with_("model.seq_len", 64)).model.seq_len == 64


def test_unreadable_and_malformed_files(tmp_path):
    with pytest.raises(SpecError, match="cannot read"):
        load_spec(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)


def test_trainer_reports_bad_spec_without_traceback(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(with_("parallel.tp", 3)))
    proc = subprocess.run(
        [sys.executable, "-m", "worker.trainer", "--spec", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "parallel.tp" in proc.stderr and "Traceback" not in proc.stderr


def test_trainer_refuses_wrong_world_size(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(GOOD))  # wants 8 ranks; launched as 1
    proc = subprocess.run(
        [sys.executable, "-m", "worker.trainer", "--spec", str(path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert (
        "launch has 1 ranks but dp*pp*tp = 2*2*2 = 8" in proc.stderr
        and "Traceback" not in proc.stderr
    )
