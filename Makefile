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

# First, alone, the tests marked `alone` (a timing they assert needs the cores to itself:
# tests/conftest.py; none selected is fine): before the rest, while the machine is quiet, not
# after it, when they would first wait a minute or more for the load average to decay. Then the
# rest on two workers (pytest-xdist), a test file's tests on one of them in order (--dist
# loadfile); PYTEST_ARGS="-n 0" runs in one process, "-n 4" on four. Both phases always run;
# the status is the first failing phase's (pytest's: 5 = no test ran).
test: $(STAMP)
	@rc=0; \
	FSDPX_TESTS=alone $(BIN)/python -m pytest -n 0 $(PYTEST_ARGS) || { s=$$?; [ $$s -eq 5 ] || rc=$$s; }; \
	$(BIN)/python -m pytest -n 2 --dist loadfile $(PYTEST_ARGS) || { s=$$?; [ $$rc -ne 0 ] || rc=$$s; }; \
	exit $$rc

pins:
	.ci/move_pins

clean:
	rm -rf $(VENV) .pins-venv runs .pytest_cache .hypothesis
