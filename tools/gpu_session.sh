#!/usr/bin/env bash
# What a lent GPU machine runs, one stage per call (the machine starts bare and has no internet). A session
# has 15 minutes of device time, the machine's start (one to two minutes) included, and 10 minutes a call: one
# full stage (the first of those below not yet run, ~600 s), then, on the still-warm machine, `quick` (~90 s).
# In the order successive GPU sessions run them (docs/benchmarks.md, "What the next GPU run should do"):
#
#   tools/gpu_session.sh make     # the README's two commands as written, `make test` (the whole suite with
#                                 # CUDA visible) then `make train` on 1 GPU, with the machine's python3 as
#                                 # the venv and .gpu/wheelhouse for PyPI
#   tools/gpu_session.sh compile  # the default (compiled on CUDA) against eager and the compiled baseline at
#                                 # the three sizes, and docs/probes/eager_glue.py (bias gradients, the qkv split)
#   tools/gpu_session.sh check    # the kernels (do_bench and CUDA-graph GPU time), the cross-entropy in training
#                                 # at vocabulary 50304, profiles of the compiled default and baseline
#   tools/gpu_session.sh sweep    # the flash attention's launch configurations (tools/sweep_attention.py, with
#                                 # and without dropout) and the cross-entropy kernel against torch
#   tools/gpu_session.sh quick    # the second call of every session: gpt2-small, the default (compiled) against
#                                 # the compiled baseline, issue 10's headline ratio (limit 120 s)
#   tools/gpu_session.sh bench [MODELS]   # make bench-kernels, and make bench-gpu for MODELS (default small:
#                                         # a call has 10 minutes), their tables written into a copy of
#                                         # docs/benchmarks.md in session.tgz
#
# Run here, before the calls (this machine reaches PyPI; the GPU machine does not):
#
#   tools/gpu_session.sh wheels [SHARED_WHEELS]  # .gpu/wheels: hydra-core/omegaconf/antlr4 (default
#                                                # ../shared/wheels: hydra's antlr4 4.9 has no wheel on PyPI);
#                                                # .gpu/wheelhouse: wandb, protobuf, setuptools and sentencepiece
#                                                # at pyproject's floors (that machine's sentencepiece 0.2.2
#                                                # aborts a test) with everything they
#                                                # need, for the GPU machine's Python (GPU_PYTHON, 3.12);
#                                                # .gpu/data: a copy of this machine's data/stdlib-v8192
#                                                # and of its CPU run's metrics (a fresh checkout makes
#                                                # both first: make data, then make train, ~4 minutes)
#
# The stages need .gpu (ignored; carried with the call). `make` prepares its own data: the default corpus is
# the running Python's standard library, so a machine with another Python trains on another corpus; so the
# `make` stage also trains the default on .gpu/data, this machine's corpus, whose CPU losses are known. Each
# call starts with empty logs; after every step they are packed into $OUT/session.tgz again, so a call cut
# off by its limit still brings back the steps it finished. The last lines printed are a summary, and the
# exit status is 1 when a step failed.
set -u
STAGES="wheels (here), make, compile, check, sweep, bench or quick"
STAGE=${1:-}
case $STAGE in
  wheels|compile|make|sweep|bench|check|quick) ;;
  *) echo "usage: tools/gpu_session.sh STAGE [MODELS]; STAGE: $STAGES (got '$STAGE')"; exit 2 ;;
esac
MODELS=${2:-small}
OUT=${OUT:-/tmp/gpu_out}
LOGS=/tmp/session
rm -rf "$LOGS"
mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled OMP_NUM_THREADS=1
PY=python3

