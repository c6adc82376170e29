#!/usr/bin/env bash
# On a CPU machine with network: the wheels `make gpu-check` installs offline on a GPU
# machine, whose image (Python 3.12, its own torch) lacks them. One wheel per distribution the
# image lacks (scripts/gpu/image-packages.txt), at the version this project's environment runs
# (scripts/gpu_check.py --list-missing), for CPython 3.12 on x86-64 Linux. Into gpu-wheels/,
# replacing what was there; `make gpu-check DRY=1` then checks the set is complete.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
out=gpu-wheels
mapfile -t wanted < <("$python" scripts/gpu_check.py --list-missing)
if [ ${#wanted[@]} -eq 0 ]; then
    echo "gpu-wheels: the image holds everything the GPU check needs"
    exit 0
fi
rm -rf "$out"
echo "gpu-wheels: ${wanted[*]}"
"$python" -m pip download -q --no-deps --only-binary=:all: --dest "$out" \
    --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any \
    "${wanted[@]}"
du -sh "$out"
