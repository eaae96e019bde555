"""Training throughput on one GPU (`make bench-gpu`): megatron_mini against the project's plain GPT-2
(tools/baseline_gpt2.py, eager and torch.compile), side by side in one process, same tokens and batch.

    python tools/bench_gpu.py --models small [--rows default,torch,baseline-compile] [--doc] [--out DIR]
    python tools/bench_gpu.py --models small --profile default     # top-25 CUDA kernels of one row
    python tools/bench_gpu.py --smoke                              # a tiny model, 2 steps per row

Models (conf/model/*.yaml; vocabulary 8192, the project tokenizer's, already a multiple of 128; `--vocab 50304`
GPT-2's padded one, where kernels=auto takes the Triton cross-entropy on an H100):
  small   gpt2-small   mbs 16 x 8 microbatches x seq 1024   (131,072 tokens per step)
  medium  gpt2-medium  mbs 8 x 8 x 1024                     (65,536)
  1.3b    gpt3-1.3b    mbs 8 x 8 x 2048                     (131,072)
Rows (bf16 unless named):
  default           megatron_mini with its default config (kernels=auto; compile unset: compiled on CUDA)
  eager             kernels=auto, compile=false
  torch / triton    kernels=torch / kernels=triton
  layer_norm        kernels=layer_norm: the Triton LayerNorm and add+LayerNorm, torch's SDPA attention
  cross_entropy     kernels=cross_entropy: the Triton cross-entropy, torch's kernels otherwise
  fp16              kernels=auto, precision fp16 (dynamic loss scaling from 2^16, so no step is skipped)
  (every framework row but eager compiles as the default does: at tp=1 a chunk's blocks as one graph)
  baseline          tools/baseline_gpt2.py eager: torch.autocast(bf16) with fp32 weights, fused AdamW
  baseline-compile  the same with torch.compile (the reference of the ratios)

Method. Every row is built in this process on cuda:0 (the framework with a TrainConfig built in
code: wandb disabled, no hydra, a one-rank gloo process group, tp=pp=dp=1), warmed up (3 steps;
compiled rows 5), then N steps (default 10) are timed one by one with torch.cuda.synchronize and
perf_counter; a row's figure is the median step. Tokens are tools/bench/workload.SyntheticTokens
(seed 1), batched by megatron_mini.dataset.get_batch for both projects, so both see the same
sequences at the same step. Model FLOPs per token = ModelConfig.flops_per_token()
(6N + 12*L*h*s, N = L*(4*h^2 + 2*h*f) + V*h: 12*L*h^2 + V*h at f = 4h); TFLOP/s per GPU = that
x tokens/s; MFU = TFLOP/s over megatron_mini.hardware.peak_tflops for the device and dtype (or
--peak-tflops). Peak memory = torch.cuda.max_memory_allocated from the row's build to its last
step (reset per row). Each row is freed (del, gc, empty_cache, dynamo reset) before the next; an
OOM or an error is reported in its row and the run goes on.

`--doc` writes the models that ran into the bench_gpu section of docs/benchmarks.md, one
subsection per model (`<!-- bench_gpu <model> begin/end -->`), keeping the models not rerun, so
the models can be run in separate commands. `--out DIR` writes bench_gpu.md and bench_gpu.json
(updated after every row). `--smoke` (automatic without CUDA): a tiny model, 2 steps per row, no
torch.compile, only to exercise the code (on the GPU when there is one; on a CPU kernels=triton runs
under the Triton interpreter).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import time
import traceback

os.environ.setdefault("WANDB_MODE", "disabled")

from megatron_mini.hardware import peak_tflops  # noqa: E402
from megatron_mini.profiling import busy, tables  # noqa: E402

from bench.report import (DOC, add_output_args, at_least, check_output_args, command_line,  # noqa: E402
                          device_line, fmt, markdown_table, ratio, read_doc_section, short_error, write_doc_section,
                          write_text)
from defaults_help import RawDescriptionDefaultsHelp  # noqa: E402
from plotting import CREATED, refuse_unwritable, write_output  # noqa: E402
from bench.workload import BaselineRunner, LibRunner, SyntheticTokens, lib_cfg  # noqa: E402
from megatron_mini.errors import run_tool  # noqa: E402
from megatron_mini.launch import free_port  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MODELS = {"small": ("gpt2-small", 16, 8), "medium": ("gpt2-medium", 8, 8), "1.3b": ("gpt3-1.3b", 8, 8)}
VOCAB = 8192
ROWS = ["default", "eager", "torch", "triton", "layer_norm", "cross_entropy", "fp16", "baseline", "baseline-compile"]
ROW_TEXT = {"default": "megatron_mini, default config (kernels=auto, compiled on CUDA), bf16",
            "eager": "megatron_mini, kernels=auto, compile=false, bf16",
            "torch": "megatron_mini, kernels=torch, bf16",
            "triton": "megatron_mini, kernels=triton, bf16",
            "layer_norm": "megatron_mini, kernels=layer_norm (Triton LayerNorm, torch attention), bf16",
            "cross_entropy": "megatron_mini, kernels=cross_entropy (Triton cross-entropy, torch otherwise), bf16",
            "fp16": "megatron_mini, kernels=auto, fp16",
            "baseline": "plain GPT-2 (tools/baseline_gpt2.py), eager, bf16 autocast",
            "baseline-compile": "plain GPT-2 + torch.compile, bf16 autocast"}
REFERENCE = "baseline-compile"
FP16_LOSS_SCALE = 2.0 ** 16


class RowSkipped(Exception):
    """The row cannot run in this mode (reported, not an error)."""


# ============================================================================ models and configs
def model_config(key: str, smoke: bool, vocab: int = VOCAB):
    """(ModelConfig, mbs, microbatches) of a preset, conf/model/<name>.yaml merged into ModelConfig, with `vocab`
    tokens (the baseline takes the same count: pass a multiple of 128, or the framework alone pads it)."""
    from megatron_mini.config import ModelConfig, structured
    if smoke:
        return ModelConfig(name="smoke", num_layers=2, hidden_size=64, num_heads=4, seq_len=32, vocab_size=256), 2, 2
    from omegaconf import OmegaConf
    name, mbs, m = MODELS[key]
    preset = OmegaConf.load(os.path.join(REPO, "conf", "model", f"{name}.yaml"))
    preset.vocab_size = vocab                       # (the preset's "${data.vocab_size}": no data config here)
    # merged into the schema, as train.py's config is: an unknown key or a value of the wrong type is a ConfigError
    return structured(preset, ModelConfig), mbs, m


def framework_config(row: str, model, mbs: int, m: int, device: str, smoke: bool):
    """The row's TrainConfig: the default's compile (unset) but in the eager row and a smoke run."""
    from megatron_mini.config import PrecisionConfig
    precision = dataclasses.replace(PrecisionConfig(), dtype="bf16")
    over = dict(mbs=mbs, gbs=mbs * m, kernels="auto", device=device, compile=False if row == "eager" or smoke else None)
    if row in ("torch", "triton", "layer_norm", "cross_entropy"):
        over["kernels"] = row
    elif row == "fp16":
        precision = dataclasses.replace(precision, dtype="fp16", initial_loss_scale=FP16_LOSS_SCALE)
    over["precision"] = precision
    return lib_cfg(model, **over)


def row_dtype(row: str) -> str:
    return "fp16" if row == "fp16" else "bf16"


# ============================================================================ runners
def triton_ops(cfg, device) -> list:
    """The ops that run Triton kernels under cfg on `device` (the Trainer's choice, model.select_triton_ops)."""
    from megatron_mini.model import select_triton_ops
    return [op for op, on in dataclasses.asdict(select_triton_ops(cfg.kernels, cfg.model, device, cfg.tp,
                                                                  cfg.precision.dtype, cfg.mbs)).items() if on]


def build(row: str, model, mbs: int, m: int, device, smoke: bool):
    """(runner, whether it runs torch.compile)."""
    if row.startswith("baseline"):
        compiled = row == "baseline-compile"
        if compiled and smoke:
            raise RowSkipped("smoke run: no torch.compile")
        tokens = SyntheticTokens(model.vocab_size, model.seq_len, 1)      # the framework's training tokens
        return BaselineRunner(model, mbs, m, device, "bf16", compiled, tokens), compiled
    from megatron_mini.mesh import ParallelMesh
    from megatron_mini.model import compiles
    cfg = framework_config(row, model, mbs, m, device.type, smoke)
    return LibRunner(cfg, ParallelMesh(1, 1, 1), device), compiles(cfg, device)


# ============================================================================ measuring
def _sync(device):
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device):
    import torch
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    torch._dynamo.reset()


