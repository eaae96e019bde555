"""torch.profiler over chosen steps of a run (`profile.*`: StepProfiler), and the tables a profile is read by
(`tables`: the top kernels, and every kernel summed by kind), which tools/bench_gpu.py --profile prints too.

    profile.start=10 profile.steps=2 profile.ranks=[0,8]

Ranks 0 and 8 trace steps 10 and 11 (step 9 runs with the profiler warming up, unrecorded) and write
`run_dir/profile/step_000010-000011/rank0000.json.gz` (a Chrome trace: https://ui.perfetto.dev or
chrome://tracing), and `rank0000.txt`, its tables. In the trace each step is a range `step N` and each action
of the pipeline schedule one of its own (`forward(c0, mb3)`, `send_act(c0, mb3)->1`): where a rank waits.
"""
from __future__ import annotations

import collections
import contextlib
import gzip
import logging
import os
import shutil
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from .config import ProfileConfig

# this project's Triton kernels, by name (kernels/layernorm.py, attention_kernels.py, cross_entropy.py)
OWN_KERNELS = frozenset({"_fwd", "_bwd", "_fwd_looped", "_bwd_row_sums", "_bwd_looped", "_bwd_delta", "_bwd_dkdv",
                         "_bwd_dq", "_stats", "_grad"})
# (kind, substrings of a lowercased CUDA kernel or CPU op name): the first kind that matches, else "other";
# the order matters (NCCL's names hold "reduce", inductor's "attention", memory-efficient SDPA's "cutlass")
KERNEL_KINDS = (
    ("collectives", ("nccl", "gloo", "all_reduce", "allreduce", "all_gather", "reduce_scatter")),
    ("GEMM", ("triton_tem",)),
    ("inductor's fused kernels", ("triton_",)),
    ("attention (SDPA)", ("sdpa", "flash", "fmha", "attention")),
    ("GEMM", ("gemm", "gemv", "splitkreduce", "nvjet", "cutlass", "xmma", "cublas", "aten::mm", "aten::addmm",
              "aten::bmm")),                       # (cuBLAS's one-row products, and its split-K GEMMs' sums)
    ("LayerNorm (torch)", ("layer_norm", "layernorm", "gammabeta")),
    ("optimizer", ("adam", "multi_tensor")),
    ("reductions", ("reduce", "aten::sum", "norm")),
    ("copies", ("copy", "memcpy", "catarray", "aten::cat")),
    ("elementwise", ("elementwise", "aten::add", "aten::mul")),
)


def kernel_kind(name: str) -> str:
    if name in OWN_KERNELS:
        return "this project's Triton kernels"
    low = name.lower()
    return next((kind for kind, parts in KERNEL_KINDS if any(p in low for p in parts)), "other")


def busy(prof, cuda: bool) -> list:
    """[(name, calls, self ms)] of the profile's CUDA kernels (`cuda`) or CPU ops, the longest first. The ranges of
    record_function ("step 4", "forward(c0, mb3)", the schedule's ProfilerStep#N) are left out, as torch's own table
    leaves them out of its "Self CUDA time total": on CUDA each comes back as a device event as long as the kernels
    it spans (kineto's gpu_user_annotation), on a CPU its self time is the host's between its ops (Python's). They
    are told apart by is_user_annotation, which not every torch >= 2.4 gives its averages: there only ProfilerStep#N
    is left out, and the step's own ranges are rows (and in a CPU's sum) as before."""
    from torch.autograd import DeviceType
    kind = DeviceType.CUDA if cuda else DeviceType.CPU

    def self_us(e):
        if cuda:
            return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
        return e.self_cpu_time_total
    events = [(e.key, e.count, self_us(e) / 1e3) for e in prof.key_averages() if e.device_type == kind
              and self_us(e) > 0 and not getattr(e, "is_user_annotation", False)
              and not e.key.startswith("ProfilerStep")]     # (a torch whose averages do not say is_user_annotation)
    return sorted(events, key=lambda e: e[2], reverse=True)


