# Two entry points, both self-contained on a fresh machine with Python 3.11:
#   make demo   -> a small private, sharded training run on the embedded corpus
#   make test   -> the whole test suite (unit, integration, multi-process, property)
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# torch first, pinned: an unpinned torch on a machine without one pulls a multi-GB CUDA build.
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install "torch==2.13.0"
	$(BIN)/pip install -e ".[dev]"
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fsdpx train --strategy zero3 --nproc 2

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