def measure_row(row: str, key: str, args, device) -> dict:
    """Build, warm up and time one row; every failure ends up in the returned record."""
    import torch
    model, mbs, m = model_config(key, args.smoke, args.vocab)
    tokens = mbs * m * model.seq_len
    rec = {"model": key, "model_name": model.name, "vocab": model.vocab_size, "row": row, "config": ROW_TEXT[row],
           "dtype": row_dtype(row),
           "mbs": mbs, "microbatches": m, "seq_len": model.seq_len, "tokens_per_step": tokens, "status": "ok"}
    runner = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        rec["mem_at_start_gib"] = torch.cuda.memory_allocated(device) / 2 ** 30   # > 0: an earlier row leaked
    try:
        t0 = time.perf_counter()
        runner, compiled = build(row, model, mbs, m, device, args.smoke)
        _sync(device)
        rec["build_s"] = time.perf_counter() - t0
        rec["compiled"] = compiled
        warmup = args.warmup + (args.compile_warmup_extra if compiled else 0)
        if isinstance(runner, LibRunner):
            rec["triton_ops"] = triton_ops(runner.cfg, device)
        t0 = time.perf_counter()
        losses = [runner.step() for _ in range(warmup)]
        _sync(device)
        rec["warmup_s"] = time.perf_counter() - t0
        times, skipped = [], 0
        for _ in range(args.steps):
            _sync(device)
            t0 = time.perf_counter()
            loss = runner.step()
            _sync(device)
            times.append(time.perf_counter() - t0)
            losses.append(loss)
            skipped += runner.skipped
        rec.update(steps=len(times), warmup_steps=warmup, skipped_steps=skipped, step_s=times,
                   median_s=statistics.median(times), min_s=min(times), first_loss=losses[0], last_loss=losses[-1])
        rec["tokens_per_s"] = tokens / rec["median_s"]
        rec["model_tflops"] = model.flops_per_token() * rec["tokens_per_s"] / 1e12
        peak = peak_tflops(device, rec["dtype"], runner.tf32, args.peak_tflops)
        rec["peak_tflops"] = peak
        rec["mfu"] = rec["model_tflops"] / peak if peak else None
        if device.type == "cuda":
            rec["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
        if not all(math.isfinite(x) for x in losses):
            rec["note"] = "non-finite loss"
    except RowSkipped as err:
        rec.update(status="skipped", reason=str(err))
    except torch.OutOfMemoryError as err:
        rec.update(status="OOM", reason=short_error(err, 200).split(" Tried")[0][:120])
        if device.type == "cuda":
            rec["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    except Exception as err:  # noqa: BLE001 - one broken row must not end the benchmark
        rec.update(status="failed", reason=short_error(err, 200))
        traceback.print_exc()
    finally:
        runner = None
        _free(device)
    return rec


# ============================================================================ profile
def profile_row(row: str, key: str, args, device, log) -> str:
    """torch.profiler over a few steps of one row (after warmup): the top kernels by total time, and all of
    them by kind (megatron_mini.profiling.tables, as a training run's profile.* writes them)."""
    from torch.profiler import ProfilerActivity, profile
    model, mbs, m = model_config(key, args.smoke, args.vocab)
    runner, compiled = build(row, model, mbs, m, device, args.smoke)
    try:
        warmup = args.warmup + (args.compile_warmup_extra if compiled else 0)
        for _ in range(warmup):
            runner.step()
        _sync(device)
        cuda = device.type == "cuda"
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(args.profile_steps):
                runner.step()
            _sync(device)
            wall = time.perf_counter() - t0
        if args.trace:
            write_output(args.trace, prof.export_chrome_trace)
            log(f"wrote the chrome trace {args.trace}")
    finally:
        runner = None
        _free(device)
    events = busy(prof, cuda)
    steps, wall_ms = args.profile_steps, wall * 1e3
    total = sum(ms for _, _, ms in events)
    what = "CUDA kernels" if cuda else "CPU ops (no CUDA: smoke run)"
    head = (f"profile of {key} / {row} ({ROW_TEXT[row]}): {steps} step{'s' * (steps != 1)} after {warmup} warmup "
            f"step{'s' * (warmup != 1)}; "
            f"step {wall_ms / steps:.1f} ms (wall, profiler on); {what} busy {total / steps:.1f} ms per step "
            f"({100 * total / wall_ms:.0f}% of the wall time); top {min(len(events), args.profile_top)} of "
            f"{len(events)} by total time:")
    return head + "\n\n" + tables(events, steps, wall_ms, args.profile_top)


# ============================================================================ tables and goals
def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def model_table(recs: list) -> str:
    ref = next((r for r in recs if r["row"] == REFERENCE and r["status"] == "ok"), None)
    lines = []
    for r in recs:
        if r["status"] != "ok":
            lines.append([r["row"], r["config"]] + ["-"] * 6 + [f"{r['status']}: {r.get('reason', '')}"])
            continue
        notes = []
        if r.get("skipped_steps"):
            notes.append(f"{r['skipped_steps']} of {r['steps']} steps skipped (overflow)")
        if r.get("note"):
            notes.append(r["note"])
        notes.append(f"loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}")
        lines.append([r["row"], r["config"], f"{r['median_s'] * 1e3:.1f}", f"{r['tokens_per_s']:,.0f}",
                      f"{r['model_tflops']:.1f}", _pct(r.get("mfu")),
                      fmt(r.get("peak_mem_gib"), ".1f"),
                      fmt(ratio(r["tokens_per_s"], ref["tokens_per_s"]) if ref else None, ".3f"),
                      "; ".join(notes)])
    return markdown_table(["row", "configuration", "ms/step (median)", "tokens/s", "model TFLOP/s per GPU", "MFU",
                           "peak mem GiB", f"x {REFERENCE}", "notes"], lines)


def model_goals(key: str, recs: list, smoke: bool) -> list:
    """[goal, measured, target, result] of issues 10 and 9 for one model."""
    by = {r["row"]: r for r in recs if r["status"] == "ok"}
    name = recs[0]["model_name"] if recs else key
    out = []

    def add(goal, num, den, target, what="x", same=None):
        tgt = f">= {target}x" if what == "x" else f">= {100 * target:.0f}%"
        if same:                          # two rows of one code path: their ratio is run-to-run noise
            out.append([goal, "-", tgt, f"same code path ({same})"])
            return
        if num is None or den is None:
            why = "no peak TFLOP/s for MFU: --peak-tflops" if what == "%" and "default" in by else "a row did not run"
            out.append([goal, "-", tgt, f"not measured ({why})"])
            return
        value = num / den if what == "x" else num
        shown = f"{value:.3f}x" if what == "x" else f"{100 * value:.1f}%"
        if smoke:
            verdict = "n/a (smoke run)"
        else:
            verdict = "met" if value >= target else f"MISSED by {100 * (1 - value / target):.1f}%"
        out.append([goal, shown, tgt, verdict])

    tok = lambda row: by[row]["tokens_per_s"] if row in by else None  # noqa: E731
    mfu = lambda row: by[row].get("mfu") if row in by else None       # noqa: E731
    if key in ("small", "medium"):
        add(f"issue 10: {name} default / compiled baseline (tokens/s)", tok("default"), tok(REFERENCE), 1.15)
    if key == "small":
        add(f"issue 10: {name} default MFU", mfu("default"), 1, 0.43, "%")
        ops = [by[row].get("triton_ops") if row in by else None for row in ("default", "torch")]
        same = ops[0] == ops[1] == [] and "kernels=auto selects no Triton kernel here"
        add(f"issue 9: {name} kernels=auto / kernels=torch", tok("default"), tok("torch"), 1.0, same=same)
        add(f"issue 9: {name} kernels=triton / kernels=torch", tok("triton"), tok("torch"), 1.1)
    if key == "1.3b":
        add(f"issue 10: {name} default MFU", mfu("default"), 1, 0.62, "%")
    add(f"issue 10: {name} fp16 / bf16 (default config)", tok("fp16"), tok("default"), 0.97)
    return out


def model_section(key: str, recs: list, smoke: bool) -> str:
    """One model's subsection: shape, device(s), command(s), the table and the goals; `recs` may mix
    rows of several commands (--doc keeps the rows a later command did not rerun)."""
    r0 = recs[0]
    head = (f"### {r0.get('model_name', key)}: mbs {r0.get('mbs')} x {r0.get('microbatches')} microbatches x seq "
            f"{r0.get('seq_len')} ({r0.get('tokens_per_step', 0):,} tokens per step), vocabulary {r0.get('vocab')}")
    parts = [head, ""]
    devices = list(dict.fromkeys(r.get("device", "?") for r in recs))
    parts += [f"- device: {d}" for d in devices]
    runs = {}
    for r in recs:
        runs.setdefault((r.get("command", "?"), r.get("date", "?")), []).append(r["row"])
    if len(runs) == 1:
        (cmd, date), = runs
        parts.append(f"- command: `{cmd}` ({date})")
    else:
        parts += [f"- rows {', '.join(rows)}: `{cmd}` ({date})" for (cmd, date), rows in runs.items()]
    ok = [r for r in recs if r["status"] == "ok"]
    if ok:
        steps = ok[0]["steps"]
        eager, compiled = (warmups([r for r in ok if bool(r.get("compiled")) == c]) for c in (False, True))
        first = eager or compiled
        warmup = (f"{first} warmup step{'s' * (first != '1')}"
                  + (f" (compiled rows: {compiled})" if eager and compiled and compiled != eager else ""))
        parts.append(f"- {steps} timed step{'s' * (steps != 1)} per row after {warmup}; peak TFLOP/s for MFU: "
                     + ", ".join(sorted({f"{r['dtype']} {fmt(r.get('peak_tflops'), '.0f')}" for r in ok})))
    if smoke:
        parts.append("- **smoke run** (tiny model): these figures say nothing about speed.")
    parts += ["", model_table(recs), "", markdown_table(["goal", "measured", "target", "result"],
                                                        model_goals(key, recs, smoke))]
    return "\n".join(parts)


def warmups(recs: list) -> str:
    """The rows' warmup step counts, '3' or '3/4' ('' for no rows)."""
    return "/".join(str(w) for w in sorted({r["warmup_steps"] for r in recs}))


DOC_HEAD = """## Training throughput on one GPU (issues 10 and 9): `make bench-gpu`

Written by `tools/bench_gpu.py --doc`; a model's subsection is rewritten when that model is rerun, keeping
the rows the new command did not run (each row names its command). This project (TrainConfig built in
code, tp=pp=dp=1, one process) against the project's plain GPT-2 (`tools/baseline_gpt2.py`: nanoGPT's
model and step, bf16 autocast, fused AdamW, SDPA), eager and with `torch.compile`, in one process on one
GPU, on the same synthetic tokens and batch. A row's figure is the median of its timed steps
(torch.cuda.synchronize + perf_counter around each step, after warmup); model FLOPs per token
6N + 12·L·h·s with N = 12·L·h² + V·h (MLP width 4h); MFU against the dense peak of the device and dtype
(megatron_mini.hardware); peak memory = torch.cuda.max_memory_allocated over the row's build and steps.
The method and the row definitions are in the docstring of tools/bench_gpu.py."""

DOC_FIELDS = ("model", "model_name", "vocab", "row", "config", "dtype", "mbs", "microbatches", "seq_len",
              "tokens_per_step", "status", "reason", "steps", "warmup_steps", "skipped_steps", "median_s",
              "tokens_per_s", "model_tflops", "peak_tflops", "mfu", "peak_mem_gib", "first_loss", "last_loss",
              "note", "triton_ops", "compiled", "command", "date", "device")
DATA_TAG = "<!-- bench_gpu data: "


def _data_comment(recs: list) -> str:
    data = [{k: r[k] for k in DOC_FIELDS if k in r} for r in recs]
    return DATA_TAG + json.dumps(data, separators=(",", ":")).replace(">", "\\u003e") + " -->"


def _old_records(old: str, key: str) -> list:
    begin, end = f"<!-- bench_gpu {key} begin -->", f"<!-- bench_gpu {key} end -->"
    if begin not in old or end not in old:
        return []
    text = old[old.index(begin):old.index(end)]
    if DATA_TAG not in text:
        return []
    blob = text[text.index(DATA_TAG) + len(DATA_TAG):]
    try:
        return json.loads(blob[:blob.index(" -->")])
    except ValueError:
        return []


def write_doc(path: str, records: dict, smoke: bool = False) -> None:
    """The bench_gpu section: DOC_HEAD, then one subsection per model; models not in `records` are kept
    as they were, and a rerun model keeps its rows that this run did not measure."""
    old = read_doc_section(path, "bench_gpu") or ""
    keys = list(MODELS) + [k for k in records if k not in MODELS]
    body = [DOC_HEAD]
    for key in keys:
        begin, end = f"<!-- bench_gpu {key} begin -->", f"<!-- bench_gpu {key} end -->"
        if key in records and records[key]:
            new_rows = {r["row"] for r in records[key]}
            merged = list(records[key]) + [r for r in _old_records(old, key) if r.get("row") not in new_rows]
            merged.sort(key=lambda r: ROWS.index(r["row"]) if r["row"] in ROWS else len(ROWS))
            text = model_section(key, merged, smoke) + "\n\n" + _data_comment(merged)
        elif begin in old and end in old:
            text = old[old.index(begin) + len(begin):old.index(end)].strip("\n")
        else:
            continue
        body.append(f"{begin}\n{text}\n{end}")
    write_doc_section(path, "bench_gpu", "\n\n".join(body))


# ============================================================================ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=RawDescriptionDefaultsHelp)
    ap.add_argument("--models", default="small,medium,1.3b", help=f"comma list of {', '.join(MODELS)}")
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {', '.join(ROWS)}")
    ap.add_argument("--steps", type=at_least(1), default=None, help="timed steps per row (default: 10; 2 with --smoke)")
    ap.add_argument("--vocab", type=at_least(128), default=VOCAB,
                    help="the models' vocabulary (50304: GPT-2's, padded; not in a smoke run)")
    ap.add_argument("--warmup", type=at_least(0), default=None,
                    help="warmup steps per row (default: 3; 1 with --smoke)")
    ap.add_argument("--compile-warmup-extra", type=at_least(0), default=2,
                    help="extra warmup steps of compiled rows")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the device's dense peak TFLOP/s for MFU (default: megatron_mini.hardware's table)")
    ap.add_argument("--profile", metavar="ROW", default=None,
                    help="instead of the benchmark: torch.profiler over a few steps of ROW for each model")
    ap.add_argument("--profile-steps", type=at_least(1), default=3, help="profiled steps")
    ap.add_argument("--profile-top", type=at_least(1), default=25, help="rows of the profile's table")
    ap.add_argument("--trace", default=None, help=f"with --profile: also write a chrome trace here ({CREATED})")
    ap.add_argument("--smoke", action="store_true", help="tiny model, 2 steps per row, no compile "
                    "(automatic without CUDA); exercises the code only")
    add_output_args(ap, "bench_gpu")
    args = ap.parse_args(argv)
    check_output_args(ap, args)
    refuse_unwritable(ap, "--trace", args.trace)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    keys = [k.strip() for k in args.models.split(",") if k.strip()]
    unknown = [f"unknown {flag} {bad}" for flag, bad in (("--rows", [r for r in rows if r not in ROWS]),
                                                          ("--models", [k for k in keys if k not in MODELS])) if bad]
    if not rows or not keys or unknown:
        ap.error("; ".join(unknown + [f"--rows from {ROWS}; --models from {list(MODELS)} (at least one of each)"]))
    if args.profile and args.profile not in ROWS:
        ap.error(f"--profile ROW: one of {ROWS}")
    if args.trace and not args.profile:
        ap.error("--trace is the trace of --profile ROW's steps: name the row to profile")
    if args.peak_tflops is not None and not 0 < args.peak_tflops < math.inf:
        ap.error(f"--peak-tflops must be a finite number > 0, got {args.peak_tflops}")

    import torch
    cuda = torch.cuda.is_available()
    args.smoke = args.smoke or not cuda
    if args.smoke:
        keys = ["smoke"]
    if cuda:
        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
    else:   # before the model imports the kernels: kernels=triton runs under the interpreter
        os.environ["TRITON_INTERPRET"] = "1"
        torch.set_num_threads(min(2, os.cpu_count() or 1))
        device = torch.device("cpu")
    args.steps = args.steps or (2 if args.smoke else 10)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 3)
    t_start = time.time()

    def log(msg):
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    dev_text, command = device_line(with_date=False), command_line("bench_gpu.py")
    print(f"device: {dev_text}, {time.strftime('%Y-%m-%d %H:%M')}\ncommand: {command}", flush=True)
    if args.smoke:
        print("SMOKE RUN: tiny model, no torch.compile; exercises the code, claims no speed.", flush=True)
    doc = None if args.doc is None else args.doc or (None if args.smoke else DOC)
    if args.smoke and args.doc == "" and not args.profile:
        print("smoke run: not writing docs/benchmarks.md (name a file: --doc PATH)")
    _init_one_rank_group()
    try:
        if args.profile:
            for key in keys:
                try:
                    print("\n" + profile_row(args.profile, key, args, device, log), flush=True)
                except RowSkipped as err:
                    print(f"cannot profile {key} / {args.profile}: {err}")
            return 0
        results, by_model = [], {}
        date = time.strftime("%Y-%m-%d %H:%M")
        for key in keys:
            recs = by_model[key] = []
            for row in rows:
                log(f"{key} / {row}: {ROW_TEXT[row]}")
                rec = measure_row(row, key, args, device)
                rec.update(command=command, date=date, device=dev_text)
                recs.append(rec)
                results.append(rec)
                if rec["status"] == "ok":
                    log(f"  {rec['median_s'] * 1e3:.1f} ms/step, {rec['tokens_per_s']:,.0f} tokens/s, "
                        f"{rec['model_tflops']:.1f} TFLOP/s, MFU {_pct(rec['mfu'])}, "
                        f"peak {fmt(rec.get('peak_mem_gib'), '.1f')} GiB (build {rec['build_s']:.1f} s, warmup "
                        f"{rec['warmup_s']:.1f} s, loss {rec['first_loss']:.3f} -> {rec['last_loss']:.3f})")
                else:
                    log(f"  {rec['status']}: {rec.get('reason', '')}")
                if rec.get("mem_at_start_gib", 0) > 0.25:
                    log(f"  WARNING: {rec['mem_at_start_gib']:.2f} GiB were still allocated when this row started")
                if args.out:
                    _write_out(args.out, dev_text, command, results, by_model, args.smoke)
                if doc:                   # after every row: a call cut off by its time limit keeps the rows it ran
                    write_doc(doc, by_model, args.smoke)
        if doc:
            print(f"wrote the bench_gpu section of {doc}")
        log("done")
        for key in keys:
            print("\n" + model_section(key, by_model[key], args.smoke))
    finally:
        _destroy_group()
    return 0


def _write_out(out: str, dev_text: str, command: str, results: list, by_model: dict, smoke: bool) -> None:
    write_text(os.path.join(out, "bench_gpu.json"),
               json.dumps({"device": dev_text, "command": command, "results": results}, indent=1, default=str))
    write_text(os.path.join(out, "bench_gpu.md"),
               "\n\n".join(model_section(k, recs, smoke) for k, recs in by_model.items() if recs) + "\n")


def _init_one_rank_group() -> None:
    """A one-rank gloo group (size-1 groups make no collectives; it is there for code that asks the group)."""
    import torch.distributed as dist
    if dist.is_initialized():
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def _destroy_group() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    run_tool(main)