def markdown_table(headers: list, rows: list) -> str:
    lines = ["| " + " | ".join(map(str, headers)) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def tables(events: list, steps: int, wall_ms: float, top: int) -> str:
    """Markdown: the `top` events of `busy` by total time (each per step and as a share of the wall time
    `wall_ms` over which `steps` steps were profiled), then all of them summed by kind (KERNEL_KINDS)."""
    lines = [[(name[:100] + "...") if len(name) > 100 else name, calls, f"{ms:.2f}", f"{ms / steps:.2f}",
              f"{100 * ms / wall_ms:.1f}"] for name, calls, ms in events[:top]]
    kinds = collections.Counter()
    for name, _, ms in events:
        kinds[kernel_kind(name)] += ms
    by_kind = [[k, f"{ms / steps:.2f}", f"{100 * ms / wall_ms:.1f}"] for k, ms in kinds.most_common()]
    return (markdown_table(["name", "calls", "total ms", "ms per step", "% of wall"], lines)
            + f"\n\nAll {len(events)} by kind (profiling.KERNEL_KINDS):\n\n"
            + markdown_table(["kind", "ms per step", "% of wall"], by_kind))


def _export(prof, tmp: str, path: str) -> None:
    """The Chrome trace of `prof` at `path`, gzipped, whole or not at all: written to tmp.json beside it (torch's
    own .gz export writes the JSON to the system's temporary directory first, and a write that fails there leaves
    a truncated trace and raises nothing), checked to end as a JSON object does, gzipped to tmp.json.gz, renamed."""
    prof.export_chrome_trace(tmp + ".json")
    with open(tmp + ".json", "rb") as f:
        f.seek(max(os.fstat(f.fileno()).st_size - 64, 0))
        if not f.read().rstrip().endswith(b"}"):
            raise OSError(f"the trace torch wrote ({tmp}.json) is cut short: is its disk full?")
        f.seek(0)
        with gzip.open(tmp + ".json.gz", "wb") as out:
            shutil.copyfileobj(f, out)
    os.unlink(tmp + ".json")
    os.replace(tmp + ".json.gz", path)


class StepProfiler:
    """torch.profiler over steps [cfg.start, cfg.start + cfg.steps) of a run (those it runs: a run that ends
    or stops earlier writes what it recorded: close()), on the ranks cfg.ranks names (None: every rank); the step
    before start, where the run has it, warms the profiler up unrecorded. The run's steps are first_step + 1 to
    last_step. Each rank writes its own files (no collective); a failed write is a warning in its log, and
    training goes on."""

    def __init__(self, cfg: ProfileConfig, run_dir: str, rank: int, device: torch.device, first_step: int,
                 last_step: int, log: logging.Logger):
        self.start, self.end = cfg.start, min(cfg.start + cfg.steps, last_step + 1) - 1
        self.run_dir, self.rank, self.device, self.log = run_dir, rank, device, log
        chosen = cfg.start > 0 and (cfg.ranks is None or rank in cfg.ranks)
        ahead = cfg.start > first_step
        self.on = chosen and ahead
        where = os.path.join(run_dir, "profile")
        self.note = (None if cfg.start == 0 else
                     f"profile: this run starts after step {first_step}, past profile.start={cfg.start}: nothing "
                     f"is profiled" if not ahead else
                     f"profile: this rank traces steps {self.start}-{self.end} into {where}/" if chosen else
                     f"profile: rank{'s' if len(cfg.ranks) > 1 else ''} {', '.join(map(str, cfg.ranks[:8]))} "
                     f"{'trace' if len(cfg.ranks) > 1 else 'traces'} steps {self.start}-{self.end} into {where}/ "
                     f"(not this one)")
        self.activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.prof, self.recorded, self.wall, self.window, self.window_wall = None, [], 0.0, 0.0, 0.0
        self.stepping = None         # the step running (one that raised stays: its time and ops are said apart)
        self.overhead = 0.0          # seconds spent starting, stepping, stopping the profiler and writing its files

    @contextlib.contextmanager
    def step(self, step: int):
        """Around the run's step `step` (1-based): the profiler starts before the window (or at its first step),
        records the window's steps, each a range "step N", and what runs between them (an evaluation, a save), and
        writes its files after the last."""
        if not self.on or not self.start - 1 <= step <= self.end:
            yield
            return
        began = time.perf_counter()
        if self.prof is None:
            warmup = int(step < self.start)
            with warnings.catch_warnings():     # (warmup=0, where no step comes before the window: said above)
                warnings.filterwarnings("ignore", "Profiler won't be using warmup")
                self.prof = profile(activities=self.activities, on_trace_ready=self._write,
                                    schedule=schedule(wait=0, warmup=warmup, active=self.end - step + 1 - warmup,
                                                      repeat=1))
            self.prof.start()
        t0 = time.perf_counter()
        self.overhead += t0 - began
        if step == self.start:
            self.window = t0
        self.stepping = step
        with record_function(f"step {step}"):
            yield
        self.stepping = None
        if step >= self.start:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)      # (the step's last kernels: AdamW's)
            self.wall += time.perf_counter() - t0
            self.window_wall = time.perf_counter() - self.window
            self.recorded.append(step)
        began = time.perf_counter()
        self.prof.step()
        if step == self.end:
            self.close()
        self.overhead += time.perf_counter() - began

    def take_overhead(self) -> float:
        """The seconds the profiler itself took in the steps since the last call (its start, the transitions of its
        schedule, and after the window's last step its stop and the writing of its files: seconds, 40 times a step
        of the tests' small model), which a step line's rate leaves out; the profiled steps' own slowdown stays in."""
        seconds, self.overhead = self.overhead, 0.0
        return seconds

    def close(self) -> None:
        """Stop the profiler (after the window's last step, or where the run stops inside it, before its last
        save, or where a step raised): what it recorded is written, the time since the window's last whole step
        counted as between steps."""
        prof, self.prof = self.prof, None
        if prof is not None:
            if self.recorded:
                self.window_wall = time.perf_counter() - self.window
            prof.stop()

    def _write(self, prof) -> None:
        if not self.recorded:
            return
        first, last, steps = self.recorded[0], self.recorded[-1], len(self.recorded)
        self.recorded = []                       # (written once)
        where = os.path.join(self.run_dir, "profile", f"step_{first:06d}-{last:06d}")
        name = f"rank{self.rank:04d}"
        tmp = os.path.join(where, f".{name}.tmp{os.getpid()}")
        try:
            os.makedirs(where, exist_ok=True)
            _export(prof, tmp, os.path.join(where, f"{name}.json.gz"))
            cuda = self.device.type == "cuda"
            wall_ms, between_ms = 1e3 * self.window_wall, 1e3 * (self.window_wall - self.wall)
            events = busy(prof, cuda)
            raised = self.stepping is not None
            what = f"and in step {self.stepping}, which raised" if raised else "(an evaluation, a save)"
            between = (f"; {between_ms:.1f} ms between them {what} (their ops are in the trace and the tables too)"
                       if between_ms > 0.02 * wall_ms or raised else "")
            head = (f"profile of steps {first}-{last} on rank {self.rank}: {1e3 * self.wall / steps:.1f} ms a step "
                    f"(wall, profiler on){between}; {'CUDA kernels' if cuda else 'CPU ops'} busy "
                    f"{sum(ms for _, _, ms in events) / steps:.1f} ms a step\n\n")
            with open(os.path.join(where, f"{name}.txt"), "w", encoding="utf-8") as f:
                f.write(head + tables(events, steps, wall_ms, 30) + "\n")
        except Exception as e:       # noqa: BLE001 - a profile is a diagnosis: training goes on without it
            for left in (tmp + ".json", tmp + ".json.gz"):
                with contextlib.suppress(OSError):
                    os.unlink(left)
            self.log.info(f"warning: rank {self.rank} could not write its profile to {where} "
                          f"({type(e).__name__}: {e}); training goes on")
            return
        self.log.info(f"profile: steps {first}-{last} of rank {self.rank} in {where}/{name}.json.gz (a Chrome "
                      f"trace: https://ui.perfetto.dev), its tables in {name}.txt")
