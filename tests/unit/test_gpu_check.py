"""`make gpu-check DRY=1` on a CPU machine (scripts/gpu_check.py): the wheel set is checked
against what the GPU image lacks, every `gpu` test skips itself, and the summary is written
with no device. A missing or stale wheel fails it, naming the distribution."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def missing() -> list[str]:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--list-missing"], capture_output=True, text=True, check=True
    )
    return out.stdout.split()


def dry_run(wheels: Path, out: Path) -> tuple[int, dict]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry", "--wheels", str(wheels), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return proc.returncode, json.loads((out / "summary.json").read_text())


def test_the_image_lacks_what_the_worker_imports_and_nothing_it_holds():
    names = {line.split("==")[0] for line in missing()}
    assert {"pydantic", "redis", "tenacity", "orjson"} <= names, names
    image = (ROOT / "scripts" / "gpu" / "image-packages.txt").read_text().split()
    assert not names & {"torch", "numpy", "psutil", "pytest"} and not names & set(image)


def test_a_complete_wheel_set_passes_and_a_missing_wheel_is_named(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for line in missing():  # the names pip gives wheels: name_version-tags.whl
        name, version = line.split("==")
        (wheels / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").touch()
    rc, summary = dry_run(wheels, tmp_path / "complete")
    assert (rc, summary["wheels_missing"], summary["device"]) == (0, [], None), summary
    assert summary["tests"]["skipped"] >= 10 and summary["tests"]["passed"] == 0, summary
    (redis_wheel,) = wheels.glob("redis-*.whl")
    redis_wheel.unlink()
    rc, summary = dry_run(wheels, tmp_path / "incomplete")
    assert rc == 1 and [m.split("==")[0] for m in summary["wheels_missing"]] == ["redis"], summary
