"""What one measured training step records: wall and CPU time, and on request the activation memory
(SavedTensorMeter), the communication ledger and the pipeline engine's trace statistics.

Activation memory = the peak, over a training step, of the bytes of tensors saved for backward alive
at once (megatron_mini.meter.SavedTensorMeter, the meter the layout planner uses too). Checkpointed
regions count their saved inputs (non-reentrant checkpoint saves them under the outer hooks); the
transient recomputed activations of the one region being back-propagated are not counted.
"""
from __future__ import annotations

import contextlib
import gc
import time

from megatron_mini.meter import SavedTensorMeter


def trace_stats(trace) -> dict:
    """Busy (forward/backward) time and span of one step's engine trace; peak in-flight microbatches. The
    trace holds host times: the work's on CPU ranks (what the CPU benchmarks measure), launches on a GPU."""
    busy = sum(t1 - t0 for a, t0, t1 in trace if a.op in ("forward", "backward"))
    in_flight = peak = 0
    for a, _, _ in trace:
        if a.op == "forward":
            in_flight += 1
            peak = max(peak, in_flight)
        elif a.op == "backward":
            in_flight -= 1
    return {"busy": busy, "start": trace[0][1], "end": trace[-1][2], "in_flight": peak}


def measured_step(runner, flags) -> dict:
    """One training step of `runner`: loss, wall and CPU seconds; with flag "memory" the activation
    peak and what is left after the step, "ledger" the step's mesh.ledger summary, "trace" trace_stats."""
    rec, meter = {}, None
    if "memory" in flags:
        gc.collect()
        meter = SavedTensorMeter(exclude=runner.params())
    if "ledger" in flags:
        runner.mesh.ledger.reset()
    t0, c0 = time.perf_counter(), time.process_time()
    with meter.hooks() if meter else contextlib.nullcontext():
        rec["loss"] = runner.step()
    rec["wall"], rec["cpu"] = time.perf_counter() - t0, time.process_time() - c0
    if meter:
        gc.collect()
        rec["act_peak"], rec["act_left"] = meter.peak, meter.live
    if "ledger" in flags:
        rec["ledger"] = {f"{g}.{o}": v for (g, o), v in runner.mesh.ledger.summary().items()}
    if "trace" in flags:
        rec.update(trace_stats(runner.trainer.engine.trace))
    return rec
