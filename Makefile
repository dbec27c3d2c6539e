# metadist developer commands. `make install` then `make test` on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
NPROC ?= 2

.PHONY: install test test-torch soak scale lint format docs maml fewshot bench bench-deps clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# torch is pinned by version, from the indexes pip is configured with: where they serve the CPU
# build (a local wheel directory, PyTorch's CPU index) that is what you get; from PyPI on Linux
# x86-64 it is the CUDA build (README.md, "Which torch you get").
install: $(PY)
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[dev,docs,examples]"

test:
	$(PY) -m pytest -m "not soak and not scale" tests

# The same suite on another torch of the range pyproject accepts, in an environment of its own:
# `make test-torch TORCH=2.14.1` (.venv-torch-2.14.1). A torch not on this disk comes from PyPI
# with pip's local configuration ignored: `make test-torch TORCH=2.15.0 PIP_CONFIG_FILE=/dev/null`.
TORCH ?= 2.14.1
TVENV := .venv-torch-$(TORCH)

$(TVENV)/.installed:
	$(PYTHON) -m venv $(TVENV)
	echo "*" > $(TVENV)/.gitignore
	$(TVENV)/bin/python -m pip install -q --upgrade pip
	$(TVENV)/bin/python -m pip install -q "torch==$(TORCH)" -e ".[dev,examples]"
	touch $@

test-torch: $(TVENV)/.installed
	$(TVENV)/bin/python -m pytest -m "not soak and not scale" tests

soak:
	$(PY) -m pytest -m soak -s tests

# A world of 32 processes on this machine (about a minute here): it prints the first and second
# map/reduce and optimizer step, and fails if the first optimizer step costs over twice the second.
scale:
	$(PY) -m pytest -m scale -s tests/test_scale.py

lint:
	$(VENV)/bin/ruff check metadist tests examples benchmarks docs
	$(VENV)/bin/ruff format --check metadist tests examples benchmarks docs
	$(VENV)/bin/mypy

format:
	$(VENV)/bin/ruff check --fix metadist tests examples benchmarks docs
	$(VENV)/bin/ruff format metadist tests examples benchmarks docs

docs:
	$(VENV)/bin/sphinx-build -W --keep-going -b html docs docs/_build/html

# The examples on two local workers (--workers 2 starts them as torchrun --standalone does, after
# checking --resume). Options pass through: make maml ARGS="--resume none --steps 2000".
# maml: the sinusoid at Finn et al.'s settings, into runs/sinusoid (1.5 minutes on 2 cores lightly
# shared, 4 heavily); a second run resumes there and trains only what --steps adds. fewshot: the
# conv-net 5-way 1-shot MAML, into runs/fewshot (2.5 minutes, 6 heavily shared), where
# distributing pays. Both print their time per step beside plain torch's on the same steps.
maml:
	$(PY) examples/maml/sinusoid.py --workers 2 $(ARGS)

fewshot:
	$(PY) examples/maml/fewshot.py --workers 2 $(ARGS)

# torchopt 0.7.3, for the comparisons in benchmarks/ and docs/migrating.md only: it lives in its
# own folder, never in the project environment.
bench-deps:
	$(PY) -m pip install -q --target .bench-deps/torchopt "torchopt==0.7.3" optree graphviz --no-deps

# One script per question, each an interleaved run against its baselines (docs/performance.md);
# the last line prints the one-screen summary of the JSON the others leave in runs/bench (4-5
# minutes on a 2-core machine).
bench: bench-deps
	mkdir -p runs/bench
	$(PY) benchmarks/bench_overhead.py --tasks 25,400 --rounds 7 --steps 15 --json runs/bench/overhead.json
	$(PY) benchmarks/bench_maml.py --variants a,a2,c,k,e,l,d --rounds 3 --repeats 5 --warmup 2 --out runs/bench/maml.json
	$(PY) benchmarks/bench_schedule.py --rounds 5 --steps 3 --json runs/bench/schedule.json
	$(PY) benchmarks/bench_optim.py --rounds 7 --reps 20 --json runs/bench/optim.json
	$(PY) benchmarks/bench_remote.py --rounds 5
	$(PY) benchmarks/bench_remote.py --channels --rounds 3
	$(PY) benchmarks/bench_breakdown.py --tasks 25,400 --steps 100
	$(PY) benchmarks/bench_overhead.py --summary runs/bench

clean:
	rm -rf docs/_build .pytest_cache .mypy_cache .ruff_cache
