# Two entry points, both self-contained on a fresh machine with Python 3.11:
#   make demo   -> a small private, sharded training run on the embedded corpus
#   make test   -> the whole test suite (unit, integration, multi-process, property)
# Both install the versions in constraints.txt (what CI tested); `make pins` moves them.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test pins clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@# torch first, at its pin: an unpinned torch on a machine without one pulls a multi-GB CUDA build.
	$(BIN)/pip install -c constraints.txt torch
	$(BIN)/pip install -c constraints.txt -e ".[dev]"
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/fsdpx train --strategy zero3 --nproc 2 --name demo --overwrite   # its own runs/demo, replaced each time

# two workers (pytest-xdist), a test file's tests on one of them in order (--dist loadfile);
# PYTEST_ARGS="-n 0" runs in one process, "-n 4" on four. Then, alone, the tests marked `alone`
# (a timing they assert needs the cores to itself: tests/conftest.py); none selected is fine.
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile $(PYTEST_ARGS)
	FSDPX_TESTS=alone $(BIN)/python -m pytest -n 0 $(PYTEST_ARGS) || [ $$? -eq 5 ]

pins:
	.ci/move_pins

clean:
	rm -rf $(VENV) .pins-venv runs .pytest_cache .hypothesis
