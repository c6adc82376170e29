"""The mesh page ships in the installed package, not only in a source checkout: the images
`pip install .` (not editable), which leaves non-Python files out unless declared."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile

from controller.web import STATIC
from tests.observability.queries import ROOT


def test_the_wheel_carries_the_mesh_page(tmp_path):
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ behind
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for pkg in ("services", "controller", "worker"):
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "dist"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    [wheel] = (tmp_path / "dist").glob("*.whl")
    shipped = set(zipfile.ZipFile(wheel).namelist())
    # every file of the page, the vendored uPlot (and its license) included
    wanted = {
        f"controller/web/{p.relative_to(STATIC.parent)}" for p in STATIC.rglob("*") if p.is_file()
    }
    assert wanted <= shipped, f"missing from the wheel: {sorted(wanted - shipped)}"
