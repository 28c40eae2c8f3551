# `make run` runs the whole pipeline on the embedded demo; `make test` runs the test suite.
# Both create .venv when missing and install the project; they are quick when nothing changed.
PYTHON ?= python3
VENV ?= .venv
# The CPU build lies on this machine's disk; on a GPU machine use e.g. TORCH_SPEC="torch==2.13.0" with
# a CUDA index (PIP_EXTRA_INDEX_URL) or TORCH_SPEC=skip when torch is already installed.
TORCH_SPEC ?= torch==2.13.0
CORES ?= all
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint fmt bench clean install

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	@if [ "$(TORCH_SPEC)" != "skip" ]; then $(BIN)/pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --cores $(CORES)

test: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/pytest $(PYTEST_ARGS)

# Every bench/*.py, each in its own process, merged into bench/results.json with the machine's
# facts; exits non-zero when any bench failed. BENCH_ARGS=--quick for CI sizes, or e.g.
# BENCH_ARGS="--only generate tokenization".
bench: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python bench/run_all.py $(BENCH_ARGS)

lint: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --lint
	$(BIN)/snakefmt --check Snakefile rules/
	$(BIN)/ruff check src scripts tests bench

fmt: $(STAMP)
	$(BIN)/snakefmt Snakefile rules/
	$(BIN)/ruff format src scripts tests bench

clean:
	rm -rf results logs benchmarks .snakemake
