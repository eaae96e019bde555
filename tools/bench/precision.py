"""Section 4 (issue 5): bf16 / fp16 vs fp32; ZeRO-1 memory per rank (Optimizer.memory_bytes) at
dp = 1, 2, 4; recompute none / selective / full: activation memory and step time."""
from __future__ import annotations

from bench.harness import Bench
from bench.report import Report, mb
from bench.workload import MBS

STEPS, WORLDS = 8, (2, 4)


def run(bench: Bench, steps: int) -> Report:
    rep = Report(4, "Section 4 (issue 5): precision, ZeRO-1, activation recompute", bench)
    local = bench.local
    fp32 = bench.row("fp32, recompute=none", local)
    bf16 = bench.row("bf16", local, dtype="bf16")
    sel = bench.row("recompute=selective", local, recompute="selective")
    full = bench.row("recompute=full", local, recompute="full")
    rows = [fp32, bf16, sel, full]
    bench.measure(rows, steps)
    peak = {}
    for r in rows:
        peak[r.name] = r.run(1, ("memory",))[1][0][0]["act_peak"]
        r.drop()
    # fp16 on CPU is ~100x slower in matmuls: compare the three precisions on one microbatch of 1 sequence
    smalls = [bench.row(f"{d} (mbs=1, gbs=1)", local, dtype=d, mbs=1, gbs=1) for d in ("fp32", "bf16", "fp16")]
    bench.measure(smalls, 5)
    for r in smalls:
        r.drop()

    rep.text(f"{bench.model.name} at tp=pp=dp=1, 1 process x 2 threads, {steps} measured steps per row (after 1 "
             "warmup step), interleaved; reference = fp32 with recompute=none.")
    rep.table(["configuration", "median s/step", "fastest s/step", "tokens/s", "model TFLOP/s", "vs fp32 (medians)",
               "vs fp32 (paired)", "vs fp32 (fastest)", "activation peak MiB"],
              [[r.name, f"{r.median_wall:.2f}", f"{r.min_wall:.2f}", f"{r.tokens_per_s:,.0f}", f"{r.tflops:.4f}",
                f"{r.speedup(fp32):.3f}", f"{r.paired(fp32):.3f}", f"{r.fastest(fp32):.3f}", mb(peak[r.name])]
               for r in rows])
    rep.text(f"\nfp16 on this CPU is too slow for a full {bench.model.name} step in the default budget; the three "
             f"precisions on one sequence (mbs=1, gbs=1, {smalls[0].tokens} tokens per step), 5 measured steps "
             "each, interleaved:")
    rep.table(["configuration", "median s/step", "fastest s/step", "tokens/s", "model TFLOP/s", "vs fp32 (medians)",
               "vs fp32 (fastest)"],
              [[r.name, f"{r.median_wall:.2f}", f"{r.min_wall:.2f}", f"{r.tokens_per_s:,.0f}", f"{r.tflops:.4f}",
                f"{r.speedup(smalls[0]):.3f}", f"{r.fastest(smalls[0]):.3f}"] for r in smalls])

    # ZeRO-1: what each rank holds
    zlines, opt = [], {}
    for dtype in ("fp32", "bf16"):
        for zero, dp in ((0, 1), (1, 1), (0, 2), (1, 2), (1, 4)):
            row = bench.row(f"zero{zero} dp{dp} {dtype}", local if dp == 1 else bench.pools[dp], dtype=dtype,
                            zero=zero)
            held = row.memory_bytes()[0]
            row.drop()
            opt[dtype, zero, dp] = held["optimizer"]
            zlines.append([dtype, zero, dp, f"{held['params']:,}", mb(held["weights"]), mb(held["grads"]),
                           mb(held["optimizer"]), f"{held['optimizer'] / held['params']:.2f}"])
    rep.text("\nMemory per rank (rank 0), from Optimizer.memory_bytes(): the weights, the fp32 main grads, and the "
             "optimizer state (Adam's two moments, plus the fp32 master weights when they are a separate tensor: "
             "in fp32 the master is the parameter buffer itself), which ZeRO-1 shards over DP.")
    rep.table(["dtype", "zero", "dp", "params", "weights MiB", "grads MiB", "optimizer state MiB",
               "optimizer bytes/param"], zlines)
    ok = all(abs(opt[d, 1, k] * k / opt[d, 1, 1] - 1) < 0.01 for d in ("fp32", "bf16") for k in (2, 4))
    rep.goal("ZeRO-1 optimizer state per rank scales as 1/dp (dp=2, 4; fp32 and bf16)",
             ", ".join(f"{d}: {mb(opt[d, 1, 1])}/{mb(opt[d, 1, 2])}/{mb(opt[d, 1, 4])} MiB at dp=1/2/4"
                       for d in ("fp32", "bf16")),
             "within 1% of 1/dp", ok)
    block_input_mib = MBS * bench.model.seq_len * bench.model.hidden_size * 4 / 2**20      # fp32 [s, b, h]
    rep.text("\nrecompute=selective recomputes the attention core (softmax(q k^T) v). Both attention paths are "
             "fused (F.scaled_dot_product_attention with kernels=torch, the Triton flash attention with "
             "kernels=triton): the s x s probabilities are never stored, and the attention output shares its storage "
             "with the output projection's saved input (on CPU for SDPA; always for the flash kernel), so selective "
             "saves only the log-sum-exp: its memory equals none, and it pays the attention forward again. "
             f"recompute=full keeps only each block's input ({block_input_mib:g} MiB per block per microbatch "
             "here) plus the head.")
    a_full, a_sel, a_none = peak[full.name], peak[sel.name], peak[fp32.name]
    rep.goal("activation memory full < selective <= none",
             f"{mb(a_full)} < {mb(a_sel)} <= {mb(a_none)} MiB", "order", a_full < a_sel <= a_none)
    return rep
