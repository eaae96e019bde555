"""Section 1 (issue 2): tp=pp=dp=1 (1 process x 2 threads) against the plain PyTorch GPT-2 of
tools/baseline_gpt2.py (2 threads), and dp=2 (2 ranks x 1 thread) against tp=pp=dp=1."""
from __future__ import annotations

import math

from bench.harness import Bench
from bench.report import RATIO_NOTE, ROW_HEADERS, Report, ratios_text, row_line

STEPS, WORLDS = 20, (2,)


def run(bench: Bench, steps: int) -> Report:
    rep = Report(1, "Section 1 (issue 2): framework vs plain PyTorch, and data parallelism", bench)
    base = bench.row("baseline (tools/baseline_gpt2.py)", bench.local, baseline=True)
    lib = bench.row("megatron_mini tp=pp=dp=1", bench.local)
    dp2 = bench.row("megatron_mini dp=2", bench.pools[2])
    rows = [base, lib, dp2]
    bench.measure(rows, steps)
    rep.text(f"{bench.model.name}, fp32, {steps} measured steps per row (after 1 warmup step), interleaved; "
             "reference = baseline for the first two rows.")
    rep.table(ROW_HEADERS, [row_line(base), row_line(lib, base), row_line(dp2, lib)])
    rep.text(RATIO_NOTE)
    rep.text(f"\nframework / baseline = {ratios_text(lib, base)} (goal >= 1.0); dp=2 / tp=pp=dp=1 (2 threads) = "
             f"{ratios_text(dp2, lib)} (goal >= 0.95).")
    vocab = bench.model.vocab_size
    rep.text(f"Final losses (random tokens, so all near ln({vocab}) = {math.log(vocab):.2f}): "
             f"baseline {base.steps[-1]['loss']:.4f}, "
             f"framework {lib.steps[-1]['loss']:.4f}, dp=2 {dp2.steps[-1]['loss']:.4f}.")
    rep.throughput_goal("framework tp=pp=dp=1 / plain PyTorch GPT-2 (tokens/s)", lib, base, 1.0)
    rep.throughput_goal("dp=2 (2x1 thread) / tp=pp=dp=1 (2 threads)", dp2, lib, 0.95)
    for r in rows:
        r.drop()
    return rep
