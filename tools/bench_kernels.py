"""Kernel benchmarks (`make bench-kernels`): the Triton LayerNorm, fused residual-add + LayerNorm, flash
attention and cross-entropy against every torch path, side by side in one run on one GPU.

    python tools/bench_kernels.py [--doc] [--out DIR] [--no-compile] [--graph] [--ops ln,addln,attn,ce]
    python tools/bench_kernels.py --smoke          # CPU: tiny shapes through the Triton interpreter

Rows (bf16 activations, bf16 weights):
  LayerNorm      y = LN(x)                  x [16384, N], N = 768, 1024, 2048, 4096
  add+LayerNorm  h = x + r, y = LN(h)       x, r [16384, N], same N (both h and y are outputs)
  attention      causal, [b, heads, s, d] = (16, 12, 1024, 64) and (8, 16, 2048, 128)
  cross-entropy  per-token loss of logits x [16384, V], V = 8192 (bench_gpu's vocabulary) and 50304 (GPT-2's,
                 padded), int64 targets; the loss is fp32
Columns: ours (Triton: megatron_mini.kernels: layernorm.layer_norm / add_layer_norm, attention.flash_attention;
tensor_parallel.vocab_parallel_cross_entropy(fused=True) on one rank), torch eager (F.layer_norm;
layernorm.torch_add_layer_norm; attention.torch_attention, which materialises the [s, s] scores;
vocab_parallel_cross_entropy's torch path: F.cross_entropy of the fp32 logits at tp=1), torch.compile of
that eager function (mode default, dynamic=False), and for attention F.scaled_dot_product_attention with one
backend forced through torch.nn.attention.sdpa_kernel (cuDNN, flash, memory-efficient). A path that cannot
run prints '-' and the reason.

Method. Each cell is timed with the median of triton.testing.do_bench (CUDA events; do_bench also
flushes L2 before every repetition), once for the forward alone and once for forward + backward
(forward, then torch.autograd.grad of every input with fixed random output gradients); backward =
(fwd+bwd) - fwd. The forward runs with autograd recording, as in training. Inputs are fresh randn
(never zeros), and each closure cycles through k input sets with k * (bytes of one set) > 2 * L2,
so no repetition finds its inputs in cache. Ratios are "x best torch" = (fastest torch path's
fwd+bwd ms) / (this path's fwd+bwd ms): above 1 means faster than every torch path. The error
column is max |ours - ref| / max |ref| over the outputs and all input gradients, ref = the same
math in fp32 (torch, TF32 off) on the same inputs.

Byte model (GB/s = bytes / time; the same bytes for every implementation, each tensor crossing
memory once). e = 2 bytes per activation element, ew = 2 per weight element, M rows, N columns:
  LayerNorm      fwd: read x, write y                     2*M*N*e + 2*N*ew (w, b) + 8*M (mean, rstd fp32)
                 bwd: read x, dy, write dx                3*M*N*e + 3*N*ew (w; dw, db) + 8*M
  add+LayerNorm  fwd: read x, r, write h, y               4*M*N*e + 2*N*ew + 8*M
                 bwd: read h, dh, dy, write dx (= dr)     4*M*N*e + 3*N*ew + 8*M
  cross-entropy  fwd: read x, t, write the loss           M*N*e + 12*M
                 bwd: read x, write dx (t, dloss, lse)    2*M*N*e + 16*M
The fwd+bwd GB/s divides the sum of both passes by the fwd+bwd time.

FLOP convention (TFLOP/s; FlashAttention's): a non-causal forward is 4*b*h*s^2*d (q k^T and P v,
2 FLOPs per multiply-add), the backward 2.5x the forward (recomputed S, dV, dP, dQ, dK), and
causal attention counts half: fwd 2*b*h*s^2*d, bwd 5*b*h*s^2*d, fwd+bwd 7*b*h*s^2*d.

Goals (issue 9, H100, fwd+bwd): attention >= 1.0x cuDNN SDPA at (16, 12, 1024, 64) and >= 0.8x at
(8, 16, 2048, 128); LayerNorm >= 2x torch eager; add+LayerNorm >= 2.5x torch eager. The cross-entropy
has no goal of its own: its rows decide kernels=auto's TRITON_WINS (issue 10's profile: 11.8 ms a
gpt2-small step in the fp32 cast and softmax).

`--graph` times each path's fwd+bwd a second way, the GPU's time alone: one CUDA graph runs it on each input
set in turn, and the median of do_bench over the graph's replays is divided by the number of sets. Where the
host takes longer to launch a path than the GPU to run it (the LayerNorms' Python wrappers on a slow host),
do_bench measures the host; the graph figure measures the kernels. It is reported beside the issue's
do_bench figure (a table and goal lines of its own), never instead of it.

`--doc` replaces the section between `<!-- bench_kernels begin -->` and `<!-- bench_kernels end -->`
of docs/benchmarks.md (appended when absent) with the tables, the goals and the device line.
`--out DIR` writes bench_kernels.md and bench_kernels.json (every number) there, rewritten after every row.
`--smoke` (automatic without CUDA) runs tiny shapes, without torch.compile, to exercise the script
only (no speed is claimed, no goal judged): on the GPU when there is one, else on the CPU with the
kernels under TRITON_INTERPRET=1, timed with perf_counter.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import time
import traceback

from bench.report import (DOC, add_output_args, at_least, check_output_args, command_line, device_line, fmt,
                          markdown_table, require_triton, short_error, write_doc_section, write_text)
from defaults_help import RawDescriptionDefaultsHelp
from megatron_mini.errors import run_tool

LN_SIZES = [(16384, n) for n in (768, 1024, 2048, 4096)]
ATTN_SHAPES = [(16, 12, 1024, 64), (8, 16, 2048, 128)]
SMOKE_LN_SIZES = [(64, 128), (48, 200)]           # 200: a row width that is not a power of two
SMOKE_ATTN_SHAPES = [(1, 2, 48, 32)]              # 48: a sequence that is not a multiple of the block
CE_SIZES = [(16384, 8192), (16384, 50304)]
SMOKE_CE_SIZES = [(64, 300)]
OPS = {"ln": "LayerNorm", "addln": "add+LayerNorm", "attn": "attention", "ce": "cross-entropy"}
SDPA_BACKENDS = {"cuDNN SDPA": "CUDNN_ATTENTION", "flash SDPA": "FLASH_ATTENTION",
                 "efficient SDPA": "EFFICIENT_ATTENTION"}
TORCH_PATHS = ("torch eager", "torch.compile") + tuple(SDPA_BACKENDS)
COLUMNS = ("ours (Triton)",) + TORCH_PATHS
ERR_WARN = 3e-2     # bf16 outputs: a relative error above this is flagged in the tables


# ============================================================================ cases
class Case:
    """One row: an op at one shape, how to make an input set, its bytes or FLOPs, its paths."""

    def __init__(self, op: str, shape: tuple, dev: str):
        self.op, self.shape, self.dev = op, shape, dev
        self.label = OPS[op]
        self.shape_text = "[" + ", ".join(map(str, shape)) + "]" if op != "attn" else \
            "(b, heads, s, d) = (" + ", ".join(map(str, shape)) + ")"

    # ---------------------------------------------------------------- inputs
    def make_set(self) -> dict:
        """args (passed to the path), leaves (differentiated), douts (fixed output gradients)."""
        import torch
        bf16 = torch.bfloat16

        def rnd(*s, grad=True):
            return torch.randn(*s, device=self.dev, dtype=bf16, requires_grad=grad)

        if self.op == "attn":
            q, k, v = (rnd(*self.shape) for _ in range(3))
            return {"args": (q, k, v), "leaves": (q, k, v), "douts": (rnd(*self.shape, grad=False),)}
        m, n = self.shape
        if self.op == "ce":
            x, t = rnd(m, n), torch.randint(0, n, (m,), device=self.dev)
            return {"args": (x, t), "leaves": (x,), "douts": (torch.rand(m, device=self.dev) + 0.5,)}
        w, b = rnd(n), rnd(n)
        if self.op == "ln":
            x = rnd(m, n)
            return {"args": (x, w, b), "leaves": (x, w, b), "douts": (rnd(m, n, grad=False),)}
        x, r = rnd(m, n), rnd(m, n)
        return {"args": (x, r, w, b), "leaves": (x, r, w, b),
                "douts": (rnd(m, n, grad=False), rnd(m, n, grad=False))}   # dh, dy

    @staticmethod
    def set_bytes(s: dict) -> int:
        return sum(t.numel() * t.element_size() for t in s["args"] + s["douts"])

    # ---------------------------------------------------------------- work model
    def work(self) -> tuple:
        """(fwd, bwd, unit): bytes for the LayerNorms (GB/s), FLOPs for attention (TFLOP/s)."""
        if self.op == "attn":
            b, h, s, d = self.shape
            return 2.0 * b * h * s * s * d, 5.0 * b * h * s * s * d, "TFLOP/s"
        m, n = self.shape
        e = ew = 2
        if self.op == "ln":
            return 2 * m * n * e + 2 * n * ew + 8 * m, 3 * m * n * e + 3 * n * ew + 8 * m, "GB/s"
        if self.op == "ce":
            return m * n * e + 12 * m, 2 * m * n * e + 16 * m, "GB/s"
        return 4 * m * n * e + 2 * n * ew + 8 * m, 4 * m * n * e + 3 * n * ew + 8 * m, "GB/s"

    def rate(self, amount: float, ms: float | None) -> float | None:
        if ms is None or ms <= 0:
            return None
        return amount / (ms * 1e-3) / (1e12 if self.op == "attn" else 1e9)

    # ---------------------------------------------------------------- paths
    def paths(self, compile_ok: bool) -> dict:
        """column -> callable, or the reason (a str) it cannot run."""
        import torch
        import torch.nn.functional as F
        from megatron_mini.comm import Group, Ledger
        from megatron_mini.kernels import attention, layernorm
        from megatron_mini.tensor_parallel import vocab_parallel_cross_entropy
        eps = 1e-5
        if self.op == "ln":
            ours = lambda x, w, b: layernorm.layer_norm(x, w, b, eps)  # noqa: E731
            eager = lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps)  # noqa: E731
        elif self.op == "addln":
            ours = lambda x, r, w, b: layernorm.add_layer_norm(x, r, w, b, eps)  # noqa: E731
            eager = lambda x, r, w, b: layernorm.torch_add_layer_norm(x, r, w, b, eps)  # noqa: E731
        elif self.op == "ce":
            one, n = Group("tp", [0], None, Ledger()), self.shape[1]
            ours = lambda x, t: vocab_parallel_cross_entropy(x, t, one, n, fused=True)  # noqa: E731
            eager = lambda x, t: vocab_parallel_cross_entropy(x, t, one, n)  # noqa: E731
        else:
            ours = lambda q, k, v: attention.flash_attention(q, k, v, causal=True)  # noqa: E731
            eager = lambda q, k, v: attention.torch_attention(q, k, v, causal=True)  # noqa: E731
        out = {"ours (Triton)": ours, "torch eager": eager,
               "torch.compile": torch.compile(eager, dynamic=False) if compile_ok
               else "skipped (--no-compile, or a smoke run)"}
        for col, name in SDPA_BACKENDS.items():
            out[col] = _sdpa(name) if self.op == "attn" else "n/a"
        return out


def _sdpa(backend_name: str):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)

    def fn(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return fn


def _as_tuple(out):
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


# ============================================================================ timing
class Timer:
    def __init__(self, gpu: bool, warmup_ms: int, rep_ms: int, cpu_reps: int):
        self.gpu, self.warmup_ms, self.rep_ms, self.cpu_reps = gpu, warmup_ms, rep_ms, cpu_reps
        self.side_stream = None            # graph_ms's warm-up stream

    def median_ms(self, fn) -> float:
        if self.gpu:
            import triton.testing
            return float(triton.testing.do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="median"))
        fn()
        times = []
        for _ in range(self.cpu_reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def _sync():
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _fwd_bwd(fn, s: dict):
    """fn's forward on input set s, then the gradients of its leaves for the set's fixed output gradients."""
    import torch
    return torch.autograd.grad(_as_tuple(fn(*s["args"])), s["leaves"], s["douts"])


def bench_path(fn, sets: list, timer: Timer) -> dict:
    """fwd / fwd+bwd / bwd medians of fn over the rotating input sets."""
    cycle_f, cycle_b = itertools.cycle(sets), itertools.cycle(sets)

    def fwd():
        s = next(cycle_f)
        return fn(*s["args"])

    def fwd_bwd():
        return _fwd_bwd(fn, next(cycle_b))

    t0 = time.perf_counter()
    fwd_bwd()                     # compiles (torch.compile, Triton JIT) and checks the path runs
    _sync()
    first_s = time.perf_counter() - t0
    fb = timer.median_ms(fwd_bwd)
    f = timer.median_ms(fwd)
    return {"fwd_ms": f, "fwdbwd_ms": fb, "bwd_ms": fb - f, "first_call_s": first_s}


def graph_ms(fn, sets: list, timer: Timer) -> float:
    """fwd+bwd GPU time alone (`--graph`): one CUDA graph runs fn's fwd+bwd on each input set in turn, and
    the median of do_bench over its replays is divided by the number of sets. The host's launch cost, which
    do_bench's figure includes where it exceeds the GPU's work, is gone from it."""
    import torch

    def every_set():
        return [_fwd_bwd(fn, s) for s in sets]

    if timer.side_stream is None:          # one for the run: a stream's cached blocks serve that stream only
        timer.side_stream = torch.cuda.Stream()
    side = timer.side_stream               # warm up on a side stream, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        every_set()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = every_set()
    try:
        return timer.median_ms(graph.replay) / len(sets)
    finally:
        del outs, graph


def max_rel_error(fn, ref, s: dict) -> float:
    """max |fn - ref| / max |ref| over outputs and input gradients; ref runs in fp32 (TF32 off) on the
    leaves upcast (other args, the cross-entropy's targets, as they are)."""
    import torch

    from megatron_mini.hardware import set_tf32
    outs = _as_tuple(fn(*s["args"]))
    grads = torch.autograd.grad(outs, s["leaves"], s["douts"])
    up = [t.detach().float().requires_grad_() for t in s["leaves"]]
    leaf_ids = [id(t) for t in s["leaves"]]
    args = [up[leaf_ids.index(id(a))] if id(a) in leaf_ids else a for a in s["args"]]
    tf32 = set_tf32(False)
    try:
        routs = _as_tuple(ref(*args))
        rgrads = torch.autograd.grad(routs, up, [d.float() for d in s["douts"]])
    finally:
        set_tf32(tf32)
    errs = []
    for a, r in zip(list(outs) + list(grads), list(routs) + list(rgrads)):
        scale = r.detach().abs().max().item()
        errs.append((a.detach().float() - r.detach()).abs().max().item() / (scale or 1.0))
    return max(errs) if all(math.isfinite(e) for e in errs) else float("nan")   # a NaN must not hide


def rank_against_torch(row: dict) -> None:
    """row's fastest torch path (best_torch; best_torch_graph by CUDA-graph time) and each cell's ratio to it
    (x_best_torch, x_best_torch_graph: the torch path's time / the cell's, above 1 = faster)."""
    for key, best, ratio in (("fwdbwd_ms", "best_torch", "x_best_torch"),
                             ("graph_ms", "best_torch_graph", "x_best_torch_graph")):
        torch_ms = {c: row["cells"][c][key] for c in TORCH_PATHS if key in row["cells"].get(c, {})}
        if torch_ms:
            row[best] = min(torch_ms, key=torch_ms.get)
            for cell in row["cells"].values():
                if key in cell:
                    cell[ratio] = torch_ms[row[best]] / cell[key]


def run(ops, smoke: bool, timer: Timer, compile_ok: bool, log=print, on_row=None, graph: bool = False) -> list:
    """The benchmark rows of `ops`; `on_row(results so far)` after each (a run cut short keeps its rows);
    `graph`: each path's fwd+bwd GPU time under a CUDA graph too (graph_ms; CUDA only)."""
    import torch
    gpu = torch.cuda.is_available()
    dev = "cuda" if gpu else "cpu"
    l2 = 50e6
    if gpu:
        l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0) or l2
    cases = []
    for op in ops:
        if op == "attn":
            cases += [Case(op, s, dev) for s in (SMOKE_ATTN_SHAPES if smoke else ATTN_SHAPES)]
        elif op == "ce":
            cases += [Case(op, s, dev) for s in (SMOKE_CE_SIZES if smoke else CE_SIZES)]
        else:
            cases += [Case(op, s, dev) for s in (SMOKE_LN_SIZES if smoke else LN_SIZES)]
    results = []
    for case in cases:
        torch.manual_seed(1234)
        if gpu:
            torch._dynamo.reset()          # torch.compile: a fresh cache per shape (dynamic=False)
        first = case.make_set()
        k = 2 if smoke else max(2, int(2 * l2 // case.set_bytes(first)) + 1)
        sets = [first] + [case.make_set() for _ in range(k - 1)]
        fwd_work, bwd_work, unit = case.work()
        row = {"op": case.op, "label": case.label, "shape": list(case.shape), "shape_text": case.shape_text,
               "unit": unit, "input_sets": k, "set_mb": case.set_bytes(first) / 1e6, "cells": {}}
        log(f"{case.label} {case.shape_text}: {k} input sets of {row['set_mb']:.1f} MB")
        for col, fn in case.paths(compile_ok).items():
            if isinstance(fn, str):
                row["cells"][col] = {"reason": fn}
                if fn != "n/a":
                    log(f"  {col}: - ({fn})")
                continue
            try:
                cell = bench_path(fn, sets, timer)
            except Exception as err:  # noqa: BLE001 - e.g. an SDPA backend that does not take this shape
                if gpu and isinstance(err, torch.cuda.OutOfMemoryError):
                    torch.cuda.empty_cache()
                row["cells"][col] = {"reason": short_error(err)}
                log(f"  {col}: - ({short_error(err)})")
                if col == "ours (Triton)":
                    traceback.print_exc()
                continue
            cell["rate_fwd"] = case.rate(fwd_work, cell["fwd_ms"])
            cell["rate_bwd"] = case.rate(bwd_work, cell["bwd_ms"])
            cell["rate"] = case.rate(fwd_work + bwd_work, cell["fwdbwd_ms"])
            row["cells"][col] = cell
            log(f"  {col}: fwd {cell['fwd_ms']:.4g} ms, bwd {cell['bwd_ms']:.4g} ms, fwd+bwd "
                f"{cell['fwdbwd_ms']:.4g} ms, {fmt(cell['rate'])} {unit} (first call {cell['first_call_s']:.1f} s)")
            if graph and gpu:
                try:
                    cell["graph_ms"] = graph_ms(fn, sets, timer)
                    log(f"  {col}: fwd+bwd {cell['graph_ms']:.4g} ms of GPU time (CUDA graph)")
                except Exception as err:  # noqa: BLE001 - a path that cannot be captured (a host sync, ...)
                    torch.cuda.set_stream(torch.cuda.default_stream())   # a failed capture leaves its stream set
                    torch.cuda.synchronize()
                    cell["graph_reason"] = short_error(err)
                    log(f"  {col}: no CUDA graph ({short_error(err)})")
        rank_against_torch(row)
        ours = row["cells"]["ours (Triton)"]
        if "fwdbwd_ms" in ours:        # against the eager math in fp32
            plain = case.paths(compile_ok=False)
            try:
                ours["max_rel_err"] = max_rel_error(plain["ours (Triton)"], plain["torch eager"], first)
            except Exception as err:  # noqa: BLE001
                ours["max_rel_err_reason"] = short_error(err)
        results.append(row)
        if on_row:
            on_row(results)
        del sets, first
        if gpu:
            torch.cuda.empty_cache()
    return results


# ============================================================================ goals and tables
def goals(results: list, smoke: bool) -> list:
    """[goal, measured, target, verdict] for each row that issue 9 sets a goal for."""
    out = []
    for row in results:
        op, shape = row["op"], tuple(row["shape"])
        if op == "attn":
            if shape == (16, 12, 1024, 64):
                ref, target = "cuDNN SDPA", 1.0
            elif shape == (8, 16, 2048, 128):
                ref, target = "cuDNN SDPA", 0.8
            else:
                ref, target = "cuDNN SDPA", None
        elif op == "ce":
            ref, target = "torch eager", None
        else:
            ref, target = "torch eager", (2.0 if op == "ln" else 2.5)
        ours, other = row["cells"].get("ours (Triton)", {}), row["cells"].get(ref, {})
        for key, how in (("fwdbwd_ms", ""), ("graph_ms", " (GPU time alone, CUDA graph)")):
            if key == "graph_ms" and key not in ours and key not in other:
                continue                   # no --graph
            name = f"{row['label']} {row['shape_text']} fwd+bwd vs {ref}{how}"
            if key in ours and key in other:
                ratio = other[key] / ours[key]
                measured = f"{ratio:.2f}x ({ours[key]:.4g} ms vs {other[key]:.4g} ms)"
            else:
                ratio = None
                measured = f"- ({'ours' if key not in ours else ref} did not run)"
            if smoke or target is None:
                verdict = "n/a (smoke run: not a GPU measurement)" if smoke else "n/a (no goal at this shape)"
            else:
                verdict = "not measured" if ratio is None else ("met" if ratio >= target else
                                                               f"MISSED by {(1 - ratio / target) * 100:.0f}%")
            out.append([name, measured, f">= {target}x" if target else "-", verdict])
    return out


def _cell_text(cell: dict) -> str:
    if "fwdbwd_ms" not in cell:
        return "-"
    return f"{cell['fwdbwd_ms']:.4g} ms ({fmt(cell['rate'], '.0f' if cell['rate'] and cell['rate'] >= 10 else '.3g')})"


def graph_table(results: list) -> str:
    """`--graph`: fwd+bwd GPU time (CUDA graph) of every column, and ours against the fastest torch path."""
    lines = []
    for row in results:
        cells = [row["cells"].get(k, {}) for k in COLUMNS]
        if not any("graph_ms" in c or "graph_reason" in c for c in cells):
            continue
        ratio = cells[0].get("x_best_torch_graph")
        lines.append([row["label"], row["shape_text"]] + [f"{c['graph_ms']:.4g} ms" if "graph_ms" in c else "-"
                                                          for c in cells]
                     + [row.get("best_torch_graph", "-"), "-" if ratio is None else f"{ratio:.2f}x"])
    if not lines:
        return ""
    return markdown_table(["op", "shape"] + list(COLUMNS) + ["best torch", "ours x best torch"], lines)


def _err_text(cell: dict) -> str:
    if "max_rel_err" in cell:
        e = cell["max_rel_err"]
        return f"{e:.1e}" + (" (!)" if e > ERR_WARN or not math.isfinite(e) else "")
    return "-" if "max_rel_err_reason" not in cell else "failed"


def compact_table(results: list) -> str:
    """One line per row: fwd+bwd ms (GB/s or TFLOP/s) of every column, best torch and our ratio."""
    headers = ["op", "shape", "unit"] + list(COLUMNS) + ["best torch", "ours x best torch", "ours err vs fp32"]
    lines = []
    for row in results:
        cells = row["cells"]
        ours = cells.get("ours (Triton)", {})
        lines.append([row["label"], row["shape_text"], row["unit"]]
                     + [_cell_text(cells.get(c, {})) for c in COLUMNS]
                     + [row.get("best_torch", "-"),
                        f"{ours['x_best_torch']:.2f}x" if "x_best_torch" in ours else "-", _err_text(ours)])
    return markdown_table(headers, lines)


def missing_notes(results: list) -> str:
    """One line per distinct reason a path did not run (the '-' cells)."""
    seen = {}
    for row in results:
        for col in COLUMNS:
            cell = row["cells"].get(col, {})
            for what, reason in ((col, cell.get("reason")), (f"{col} under a CUDA graph", cell.get("graph_reason"))):
                if reason and reason != "n/a":
                    seen.setdefault((what, reason), []).append(f"{row['label']} {row['shape_text']}")
    if not seen:
        return "Every path ran at every shape."
    return "Paths that did not run ('-'):\n" + "\n".join(
        f"- {col} at {', '.join(where)}: {reason}" for (col, reason), where in seen.items())


def full_table(results: list) -> str:
    headers = ["op", "shape", "path", "fwd ms", "bwd ms", "fwd+bwd ms", "fwd rate", "bwd rate", "fwd+bwd rate",
               "x best torch", "note"]
    lines = []
    for row in results:
        for col in COLUMNS:
            cell = row["cells"].get(col, {"reason": "-"})
            if "fwdbwd_ms" not in cell:
                if cell["reason"] != "n/a":
                    lines.append([row["label"], row["shape_text"], col] + ["-"] * 7 + [cell["reason"]])
                continue
            note = f"err vs fp32 {_err_text(cell)}" if col == "ours (Triton)" else ""
            lines.append([row["label"], row["shape_text"], col, f"{cell['fwd_ms']:.4g}", f"{cell['bwd_ms']:.4g}",
                          f"{cell['fwdbwd_ms']:.4g}"]
                         + [f"{fmt(cell[k], '.4g')} {row['unit']}" for k in ("rate_fwd", "rate_bwd", "rate")]
                         + [f"{cell['x_best_torch']:.2f}x" if "x_best_torch" in cell else "-", note])
    return markdown_table(headers, lines)


def report(results: list, smoke: bool, device: str, command: str) -> str:
    gl = goals(results, smoke)
    parts = ["## Kernel benchmarks (issue 9): `make bench-kernels`", "",
             f"- device: {device}", f"- command: `{command}`",
             "- method: median of `triton.testing.do_bench` per cell (fwd alone and fwd+bwd; bwd = the "
             "difference), fresh randn inputs rotating over sets that together exceed 2x L2, bf16; "
             "GB/s from the byte model and TFLOP/s from the causal FLOP convention (fwd 2·b·h·s²·d, "
             "bwd 5·b·h·s²·d) in the docstring of tools/bench_kernels.py; 'x best torch' = fastest torch "
             "path's fwd+bwd time / this path's; the error is max |ours − fp32 ref| / max |ref| over "
             "outputs and input gradients."]
    if smoke:
        parts.append("- **smoke run** (tiny shapes; on a CPU the Triton interpreter and perf_counter): these "
                     "figures say nothing about speed.")
    parts += ["", "fwd+bwd time (throughput) per path:", "", compact_table(results), "", missing_notes(results), ""]
    graphs = graph_table(results)
    if graphs:
        parts += ["fwd+bwd GPU time alone (`--graph`: one CUDA graph over the input sets, do_bench of its replays "
                  "divided by their number; no host launch cost):", "", graphs, ""]
    parts += ["Goals (issue 9):", "", markdown_table(["goal", "measured", "target", "result"], gl), "",
              "Full table (fwd, bwd, fwd+bwd):", "", full_table(results)]
    return "\n".join(parts)


# ============================================================================ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=RawDescriptionDefaultsHelp)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no torch.compile (automatic without CUDA, "
                    "then through the Triton interpreter); exercises the script, claims no speed")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma list of {', '.join(OPS)}")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    ap.add_argument("--graph", action="store_true", help="also time each path's fwd+bwd under a CUDA graph: the "
                    "GPU's time alone, without the host's launch cost (CUDA only)")
    ap.add_argument("--warmup", type=at_least(1), default=25, help="do_bench warmup, ms")
    ap.add_argument("--rep", type=at_least(1), default=100, help="do_bench repetition time, ms")
    add_output_args(ap, "bench_kernels")
    args = ap.parse_args(argv)
    check_output_args(ap, args)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        ap.error(f"unknown --ops {bad}; choose from {list(OPS)}" if bad else f"--ops names none of {list(OPS)}")
    require_triton("bench_kernels.py")

    import torch
    cuda = torch.cuda.is_available()
    smoke = args.smoke or not cuda
    if not cuda:   # before anything imports triton's JIT: the kernels then run under the interpreter
        os.environ["TRITON_INTERPRET"] = "1"
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    t_start = time.time()

    def log(msg):
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    device = device_line()
    command = command_line("bench_kernels.py")
    print(f"device: {device}\ncommand: {command}", flush=True)
    if smoke:
        print("SMOKE RUN: tiny shapes" + ("" if cuda else ", CPU, Triton interpreter, perf_counter timings")
              + "; no speed claims.", flush=True)
    timer = Timer(gpu=cuda, warmup_ms=min(args.warmup, 5) if smoke else args.warmup,
                  rep_ms=min(args.rep, 10) if smoke else args.rep, cpu_reps=2)
    def write_out(results, done):
        """--out's files, rewritten after every row (a run cut short by a time limit keeps what it measured)."""
        write_text(os.path.join(args.out, "bench_kernels.md"),
                   report(results, smoke, device, command) + ("\n" if done else "\n\n(unfinished: rows so far)\n"))
        write_text(os.path.join(args.out, "bench_kernels.json"),
                   json.dumps({"device": device, "command": command, "smoke": smoke, "done": done, "results": results,
                               "goals": goals(results, smoke)}, indent=1, default=str))

    if args.graph and not cuda:
        print("--graph needs CUDA: no CUDA graph timings on this machine", flush=True)
    results = run(ops, smoke, timer, compile_ok=not smoke and not args.no_compile, log=log,
                  on_row=(lambda rows: write_out(rows, False)) if args.out else None, graph=args.graph)
    text = report(results, smoke, device, command)
    log("done")

    if args.out:
        write_out(results, True)
        print(f"wrote {os.path.join(args.out, 'bench_kernels.md')} and bench_kernels.json")
    if args.doc is not None:
        if smoke and not args.doc:
            print("smoke run: not writing docs/benchmarks.md (name a file: --doc PATH)")
        else:
            path = args.doc or DOC
            if set(ops) != set(OPS):
                print(f"note: --ops {args.ops} replaces the whole bench_kernels section with these rows only")
            write_doc_section(path, "bench_kernels", text)
            print(f"wrote the bench_kernels section of {path}")
    print()
    print(compact_table(results))
    print()
    graphs = graph_table(results)
    if graphs:
        print("GPU time alone (CUDA graph):\n" + graphs + "\n")
    print(missing_notes(results))
    print()
    print(markdown_table(["goal", "measured", "target", "result"], goals(results, smoke)))
    return 0


if __name__ == "__main__":
    run_tool(main)
