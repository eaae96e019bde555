"""What one measured training step records: wall and CPU time, and on request the activation memory
(SavedTensorMeter), the communication ledger and the pipeline engine's trace statistics.

Activation memory = the peak, over a training step, of the bytes of tensors saved for backward alive
at once: torch.autograd.graph.saved_tensors_hooks counts a saved tensor's storage on pack (each storage
once, parameters excluded) and releases it when autograd drops the packed object (a weakref
finalizer). Checkpointed regions count their saved inputs (non-reentrant checkpoint saves them under
the outer hooks); the transient recomputed activations of the one region being back-propagated are
not counted.
"""
from __future__ import annotations

import contextlib
import gc
import time
import weakref

import torch


class _Packed:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class SavedTensorMeter:
    """Peak bytes of tensors saved for backward alive at once (see the module docstring)."""

    def __init__(self, exclude_storages: set):
        self.exclude, self.live, self.peak, self.held = exclude_storages, 0, 0, {}

    def _pack(self, t):
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if ptr in self.exclude or nbytes == 0:
            return t
        entry = self.held.get(ptr)
        if entry is None:
            entry = self.held[ptr] = [0, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        box = _Packed(t)
        weakref.finalize(box, self._release, ptr)
        return box

    @staticmethod
    def _unpack(box):
        return box.t if isinstance(box, _Packed) else box

    def _release(self, ptr):
        entry = self.held[ptr]
        entry[0] -= 1
        if entry[0] == 0:
            del self.held[ptr]
            self.live -= entry[1]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


def trace_stats(trace) -> dict:
    """Busy (forward/backward) time and span of one step's engine trace; peak in-flight microbatches."""
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
        meter = SavedTensorMeter({p.untyped_storage().data_ptr() for p in runner.params()})
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
