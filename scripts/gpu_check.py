"""`make gpu-check`: every `gpu` test on the GPU machine at hand, and one JSON summary.

The GPU machines' image has Python 3.12 and its own torch, and no network. What the project
needs beyond that image (scripts/gpu/image-packages.txt) travels as wheels, prepared on a CPU
machine by scripts/gpu-wheels.sh into gpu-wheels/. This script
1. installs those wheels offline into a private directory (nothing of the image changes);
2. checks that the project's requirements (pyproject.toml: the base, `worker`, and the test
   runner's) are all there and of a version they accept, and says what is missing;
3. runs tests/gpu (the `gpu` tests) with pytest, each figure a test measures appended to
   gpu-check/measures.jsonl (tests/gpu/conftest.py);
4. writes gpu-check/summary.json: the device, torch, the requirement check, every test's
   outcome, and the measured figures.

`--dry` (`make gpu-check DRY=1`) is for a CPU machine: no wheels are installed, the wheel set
is checked against what the project's own environment resolved (every distribution the
image lacks has its wheel, at the version that environment runs), the tests skip themselves
for want of a device, and the summary says `"device": null`.

`--list-missing` prints, as `name==version`, the distributions the image lacks (what
scripts/gpu-wheels.sh downloads).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
import tomllib
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "scripts" / "gpu" / "image-packages.txt"
TEST_RUNNER = ["pytest>=8", "pytest-timeout>=2.3"]
SITE = Path("/tmp/meshkeeper-gpu-site")
TEST_TIMEOUT_S = 420  # one test; the whole check is meant to end within 8 minutes


def requirements() -> list[Requirement]:
    """What the GPU tests import: the base dependencies, the worker's, the test runner."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = [*project["dependencies"], *project["optional-dependencies"]["worker"], *TEST_RUNNER]
    return [Requirement(r) for r in listed]


def closure(roots: list[Requirement]) -> dict[str, Requirement]:
    """Every distribution the roots need, transitively, as the running environment's
    metadata says (canonical name -> the first requirement that named it)."""
    found: dict[str, Requirement] = {}
    todo = [(r, "") for r in roots]
    while todo:
        req, extra = todo.pop()
        if req.marker and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        if name in found and not req.extras:
            continue
        found.setdefault(name, req)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue  # reported by `unmet`
        for sub in dist.requires or []:
            sub_req = Requirement(sub)
            for e in ["", *req.extras]:
                if not sub_req.marker or sub_req.marker.evaluate({"extra": e}):
                    todo.append((sub_req, e))
                    break
    return found


def image_packages() -> set[str]:
    lines = IMAGE.read_text().splitlines()
    return {canonicalize_name(n) for n in lines if n.strip() and not n.startswith("#")}


def missing_from_image() -> dict[str, str]:
    """name -> the version this environment runs, for each needed distribution the image
    lacks."""
    image = image_packages()
    return {
        name: metadata.version(name)
        for name in sorted(closure(requirements()))
        if name not in image
    }


def wheel_gaps(wheels: Path) -> list[str]:
    """Each distribution the image lacks that has no wheel of the right version here."""
    have = {}
    for w in wheels.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(w.name)
        have[canonicalize_name(name)] = str(version)
    return [
        f"{name}=={version} (have {have.get(name, 'none')})"
        for name, version in missing_from_image().items()
        if have.get(name) != version
    ]


def unmet() -> list[str]:
    """Each needed distribution absent, or of a version its requirement rejects. torch is the
    image's own: its pin is reported, not enforced."""
    problems = []
    for name, req in closure(requirements()).items():
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{req}: not installed")
            continue
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            problems.append(f"{req}: found {version}")
    return problems


def install(wheels: Path) -> None:
    """The wheels, offline, into SITE, which then comes first on the path."""
    found = sorted(wheels.glob("*.whl"))
    if found:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
            + ["--no-compile", "--upgrade", "--target", str(SITE), *map(str, found)],
            check=True,
        )
    sys.path.insert(0, str(SITE))
    importlib.invalidate_caches()  # the metadata lookups below must see SITE


def run_tests(out: Path, dry: bool) -> dict:
    junit, measures = out / "junit.xml", out / "measures.jsonl"
    measures.unlink(missing_ok=True)
    path = [str(ROOT)] + ([] if dry else [str(SITE)])
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
        "MESHKEEPER_GPU_MEASURES": str(measures),
    }
    argv = [sys.executable, "-m", "pytest", "tests/gpu", "-m", "gpu", "-p", "no:cacheprovider"]
    argv += ["-o", "addopts=", f"--timeout={TEST_TIMEOUT_S}", "-rA", f"--junitxml={junit}"]
    rc = subprocess.run(argv, cwd=ROOT, env=env).returncode
    results = {}
    if junit.exists():
        for case in ET.parse(junit).getroot().iter("testcase"):
            outcome = next(
                (c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed"
            )
            results[f"{case.get('classname')}::{case.get('name')}"] = outcome
    figures: dict[str, object] = {}
    if measures.exists():
        for line in measures.read_text().splitlines():
            figures.update({k: v for k, v in json.loads(line).items() if k != "test"})
    counts = {k: sum(v == k for v in results.values()) for k in ("passed", "failure", "error")}
    counts["skipped"] = sum(v == "skipped" for v in results.values())
    return {"pytest_exit": rc, **counts, "results": results, "measures": figures}


def device() -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "device": None}
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["device_count"] = torch.cuda.device_count()
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dry", action="store_true", help="a CPU machine: no device parts")
    ap.add_argument("--list-missing", action="store_true", help="print name==version lines")
    ap.add_argument("--wheels", type=Path, default=ROOT / "gpu-wheels")
    ap.add_argument("--out", type=Path, default=ROOT / "gpu-check")
    args = ap.parse_args()
    if args.list_missing:
        print("\n".join(f"{n}=={v}" for n, v in missing_from_image().items()))
        return 0
    t0 = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, object] = {"dry": args.dry, "python": sys.version.split()[0]}
    if args.dry:
        summary["wheels_missing"] = wheel_gaps(args.wheels)
    else:
        install(args.wheels)
    summary["requirements_unmet"] = unmet()
    summary.update(device())
    if args.dry:
        summary["device"] = None
    print(f"gpu-check: {summary['device'] or 'no device'}, torch {summary['torch']}", flush=True)
    summary["tests"] = run_tests(args.out, args.dry)
    summary["wall_s"] = round(time.monotonic() - t0, 1)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "tests"}, indent=2))
    t = summary["tests"]
    print(
        f"gpu-check: {t['passed']} passed, {t['failure'] + t['error']} failed, "
        f"{t['skipped']} skipped; measures {json.dumps(t['measures'])}"
    )
    print(f"gpu-check: summary in {args.out / 'summary.json'}")
    blocked = [k for k in ("wheels_missing",) if summary.get(k)]
    hard_unmet = [u for u in summary["requirements_unmet"] if not u.startswith("torch")]
    return 1 if blocked or hard_unmet or t["failure"] or t["error"] else 0


if __name__ == "__main__":
    sys.exit(main())
