"""Section 2 (issue 3): tp=2 and tp=2 with sequence parallelism (2 ranks x 1 thread) against tp=1
(2 threads); the bytes each rank moves in one step (mesh.ledger) and its activation memory."""
from __future__ import annotations

from bench.harness import Bench
from bench.report import RATIO_NOTE, ROW_HEADERS, Report, mb, ratios_text, row_line
from bench.workload import GBS, MBS

STEPS, WORLDS = 10, (2,)


def ledger_lines(ledger: dict, sizes: dict) -> list:
    """[group.op, calls, ledger MiB, sent MiB] per ledger entry and the total. Sent = the bytes this rank
    sends with ring algorithms: all-reduce 2(p-1)/p n, all-gather (output n) and reduce-scatter (input n)
    (p-1)/p n, send n, recv 0, anything else (broadcast) n as an upper bound."""
    lines, tot_calls, tot_bytes, tot_wire = [], 0, 0, 0.0
    for key, (calls, nbytes) in sorted(ledger.items()):
        group, op = key.split(".", 1)
        p = sizes[group]
        wire = {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p,
                "send": 1.0, "recv": 0.0}.get(op, 1.0) * nbytes
        lines.append([key, calls, mb(nbytes), mb(wire)])
        tot_calls, tot_bytes, tot_wire = tot_calls + calls, tot_bytes + nbytes, tot_wire + wire
    lines.append(["**total**", tot_calls, mb(tot_bytes), mb(tot_wire)])
    return lines


def run(bench: Bench, steps: int) -> Report:
    rep = Report(2, "Section 2 (issue 3): tensor and sequence parallelism", bench)
    ref = bench.row("megatron_mini tp=1", bench.local)
    tp2 = bench.row("megatron_mini tp=2", bench.pools[2], tp=2)
    sp = bench.row("megatron_mini tp=2 sp", bench.pools[2], tp=2, sp=True)
    rows = [ref, tp2, sp]
    bench.measure(rows, steps, flags=("ledger",))
    rep.text(f"{bench.model.name}, fp32, {steps} measured steps per row (after 1 warmup step), interleaved; "
             "reference = tp=1, 1 process x 2 threads.")
    rep.table(ROW_HEADERS, [row_line(ref), row_line(tp2, ref), row_line(sp, ref)])
    rep.text(RATIO_NOTE)
    rep.text(f"\ntp=2 / tp=1 = {ratios_text(tp2, ref)} (goal >= 0.85); tp=2 sp / tp=2 = {ratios_text(sp, tp2)} "
             "(goal: within 5%).")
    sizes = {"tp": 2, "dp": 1, "pp": 1, "mp": 2, "world": 2, "emb": 1}
    for row in (tp2, sp):
        per_rank = row.per_rank[-1]
        totals = [sum(v[1] for v in rec["ledger"].values()) for rec in per_rank]
        rep.text(f"\nCommunication in one step, {row.name} (mesh.ledger, reset before the step, summary after): "
                 + ", ".join(f"rank {r}: {mb(t)} MiB" for r, t in enumerate(totals))
                 + ". Rank 0's ledger (bytes as the ledger counts them: the reduced tensor, the gathered output, "
                 "the unreduced input), and the bytes a ring algorithm sends per rank:")
        rep.table(["group.op", "calls", "ledger MiB", "sent MiB (ring estimate)"],
                  ledger_lines(per_rank[0]["ledger"], sizes))
    s, b, h, L, m = bench.model.seq_len, MBS, bench.model.hidden_size, bench.model.num_layers, GBS // MBS
    act = s * b * h * 4
    rep.text(f"\nAnalytic TP activation traffic per rank: m x (4L + 2) x s*b*h*4 bytes = {m} x {4 * L + 2} x "
             f"{mb(act)} MiB = {mb(m * (4 * L + 2) * act)} MiB (per block 2 all-reduces forward + 2 backward; the "
             "embedding's forward g and the head's backward f), plus 2 cross-entropy all-reduces per microbatch "
             "(the [s, b] max, then the [2, s, b] sums), the SP LayerNorm/bias gradient sum and the step's scalars. "
             "SP moves the same volume as "
             "all-gather + reduce-scatter (each counted at the full [s, b, h] tensor), plus one all-gather more per "
             f"column-parallel linear in backward (QKV, fc1, the head's logits: m x (2L + 1) x s*b*h*4 bytes = "
             f"{mb(m * (2 * L + 1) * act)} MiB), which gathers again the input it saved as a sequence shard.")
    mem = {row.name: [r[0]["act_peak"] for r in row.run(1, ("memory",))[1]] for row in rows}
    rep.text("\nActivation memory per rank (peak bytes saved for backward in one step, as in section 3; MiB): "
             + "; ".join(f"{name}: {' / '.join(mb(x) for x in v)}" for name, v in mem.items()) + ". "
             "With sp every tensor a block saves is split over TP: the LayerNorms' inputs and the column-parallel "
             "linears' inputs over the sequence (those linears keep their input's sequence shard and gather it "
             "again in backward, as Megatron does), the rest by heads or by the MLP's width; the head's "
             "probabilities by the vocabulary. Compare sp with tp=1 / 2.")
    rep.throughput_goal("tp=2 (2x1 thread) / tp=1 (2 threads)", tp2, ref, 0.85)
    rep.throughput_goal("tp=2 sp / tp=2 (sp within 5% of sp=false)", sp, tp2, 0.95)
    for r in rows:
        r.drop()
    return rep
