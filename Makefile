# megatron_mini: `make train` and `make test` work from a fresh clone (they create .venv).
PY      ?= python3
VENV    := .venv
PYTHON  := $(VENV)/bin/python
NPROC   ?= 2
ARGS    ?=
# A GPU machine gets the default (CUDA) torch build; a CPU-only machine gets the CPU build
# (pip resolves torch==2.13.0 to the local +cpu wheel where one is provided).
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.4' || echo 'torch==2.13.0')
RUN_ENV := OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1

.PHONY: venv data train test bench bench-kernels compare-precision demo-48 plot-schedule clean-venv

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -q -e ".[test]"
	touch $@

data: venv
	$(RUN_ENV) $(PYTHON) tools/prepare_data.py $(ARGS)

train: data
	$(RUN_ENV) $(VENV)/bin/torchrun --standalone --nproc_per_node=$(NPROC) train.py $(ARGS)

test: venv
	$(RUN_ENV) $(PYTHON) -m pytest -q $(ARGS)

bench: venv
	$(RUN_ENV) $(PYTHON) tools/bench_train.py $(ARGS)

bench-kernels: venv
	$(PYTHON) tools/bench_kernels.py $(ARGS)

clean-venv:
	rm -rf $(VENV)
