"""Training-throughput benchmarks of megatron_mini on CPU, side by side in one run.

    make bench                                   # all four sections (~15 min on an idle 2-core machine)
    make bench ARGS="--section 1 --steps 20"     # one section; --steps = measured steps per row
    .venv/bin/python tools/bench_train.py --section 3 --no-doc

Shape S2: 4 layers, 8 heads, hidden 256, sequence 256, micro-batch 8, gbs 32 (4 microbatches
at dp=1, 8192 tokens per step), vocabulary 1024, fp32, synthetic tokens, CPU.

Sections (the issue numbers of the project):
  1 (issue 2)  tp=pp=dp=1 (1 process x 2 threads) vs the plain PyTorch GPT-2 of
               tools/baseline_gpt2.py (2 threads); dp=2 (2 ranks x 1 thread) vs tp=pp=dp=1.
  2 (issue 3)  tp=2 and tp=2 sp (2 ranks x 1 thread) vs tp=1 (2 threads); bytes per step per rank.
  3 (issue 4)  pp=2 1F1B / GPipe / interleaved, pp=4 vpp=2 (4 ranks on 2 cores; 8 layers, as 4
               blocks cannot fill 8 virtual stages) vs tp=pp=1; measured vs theoretical bubble;
               activation memory of GPipe vs 1F1B for m = 4, 8, 16.
  4 (issue 5)  bf16 / fp16 vs fp32; ZeRO-1 optimizer state per rank at dp = 1, 2, 4;
               recompute none / selective / full: activation memory and step time.

Method: tools/bench/harness.py (every row built once and kept alive, in this process or in
persistent pools of gloo ranks, measured in interleaved rounds; a row's figure is the median of its
steps). Activation memory: tools/bench/meters.py (peak bytes saved for backward, counted with
saved_tensors_hooks). Model FLOPs: ModelConfig.flops_per_token() x tokens per step. Memory per rank:
Optimizer.memory_bytes().
"""
from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("WANDB_MODE", "disabled")

from bench import pipeline, precision, tensor_parallel, throughput  # noqa: E402
from bench.harness import Bench  # noqa: E402
from bench.report import (DOC, GOAL_HEADERS, at_least, command_line, device_line, print_table,  # noqa: E402
                          write_train_doc)
from bench.workload import S2, SMOKE  # noqa: E402
from defaults_help import RawDescriptionDefaultsHelp  # noqa: E402
from plotting import CREATED, refuse_unwritable  # noqa: E402
from megatron_mini.errors import run_tool  # noqa: E402

SECTIONS = {1: throughput, 2: tensor_parallel, 3: pipeline, 4: precision}


def main(argv=None) -> None:
    default_steps = {s: mod.STEPS for s, mod in SECTIONS.items()}
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=RawDescriptionDefaultsHelp)
    ap.add_argument("--section", type=int, action="append", choices=list(SECTIONS),
                    help="run only this section (repeatable; default: all)")
    ap.add_argument("--steps", type=at_least(1), default=None,
                    help=f"measured steps per row (default per section: {default_steps})")
    ap.add_argument("--doc", default=DOC, help=f"markdown file to update ({CREATED})")
    ap.add_argument("--no-doc", action="store_true", help="print only")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny model instead of S2, to check the script (writes only to an explicit --doc)")
    args = ap.parse_args(argv)
    args.no_doc = args.no_doc or (args.smoke and args.doc == DOC)    # never overwrite the real figures with smoke ones
    if not args.no_doc:
        refuse_unwritable(ap, "--doc", args.doc)
    sections = sorted(set(args.section or SECTIONS))
    command = command_line("bench_train.py", "OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 .venv/bin/python")
    device = device_line(with_date=False)
    t_start = time.time()
    print(f"{device} | load average {os.getloadavg()[0]:.1f} | sections {sections}")

    def log(msg):
        print(f"[{time.time() - t_start:6.0f}s] {msg}", flush=True)

    worlds = sorted({w for s in sections for w in SECTIONS[s].WORLDS})
    reports = []
    with Bench(SMOKE if args.smoke else S2, worlds, log, smoke=args.smoke) as bench:
        for s in sections:
            steps = args.steps or default_steps[s]
            log(f"section {s}: {steps} measured steps per row")
            rep = SECTIONS[s].run(bench, steps)
            rep.finish()
            reports.append(rep)
            print()
    print("\n=== Goals ===")
    print_table(GOAL_HEADERS, [g for rep in reports for g in rep.goals])
    print(f"\ntotal time {time.time() - t_start:.0f} s")
    if not args.no_doc:
        write_train_doc(args.doc, reports, command, device)
        print(f"wrote {args.doc}")


if __name__ == "__main__":
    run_tool(main)
