# megatron_mini: `make train` and `make test` work from a fresh clone (they create .venv).
PY      ?= python3
# VENV=path on the command line: an environment you already have instead (`make venv` adds what it lacks)
VENV    := .venv
PYTHON  := $(VENV)/bin/python
# ranks of `make train`: NPROC, else one per visible GPU, else 2 CPU ranks (read when the recipe runs,
# from the venv's torch, so CUDA_VISIBLE_DEVICES is honoured)
NPROC   ?=
ARGS    ?=
# pytest worker processes of `make test` (pytest-xdist; each takes whole test files): the suite's ranks
# run with one thread each, so a second worker fills the second core of a 2-core machine. 0: one process.
TEST_WORKERS ?= 2
# A GPU machine gets the default (CUDA) torch build; a CPU-only machine gets the CPU build
# (pip resolves torch==2.13.0 to the local +cpu wheel where one is provided).
TORCH_SPEC ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 'torch>=2.9' || echo 'torch==2.13.0')
RUN_ENV := OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1
# torchrun on this machine alone: the ranks meet at 127.0.0.1, not at this machine's name (socket.getfqdn()), which
# a Mac whose name is in no DNS cannot resolve (torchrun's agent then retried that name for minutes before starting
# any rank)
ONE_NODE := --standalone --local-addr=127.0.0.1

.PHONY: venv data train test bench bench-kernels bench-gpu check-kernels compare-precision demo-48 plot-schedule clean-venv

venv: $(VENV)/.installed
$(VENV)/.installed: pyproject.toml
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q "$(TORCH_SPEC)"
	$(PYTHON) -m pip install -q -e ".[test]"
	touch $@

data: venv
	$(RUN_ENV) $(PYTHON) tools/prepare_data.py $(ARGS)

NPROC_CMD = $(or $(NPROC),$$($(PYTHON) -c 'import torch; print(torch.cuda.device_count() or 2)'))

train: data
	$(RUN_ENV) $(VENV)/bin/torchrun $(ONE_NODE) --nproc_per_node=$(NPROC_CMD) train.py $(ARGS)

test: venv
	$(RUN_ENV) $(PYTHON) -m pytest -q --durations=15 -n $(TEST_WORKERS) --dist loadfile $(ARGS)

bench: venv
	$(RUN_ENV) $(PYTHON) tools/bench_train.py $(ARGS)

# on a GPU their tables replace their sections of docs/benchmarks.md (--doc); a CPU smoke run writes no doc
bench-kernels: venv
	$(PYTHON) tools/bench_kernels.py --doc $(ARGS)

bench-gpu: venv
	$(PYTHON) tools/bench_gpu.py --doc $(ARGS)

# every Triton kernel launch compiled for an H100 (sm_90) on any machine: registers, spills, shared memory
check-kernels: venv
	$(PYTHON) tools/check_kernels.py $(ARGS)

# fp32 vs fp16 vs bf16 on the tiny model: same seed, same data, one wandb group; then the overlay.
# CPUs have no fast fp16 matmul (about 10x slower than fp32 on the 2-core build VM), so the CPU default is short; on a GPU
# use e.g. PRECISION_ARGS="steps=2000 gbs=64".
PRECISION_ARGS ?= steps=100 gbs=8 eval_interval=25
# Each call trains three new runs, runs/precision-<STAMP>-{fp32,fp16,bf16} (earlier calls' are kept).
STAMP := $(shell date +%Y%m%d-%H%M%S)
compare-precision: data
	for p in fp32 fp16 bf16; do \
	  $(RUN_ENV) $(VENV)/bin/torchrun $(ONE_NODE) --nproc_per_node=$(NPROC_CMD) train.py precision=$$p $(PRECISION_ARGS) \
	    log_interval=2 run_name=precision-$(STAMP)-$$p resume=never wandb.group=precision-$(STAMP) wandb.name=$$p \
	    $(ARGS) || exit 1; \
	done
	$(PYTHON) tools/compare_runs.py runs/precision-$(STAMP)-fp32 runs/precision-$(STAMP)-fp16 runs/precision-$(STAMP)-bf16 \
	  --labels fp32,fp16,bf16 -o docs/precision_compare.png

# The design card's layout on one CPU machine: 48 ranks, tp=4 x pp=12 (1 embedding + 10 block + 1 head stages).
# Each call is a new run, runs/demo-48-<STAMP>.
demo-48: data
	$(RUN_ENV) $(VENV)/bin/torchrun $(ONE_NODE) --nproc_per_node=48 train.py layout=tp4_pp12 \
	  embedding_stage=own model.num_layers=10 mbs=1 gbs=12 steps=6 log_interval=1 eval_interval=0 \
	  run_name=demo-48-$(STAMP) resume=never timeout_s=900 $(ARGS)

plot-schedule: venv
	$(PYTHON) tools/plot_schedule.py --pp 4 --vpp 2 --microbatches 8 --compare -o docs/schedule_pp4_vpp2_m8.png

clean-venv:   # only the project's own .venv: never an environment named with VENV=
	@[ "$(VENV)" = .venv ] || { echo "clean-venv removes only ./.venv, not VENV=$(VENV)"; exit 2; }
	rm -rf .venv