if [ "$STAGE" = wheels ]; then
  SHARED_WHEELS=${2:-../shared/wheels}    # (checked before the old copies go)
  ls "$SHARED_WHEELS"/hydra_core-*.whl "$SHARED_WHEELS"/omegaconf-*.whl \
    "$SHARED_WHEELS"/antlr4_python3_runtime-4.9.*.whl >/dev/null 2>&1 || { echo "error: no hydra-core, omegaconf" \
    "and antlr4-python3-runtime 4.9 wheels in $SHARED_WHEELS: name their folder (wheels FOLDER)"; exit 1; }
  rm -rf .gpu/wheels .gpu/wheelhouse      # (pip download keeps older versions beside newer ones)
  mkdir -p .gpu/wheels .gpu/wheelhouse
  cp "$SHARED_WHEELS"/*.whl .gpu/wheels/ || exit 1
  python3 -m pip download -q --only-binary=:all: --python-version "${GPU_PYTHON:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .gpu/wheelhouse 'wandb>=0.26' 'protobuf>=7.36.1' setuptools \
    'sentencepiece>=0.2.3' || exit 1
  # the default run's data as this machine builds it, for the make stage's same-data run, and the metrics of the
  # CPU run it is compared with; a fresh checkout has neither, and makes both here (make data: the venv and the
  # corpus, a few minutes; the CPU run, about 3 minutes on 2 cores)
  if [ ! -f data/stdlib-v8192/tokens.bin ]; then
    echo "no data/stdlib-v8192 here: make data"; make data >/tmp/gpu_session_data.log 2>&1 || \
      { tail -20 /tmp/gpu_session_data.log; echo "error: make data failed"; exit 1; }
  fi
  if [ ! -f runs/same-data-cpu/summary.json ]; then      # (written when a run ends, unlike its metrics)
    echo "no runs/same-data-cpu here: the default run on this machine's CPU (about 3 minutes)"
    make train ARGS="run_name=same-data-cpu resume=never wandb.mode=disabled" >/tmp/gpu_session_ref.log 2>&1 || \
      { tail -20 /tmp/gpu_session_ref.log; rm -rf runs/same-data-cpu; echo "error: the CPU run failed"; exit 1; }
    grep 'val loss' /tmp/gpu_session_ref.log
  fi
  rm -rf .gpu/data && mkdir -p .gpu/data && cp -r data/stdlib-v8192 .gpu/data/ || exit 1
  mkdir -p .gpu/data/same-data-cpu && cp runs/same-data-cpu/metrics.jsonl .gpu/data/same-data-cpu/ || exit 1
  du -sh .gpu/wheels .gpu/wheelhouse .gpu/data
  exit 0
fi
# .gpu as `wheels` fills it (a copy older than the sentencepiece pin would fail `make venv` offline at once;
# only the make stage reads .gpu/data)
SP_WHEEL=$(ls .gpu/wheelhouse/sentencepiece-*.whl 2>/dev/null |
  grep -v -E 'sentencepiece-0\.(1\.|2\.[0-2][-.])' | head -1)
ls .gpu/wheels/hydra_core-*.whl .gpu/wheels/omegaconf-*.whl .gpu/wheels/antlr4_python3_runtime-4.9.*.whl \
  "${SP_WHEEL:-no-sentencepiece-0.2.3-or-newer}" $([ "$STAGE" = make ] && echo .gpu/data/stdlib-v8192/tokens.bin) \
  >/dev/null 2>&1 || { echo "error: .gpu lacks hydra-core, omegaconf, antlr4-python3-runtime, sentencepiece >=" \
  "0.2.3 or data: run tools/gpu_session.sh wheels here (this machine reaches PyPI) and carry .gpu"; exit 2; }
if [ "$STAGE" = make ]; then
  # pip finds on disk what it would take from PyPI; everything else it needs is installed there already
  export PIP_NO_INDEX=1 PIP_FIND_LINKS="$PWD/.gpu/wheels $PWD/.gpu/wheelhouse"
else
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/wheels/*.whl \
    >"$LOGS/pip.log" 2>&1 || { cat "$LOGS/pip.log"; exit 1; }
  export PYTHONPATH=$PWD:/tmp/site
fi

FAILED=0
pack() {   # the logs into $OUT/session.tgz, whole or not at all (a call killed mid-tar keeps the last one; tar's
  tar czf "$OUT/.session.tgz" -C "$LOGS" .     # exit 1, a log that grew while it was read, still packs the rest)
  [ $? -le 1 ] && mv "$OUT/.session.tgz" "$OUT/session.tgz"
}
until_() {  # until_ T MIN: the seconds left until T s after the start, at least MIN (timeout 0 would mean none)
  local left=$(($1 - SECONDS))
  echo $((left < $2 ? $2 : left))
}
note() {   # note NAME RC T0: a step's exit status (into FAILED) and seconds since T0 in steps.txt; pack
  [ "$2" = 0 ] || FAILED=1
  echo "$1: rc=$2, $((SECONDS - $3)) s" | tee -a "$LOGS/steps.txt"
  pack
}
step() {   # step NAME SECONDS CMD...: run with a time limit, log to $LOGS/NAME.log, note it (STEP_RC: its status)
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  STEP_RC=$?
  note "$name" $STEP_RC $t0
}

{ nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv
  # (numpy: before 3.7, Triton's interpreter cannot run the kernels with numpy >= 2.4, kernels.interpreter_unsupported)
  $PY -c "import torch, triton, numpy, sentencepiece, sys; print(sys.version.split()[0], 'torch', torch.__version__,
'triton', triton.__version__, 'numpy', numpy.__version__, 'sentencepiece', sentencepiece.__version__,
torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).multi_processor_count, 'SMs')"
  nproc; } >"$LOGS/env.txt" 2>&1

case $STAGE in
check)
  $PY -c "import torch; from megatron_mini.tensor_parallel import gemm_into_fp32 as g
print('gemm_into_fp32 cuda bf16:', g('cuda', torch.bfloat16), '| fp16:', g('cuda', torch.float16))" >>"$LOGS/env.txt" 2>&1
  # the GPU tests run in the make stage's `make test`; here: the kernels as a whole (do_bench and GPU time
  # alone), the Triton cross-entropy in training at GPT-2's vocabulary (the row kernels=cross_entropy: kernels=auto
  # takes it there on an H100 SXM, model.TRITON_WINS, but not on an H200, whose entry is not measured), and where
  # the compiled default's step goes against the compiled baseline's (limits: 500 s)
  # (attention first: its whole table is new, and a step cut by its limit loses its last rows)
  step bench_kernels 150 env TRITON_PRINT_AUTOTUNING=1 $PY tools/bench_kernels.py --ops attn,ln,addln --no-compile \
    --graph --rep 60 --out "$LOGS"
  step bench_vocab 190 $PY tools/bench_gpu.py --models small --vocab 50304 --rows cross_entropy,torch,baseline-compile \
    --steps 8 --out "$LOGS/vocab"
  # (top 15: the summary prints a log's last 40 lines, the step time and both tables)
  step profile_default 80 $PY tools/bench_gpu.py --models small --profile default --profile-top 15
  step profile_baseline 80 $PY tools/bench_gpu.py --models small --profile baseline-compile --profile-top 15
  tails=""
  tables="bench_kernels.md vocab/bench_gpu.md profile_default.log profile_baseline.log"
  ;;
make)
  # the machine's python3 lives in a venv (/opt/torch/.venv) with CUDA torch, triton and the test tools: it is
  # make's VENV, and `make venv` adds hydra-core, wandb and this package to it, as it would to a new .venv
  VENV=$($PY -c 'import sys; print(sys.prefix)')
  # -vv (with make test's -q, verbose): each test's result as it ends, so a call cut short still names its
  # failures (seen: cut at 420 s, 96%, with three workers lost to sentencepiece 0.2.2's abort); --durations:
  # which tests the GPU makes slow (limits: the venv and the tests share the first 450 s from the start, make
  # train has 110, the comparison of the curves what is left until 585, a few seconds of it)
  # (make test's own --dist loadfile: worksteal would spread a file's tests, and with them its module fixtures,
  # the refusals fixture of ~46 train.py runs among them, over several workers, each building them again)
  step make_venv 120 make venv VENV="$VENV"
  # beside the tests, over by 440 s since the start (there is no room after them; make train then has the GPU to
  # itself): the default run on this machine's corpus (.gpu/data), which two CPU ranks train to known losses
  # (docs/benchmarks.md), niced, its compile on 4 threads; the tests have 8 workers of the 16 cores
  SAME_DATA=
  if [ $STEP_RC = 0 ]; then       # (without the venv's hydra it could not start, and pip may still be writing it)
    same_t0=$SECONDS
    nice -n 10 env TORCHINDUCTOR_COMPILE_THREADS=4 timeout -k 5 "$(until_ 440 30)" "$VENV/bin/torchrun" --standalone \
      --nproc_per_node=1 train.py data.dir=.gpu/data/stdlib-v8192 run_name=same-data-gpu resume=never \
      wandb.mode=disabled >"$LOGS/same_data.log" 2>&1 &
    SAME_DATA=$!
  fi
  step make_test "$(until_ 450 60)" make test VENV="$VENV" TEST_WORKERS=8 \
    ARGS="-vv --durations=40 --timeout 240 --timeout-method=thread"
  if [ -n "$SAME_DATA" ]; then
    wait $SAME_DATA
    rc=$?
    note same_data $rc $same_t0
    [ $rc = 0 ] || { grep -E '^(error|stopped by|done):' "$LOGS/same_data.log" | tail -3 | tee -a "$LOGS/steps.txt"; pack; }
  else
    echo "same_data: not run (make_venv failed)" | tee -a "$LOGS/steps.txt"; FAILED=1
  fi
  # wandb offline, as with no API key (seen: 77 s eager; it now compiles on CUDA: a graph each for the chunk and
  # the cross-entropy, in training and in evaluation)
  step make_train 110 env -u WANDB_MODE make train VENV="$VENV"
  # the GPU's curve against the CPU's ("gap vs ref": the smoothed train loss minus the CPU's at the last step)
  [ -f .gpu/data/same-data-cpu/metrics.jsonl ] && [ -f runs/same-data-gpu/metrics.jsonl ] && \
    step same_data_compare "$(until_ 585 5)" "$VENV/bin/python" tools/compare_runs.py .gpu/data/same-data-cpu \
    runs/same-data-gpu --labels cpu,gpu -o "$LOGS/same_data.png"
  tails="make_test make_train same_data"
  tables="same_data_compare.log"
  ;;
compile)
  cp docs/benchmarks.md "$LOGS/"
  B="$PY tools/bench_gpu.py --doc $LOGS/benchmarks.md"
  # the limits sum to 530 s (pip, imports and tar fit in 600); seen 2026-11-24: glue 14 s, each compiled row
  # 35 s (small), 58 s (medium), 69 s (1.3b) before its steps; 1.3b eager was measured then (1980.9 ms)
  step glue 30 $PY docs/probes/eager_glue.py
  # (the compiled baseline first: every ratio's reference, and the row a cut call lost at 1.3b on 2026-11-24; the
  # default and fp16 rows compile too since 8145709; eager does not)
  step bench_small 150 $B --models small --rows baseline-compile,default,eager,fp16 --steps 8 --out "$LOGS/small"
  step bench_medium 150 $B --models medium --rows baseline-compile,default,eager --steps 8 --out "$LOGS/medium"
  # (1.3b: both rows compile, ~70 s each before its steps, which agreed within 1%: 3 warmup steps and 5 timed)
  step bench_1.3b 200 $B --models 1.3b --rows baseline-compile,default --warmup 1 --steps 5 --out "$LOGS/1.3b"
  tails=""
  tables="glue.log small/bench_gpu.md medium/bench_gpu.md 1.3b/bench_gpu.md"
  ;;
sweep)
  step sweep 240 $PY tools/sweep_attention.py --quick          # the limits sum to 540 s
  # (d = 128 only: d = 64's dropout sweep ran on 2026-11-24, and d = 128's, after it, was cut off by its 200 s)
  step sweep_dropout 200 $PY tools/sweep_attention.py --quick --dropout 0.1 --shapes 8,16,2048,128
  step bench_ce 100 $PY tools/bench_kernels.py --ops ce --out "$LOGS"
  tails=""
  tables="sweep.log sweep_dropout.log bench_kernels.md"
  ;;
quick)
  # compiled rows: ~35 s of compile each before their steps (2026-11-24), 2 + 2 warmup steps and 6 timed: ~90 s in all
  step bench_small 120 $PY tools/bench_gpu.py --models small --rows default,baseline-compile --warmup 2 --steps 6 \
    --out "$LOGS/small"
  tails=""
  tables="small/bench_gpu.md"
  ;;
bench)
  cp docs/benchmarks.md "$LOGS/"
  step bench_kernels 260 $PY tools/bench_kernels.py --out "$LOGS" --doc "$LOGS/benchmarks.md"
  step bench_gpu 300 $PY tools/bench_gpu.py --models "$MODELS" --out "$LOGS" --doc "$LOGS/benchmarks.md"
  tails=""
  tables="bench_kernels.md bench_gpu.md"
  ;;
esac

echo "================ summary ($STAGE)"
cat "$LOGS/env.txt" "$LOGS/steps.txt"
for t in $tails; do   # (the training runs' validation losses too)
  echo "---- $t"; grep -E "^(FAILED|ERROR)|\] (FAILED|ERROR) |Timeout|[0-9]+ (passed|failed)|^(done|stopped):$([ $t = make_test ] || echo '|val loss')" \
    "$LOGS/$t.log" | cut -c1-200
done
for t in $tables; do   # a table file from its head, a log (the sweep's table, the probe's) from its tail
  echo "---- $t"; [ -f "$LOGS/$t" ] && grep -v '^$' "$LOGS/$t" | case $t in *.log) tail -40 ;; *) head -60 ;; esac
done
# the steps again last: the run tool returns the last 12,000 characters, which long tables would leave without them
[ -n "$tables" ] && { echo "---- steps"; cat "$LOGS/steps.txt"; }
exit $FAILED
