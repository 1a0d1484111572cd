# Two entry points for a fresh clone: `make demo` and `make test`. Both build the virtual
# environment first (pinned installs, CPU torch from local disk), then run.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch is installed alone and pinned first: the CPU build of 2.13.0 lies on local disk, while an
# unpinned torch (asked for by megatron-core) would download a multi-GB CUDA build.
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed
RUN_DIR ?= runs/demo
# Two pytest-xdist workers: most tests (and every end-to-end run) use one core, so two workers use
# the CI machine's two; the 20 slowest tests are listed at the end.
PYTEST_ARGS ?= -n 2 --durations=20

.PHONY: demo test lint env clean

$(STAMP): requirements.txt setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check $(TORCH)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(STAMP)

env: $(STAMP)

# A second `make demo` continues (or just re-summarises) the existing run instead of overwriting it.
demo: $(STAMP)
	@if [ -f $(RUN_DIR)/config.yaml ]; then \
		echo "$(RUN_DIR) exists: resuming it (delete it for a fresh demo)"; \
		$(VENV)/bin/mugrpo train --resume $(RUN_DIR); \
	else \
		$(VENV)/bin/mugrpo train --config configs/demo_cpu.yaml --run-dir $(RUN_DIR); \
	fi

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
