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

Method. Every configuration of a section is built once and kept alive: single-process ones in
this process (torch.set_num_threads(2)), multi-rank ones in persistent pools of spawned gloo
ranks (1 thread each) that wait on a queue between commands. After one warmup step each, the
rows are measured in interleaved rounds (row A one step, row B one step, ..., order reversed
every round), so the noise of a shared machine hits every row alike; a row's figure is the
median of its steps. A multi-rank step is the slowest rank's wall time (ranks start each round
from a barrier). Model FLOPs per step = 6*N*T + 12*L*h*s*T with N = 12*L*h^2 + V*h (matmul
weights: QKV, attention output, MLP, and the tied output projection; V the padded vocabulary),
T tokens per step.

Activation memory = the peak, over a training step, of the bytes of tensors saved for backward
alive at once: torch.autograd.graph.saved_tensors_hooks counts a saved tensor's storage on
pack (each storage once, parameters excluded) and releases it when autograd drops the packed
object (a weakref finalizer). Checkpointed regions count their saved inputs (non-reentrant
checkpoint saves them under the outer hooks); the transient recomputed activations of the one
region being back-propagated are not counted.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import re
import shlex
import socket
import statistics
import sys
import time
import traceback
import weakref
from dataclasses import replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (REPO, os.path.join(REPO, "tools")):
    if path not in sys.path:
        sys.path.insert(0, path)
os.environ.setdefault("WANDB_MODE", "disabled")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from megatron_mini.config import ModelConfig, PrecisionConfig, TrainConfig, WandbConfig  # noqa: E402

MIB = 2 ** 20
S2 = ModelConfig(name="S2", num_layers=4, hidden_size=256, num_heads=8, seq_len=256, vocab_size=1024)
MBS, GBS = 8, 32
DEFAULT_STEPS = {1: 20, 2: 10, 3: 8, 4: 8}
DOC = os.path.join(REPO, "docs", "benchmarks.md")


# ============================================================================ configs and FLOPs
def lib_cfg(model: ModelConfig | None = None, **overrides) -> TrainConfig:
    cfg = TrainConfig(model=model or S2, mbs=MBS, gbs=GBS, steps=100_000, kernels="torch", device="cpu",
                      wandb=WandbConfig(mode="disabled"), log_interval=10 ** 9, eval_interval=0, resume="never")
    for key, value in overrides.items():
        if key == "dtype":
            cfg = replace(cfg, precision=PrecisionConfig(dtype=value))
        else:
            cfg = replace(cfg, **{key: value})
    return cfg


class SyntheticTokens:
    """Seeded random token ids < vocab: item i is the same array whoever asks."""

    def __init__(self, vocab: int, seq_len: int, seed: int):
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, int(i)])
        return rng.integers(0, self.vocab, self.seq_len + 1, dtype=np.int64)


# ============================================================================ measurement
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


class LibRunner:
    """One megatron_mini Trainer on synthetic data."""

    def __init__(self, cfg: TrainConfig, mesh):
        from megatron_mini.training import Trainer
        data = (SyntheticTokens(cfg.model.vocab_size, cfg.model.seq_len, 1),
                SyntheticTokens(cfg.model.vocab_size, cfg.model.seq_len, 2), None)
        self.cfg, self.mesh = cfg, mesh
        self.trainer = Trainer(cfg, mesh, data, torch.device("cpu"))

    def params(self):
        return [p for c in self.trainer.chunks for p in c.parameters()]

    def step(self) -> float:
        return self.trainer.train_step()["loss"]

    def optimizer_state_bytes(self) -> dict:
        master = moments = 0
        for r in self.trainer.optimizer.ranges:
            if r.master.data_ptr() != r.param.data_ptr():
                master += r.master.numel() * r.master.element_size()
            moments += sum(t.numel() * t.element_size() for t in (r.exp_avg, r.exp_avg_sq))
        params = sum(p.numel() for p in self.params())
        return {"master": master, "moments": moments, "params": params}


class BaselineRunner:
    def __init__(self, model: ModelConfig, mbs: int, accum: int):
        from baseline_gpt2 import BaselineTrainer, GPTConfig
        cfg = GPTConfig(model.num_layers, model.num_heads, model.hidden_size, model.seq_len, model.vocab_size)
        self.trainer = BaselineTrainer(cfg, mbs, accum)

    def params(self):
        return list(self.trainer.model.parameters())

    def step(self) -> float:
        return self.trainer.train_step()


def _trace_stats(trace) -> dict:
    """Busy (forward/backward) and span of one step's engine trace; peak in-flight microbatches."""
    busy = sum(t1 - t0 for a, t0, t1 in trace if a.op in ("forward", "backward"))
    in_flight = peak = 0
    for a, _, _ in trace:
        if a.op == "forward":
            in_flight += 1
            peak = max(peak, in_flight)
        elif a.op == "backward":
            in_flight -= 1
    return {"busy": busy, "start": trace[0][1], "end": trace[-1][2], "in_flight": peak}


def handle(state: dict, op: str, args: tuple):
    """Commands run identically by this process (world 1) and by every rank of a pool."""
    objs = state["objs"]
    if op == "build":
        key, spec = args
        if spec[0] == "baseline":
            objs[key] = BaselineRunner(*spec[1:])
        else:
            from megatron_mini.mesh import ParallelMesh
            cfg = spec[1]
            layout = (cfg.tp, cfg.pp, state["world"] // (cfg.tp * cfg.pp))
            if layout not in state["meshes"]:
                state["meshes"][layout] = ParallelMesh(*layout)
            objs[key] = LibRunner(cfg, state["meshes"][layout])
        return None
    if op == "ping":
        return os.getpid()
    if op == "drop":
        objs.pop(args[0], None)
        gc.collect()
        return None
    if op == "opt_bytes":
        return objs[args[0]].optimizer_state_bytes()
    if op == "steps":
        key, n, flags = args
        runner = objs[key]
        if state["world"] > 1:
            torch.distributed.barrier()
        records = []
        for _ in range(n):
            rec = {}
            meter = None
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
                rec.update(_trace_stats(runner.trainer.engine.trace))
            records.append(rec)
        return records
    raise ValueError(op)


# ============================================================================ executors
class Local:
    """Runs commands in this process, 2 intra-op threads: the tp=pp=dp=1 and baseline rows."""

    def __init__(self, threads: int = 2):
        torch.set_num_threads(threads)
        self.desc, self.world = f"1 process x {threads} threads", 1
        self.state = {"world": 1, "meshes": {}, "objs": {}}

    def call(self, op, *args) -> list:
        return [handle(self.state, op, args)]

    def close(self):
        self.state["objs"].clear()


def _pool_rank(rank: int, world: int, port: int, commands, results):
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WANDB_MODE="disabled")
    for path in (REPO, os.path.join(REPO, "tools")):
        if path not in sys.path:
            sys.path.insert(0, path)
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=3600))
    state = {"world": world, "meshes": {}, "objs": {}}
    while True:
        op, args = commands.get()
        if op == "stop":
            break
        try:
            results.put((rank, True, handle(state, op, args)))
        except BaseException:  # noqa: BLE001 - reported by the parent
            results.put((rank, False, traceback.format_exc()))
    torch.distributed.destroy_process_group()


class Pool:
    """`world` spawned gloo ranks (1 thread each), kept alive across commands."""

    def __init__(self, world: int, tries: int = 5):
        self.desc, self.world = f"{world} ranks x 1 thread", world
        for attempt in range(tries):
            self._spawn()
            try:
                self.call("ping", timeout=180)
                return
            except RuntimeError as e:     # e.g. the free port was taken by another process meanwhile
                self.close(kill=True)
                if attempt == tries - 1:
                    raise
                print(f"  pool of {world} did not start ({str(e).splitlines()[0]}); retrying on a new port")

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(self.world)]
        self.procs = [ctx.Process(target=_pool_rank, args=(r, self.world, port, self.commands[r], self.results),
                                  daemon=True) for r in range(self.world)]
        for p in self.procs:
            p.start()

    def call(self, op, *args, timeout: float | None = None) -> list:
        for q in self.commands:
            q.put((op, args))
        out, start = {}, time.time()
        while len(out) < self.world:
            try:
                rank, ok, value = self.results.get(timeout=10)
            except Exception:  # noqa: BLE001 - queue.Empty: check the ranks are alive
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"pool rank(s) {dead} died during {op}") from None
                if timeout is not None and time.time() - start > timeout:
                    raise RuntimeError(f"pool did not answer {op} within {timeout} s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed in {op}:\n{value}")
            out[rank] = value
        return [out[r] for r in range(self.world)]

    def close(self, kill: bool = False):
        for q in self.commands:
            q.put(("stop", ()))
        for p in self.procs:
            p.join(timeout=1 if kill else 30)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


# ============================================================================ measuring rows
class Row:
    """One configuration on one executor: its per-step records (ranks combined)."""

    def __init__(self, name: str, ex, spec, model: ModelConfig | None = None, tokens: int | None = None,
                 threads: int = 2):
        self.name, self.ex, self.spec = name, ex, spec
        self.model, self.tokens = model or S2, tokens or GBS * S2.seq_len
        self.key = name
        self.threads = threads if isinstance(ex, Local) else ex.world
        self.steps, self.per_rank = [], []
        ex.call("build", self.key, spec)

    def run(self, n: int, flags=()) -> list:
        ranks = self.ex.call("steps", self.key, n, tuple(flags))
        combined = []
        for i in range(n):
            recs = [r[i] for r in ranks]
            combined.append({"wall": max(r["wall"] for r in recs), "cpu": sum(r["cpu"] for r in recs),
                             "loss": recs[0]["loss"]})
        return combined, ranks

    def drop(self):
        self.ex.call("drop", self.key)

    @property
    def median_wall(self) -> float:
        return statistics.median(s["wall"] for s in self.steps)

    @property
    def min_wall(self) -> float:
        return min(s["wall"] for s in self.steps)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.median_wall

    @property
    def tflops(self) -> float:
        return self.model.flops_per_token() * self.tokens / self.median_wall / 1e12

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.tokens / statistics.median(s["cpu"] for s in self.steps)


LOADS = []   # 1-minute load averages sampled during the run (every round)


def measure(rows: list, steps: int, flags=(), warmup: int = 1, log=print) -> None:
    """Warm up every row, then `steps` interleaved rounds of one step per row (order alternating)."""
    for row in rows:
        if warmup:
            t0 = time.perf_counter()
            row.run(warmup)
            log(f"    warmup {row.name}: {time.perf_counter() - t0:.1f} s")
    for i in range(steps):
        order = rows if i % 2 == 0 else rows[::-1]
        for row in order:
            combined, ranks = row.run(1, flags)
            row.steps += combined
            row.per_rank.append([r[0] for r in ranks])
        LOADS.append(os.getloadavg()[0])
        log(f"    round {i + 1}/{steps}: " + ", ".join(f"{r.name} {r.steps[-1]['wall']:.2f}s" for r in rows)
            + f" | load {LOADS[-1]:.1f}")


# ============================================================================ output
def table(headers: list, rows: list) -> str:
    rows = [[str(c) for c in r] for r in rows]
    return "\n".join(["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
                     + ["| " + " | ".join(r) + " |" for r in rows])


def print_table(headers: list, rows: list) -> None:
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    print("  " + "  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  " + "  ".join("-" * w for w in widths))
    for r in rows:
        print("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)))


class Report:
    def __init__(self, section: int, title: str):
        self.section, self.title, self.parts, self.goals = section, title, [], []
        self.date = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
        self.t0, self.first_load = time.time(), len(LOADS)

    def finish(self) -> None:
        loads = LOADS[self.first_load:] or [os.getloadavg()[0]]
        self.duration = time.time() - self.t0
        self.load = f"{min(loads):.1f} to {max(loads):.1f} (median {statistics.median(loads):.1f})"

    def text(self, s: str) -> None:
        print(s)
        self.parts.append(s)

    def table(self, headers, rows) -> None:
        print_table(headers, rows)
        self.parts.append(table(headers, rows))

    def goal(self, name: str, measured: str, target: str, ok: bool, ok_fastest: bool | None = None) -> None:
        """ok: the goal's verdict (medians); ok_fastest: the same on the fastest steps (timing goals)."""
        verdict = lambda v: "PASS" if v else "MISS"  # noqa: E731
        self.goals.append((self.section, name, measured, target, verdict(ok),
                           verdict(ok) if ok_fastest is None else verdict(ok_fastest)))

    def throughput_goal(self, name: str, row: "Row", ref: "Row", target: float) -> None:
        """Goal: row's tokens/s >= target x ref's, judged on the medians (and shown on the fastest steps)."""
        self.goal(name, ratios_text(row, ref), f">= {target}", ratio(row.tokens_per_s, ref.tokens_per_s) >= target,
                  best(row, ref) >= target)


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def paired(row: Row, ref: Row) -> float:
    """Median over rounds of (row tokens/s) / (ref tokens/s) with both steps from the same round."""
    return statistics.median((row.tokens / s["wall"]) / (ref.tokens / r["wall"]) for s, r in zip(row.steps, ref.steps))


def best(row: Row, ref: Row) -> float:
    """Throughput ratio of the fastest steps."""
    return (row.tokens / row.min_wall) / (ref.tokens / ref.min_wall)


def ratios_text(row: Row, ref: Row) -> str:
    return (f"{ratio(row.tokens_per_s, ref.tokens_per_s):.3f} (paired {paired(row, ref):.3f}, "
            f"fastest steps {best(row, ref):.3f})")


def mb(nbytes: float) -> str:
    return f"{nbytes / MIB:.1f}"


def row_line(row: Row, ref: Row | None) -> list:
    return [row.name, row.ex.desc if not isinstance(row.ex, Local) else f"1 process x {row.threads} threads",
            f"{row.median_wall:.2f}", f"{row.min_wall:.2f}", f"{row.tokens_per_s:,.0f}", f"{row.tflops:.4f}",
            f"{ratio(row.tokens_per_s, ref.tokens_per_s):.3f}" if ref else "-",
            f"{paired(row, ref):.3f}" if ref else "-", f"{best(row, ref):.3f}" if ref else "-"]


ROW_HEADERS = ["configuration", "processes", "median s/step", "fastest s/step", "tokens/s (median)",
               "model TFLOP/s", "vs ref (medians)", "vs ref (paired)", "vs ref (fastest)"]
RATIO_NOTE = ("Ratios are throughput relative to the reference row: of the medians (the goal figure), "
              "paired (median over rounds of the ratio of the two steps of the same round), and of the fastest "
              "steps (the least disturbed by other load).")


# ============================================================================ sections
def section1(pools, steps: int, log) -> Report:
    rep = Report(1, "Section 1 (issue 2): framework vs plain PyTorch, and data parallelism")
    local, pool2 = pools["local"], pools[2]
    base = Row("baseline (tools/baseline_gpt2.py)", local, ("baseline", S2, MBS, GBS // MBS))
    lib = Row("megatron_mini tp=pp=dp=1", local, ("lib", lib_cfg()))
    dp2 = Row("megatron_mini dp=2", pool2, ("lib", lib_cfg()))
    rows = [base, lib, dp2]
    measure(rows, steps, log=log)
    rep.text(f"S2, fp32, {steps} measured steps per row (after 1 warmup step), interleaved; reference = baseline "
             "for the first two rows.")
    rep.table(ROW_HEADERS, [row_line(base, None), row_line(lib, base), row_line(dp2, lib)])
    rep.text(RATIO_NOTE)
    rep.text(f"\nframework / baseline = {ratios_text(lib, base)} (goal >= 1.0); dp=2 / tp=pp=dp=1 (2 threads) = "
             f"{ratios_text(dp2, lib)} (goal >= 0.95).")
    rep.text(f"Final losses (random tokens, so all near ln(1024) = 6.93): baseline {base.steps[-1]['loss']:.4f}, "
             f"framework {lib.steps[-1]['loss']:.4f}, dp=2 {dp2.steps[-1]['loss']:.4f}.")
    rep.throughput_goal("framework tp=pp=dp=1 / plain PyTorch GPT-2 (tokens/s)", lib, base, 1.0)
    rep.throughput_goal("dp=2 (2x1 thread) / tp=pp=dp=1 (2 threads)", dp2, lib, 0.95)
    for r in rows:
        r.drop()
    return rep


def _wire_bytes(key: str, calls: int, nbytes: int, p: int) -> float:
    """Bytes this rank sends with ring algorithms: all-reduce 2(p-1)/p n, all-gather (output n) and
    reduce-scatter (input n) (p-1)/p n, send n, recv 0, broadcast n (upper bound)."""
    op = key.split(".", 1)[1]
    factor = {"all_reduce": 2 * (p - 1) / p, "all_gather": (p - 1) / p, "reduce_scatter": (p - 1) / p,
              "send": 1.0, "recv": 0.0}.get(op, 1.0)
    return factor * nbytes


def _ledger_lines(rec: dict, sizes: dict) -> list:
    lines, tot_calls, tot_bytes, tot_wire = [], 0, 0, 0.0
    for key, (calls, nbytes) in sorted(rec["ledger"].items()):
        wire = _wire_bytes(key, calls, nbytes, sizes[key.split(".")[0]])
        lines.append([key, calls, mb(nbytes), mb(wire)])
        tot_calls, tot_bytes, tot_wire = tot_calls + calls, tot_bytes + nbytes, tot_wire + wire
    lines.append(["**total**", tot_calls, mb(tot_bytes), mb(tot_wire)])
    return lines


def section2(pools, steps: int, log) -> Report:
    rep = Report(2, "Section 2 (issue 3): tensor and sequence parallelism")
    local, pool2 = pools["local"], pools[2]
    ref = Row("megatron_mini tp=1", local, ("lib", lib_cfg()))
    tp2 = Row("megatron_mini tp=2", pool2, ("lib", lib_cfg(tp=2)))
    sp = Row("megatron_mini tp=2 sp", pool2, ("lib", lib_cfg(tp=2, sp=True)))
    rows = [ref, tp2, sp]
    measure(rows, steps, flags=("ledger",), log=log)
    rep.text(f"S2, fp32, {steps} measured steps per row (after 1 warmup step), interleaved; reference = tp=1, "
             "1 process x 2 threads.")
    rep.table(ROW_HEADERS, [row_line(ref, None), row_line(tp2, ref), row_line(sp, ref)])
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
        rep.table(["group.op", "calls", "ledger MiB", "sent MiB (ring estimate)"], _ledger_lines(per_rank[0], sizes))
    s, b, h, L, m = S2.seq_len, MBS, S2.hidden_size, S2.num_layers, GBS // MBS
    act = s * b * h * 4
    analytic = m * (4 * L + 2) * act
    rep.text(f"\nAnalytic TP activation traffic per rank: m x (4L + 2) x s*b*h*4 bytes = {m} x {4 * L + 2} x "
             f"{mb(act)} MiB = {mb(analytic)} MiB (per block 2 all-reduces forward + 2 backward; the embedding's "
             "forward g and the head's backward f), plus 3 [s, b] cross-entropy all-reduces per microbatch, the SP "
             "LayerNorm/bias gradient sum and the step's scalars. SP moves the same volume as all-gather + "
             "reduce-scatter (each counted at the full [s, b, h] tensor).")
    mem = {}
    for row in rows:
        _, ranks = row.run(1, ("memory",))
        mem[row.name] = [r[0]["act_peak"] for r in ranks]
    rep.text("\nActivation memory per rank (peak bytes saved for backward in one step, as in section 3; MiB): "
             + "; ".join(f"{name}: {' / '.join(mb(x) for x in v)}" for name, v in mem.items()) + ". "
             "With sp every [s, b, h] activation outside the TP regions is split over the sequence, but the "
             "column-parallel linears (QKV, fc1, the output projection) save their all-gathered full-sequence "
             "input for the weight gradient, so sp stays above tp=1 / 2 by about one [s, b, h] tensor per "
             "column-parallel linear (Megatron saves the local shard and all-gathers it again in backward).")
    rep.throughput_goal("tp=2 (2x1 thread) / tp=1 (2 threads)", tp2, ref, 0.85)
    rep.throughput_goal("tp=2 sp / tp=2 (sp within 5% of sp=false)", sp, tp2, 0.95)
    for r in rows:
        r.drop()
    return rep


def section3(pools, steps: int, log, mem_ms=(4, 8, 16)) -> Report:
    from megatron_mini.schedules import simulate
    rep = Report(3, "Section 3 (issue 4): pipeline parallelism")
    local, pool2, pool4 = pools["local"], pools[2], pools[4]
    L8 = replace(S2, name="S2-L8", num_layers=8)
    tok = GBS * S2.seq_len
    ref = Row("tp=pp=1", local, ("lib", lib_cfg()))
    p1 = Row("pp=2 1F1B", pool2, ("lib", lib_cfg(pp=2, schedule="1f1b")))
    pg = Row("pp=2 GPipe", pool2, ("lib", lib_cfg(pp=2, schedule="gpipe")))
    pv = Row("pp=2 vpp=2 interleaved 1F1B", pool2, ("lib", lib_cfg(pp=2, vpp=2, schedule="1f1b")))
    ref8 = Row("S2-L8 tp=pp=1", local, ("lib", lib_cfg(L8)), model=L8, tokens=tok)
    p4 = Row("S2-L8 pp=4 vpp=2 interleaved 1F1B", pool4, ("lib", lib_cfg(L8, pp=4, vpp=2, schedule="1f1b")),
             model=L8, tokens=tok)
    pp_rows = [(p1, 2, 1, "1f1b"), (pg, 2, 1, "gpipe"), (pv, 2, 2, "1f1b"), (p4, 4, 2, "1f1b")]
    rows = [ref, p1, pg, pv, ref8, p4]
    measure(rows, steps, flags=("trace",), log=log)
    m = GBS // MBS
    rep.text(f"fp32, {steps} measured steps per row (after 1 warmup step), interleaved; m = {m} microbatches of 8. "
             "S2 has 4 blocks, which cannot fill pp x vpp = 8 virtual stages, so the pp=4 vpp=2 row uses S2 with "
             "8 layers (S2-L8) and is compared with S2-L8 at tp=pp=1. **pp=4 runs 4 ranks on 2 cores**: its "
             "tokens/s is not what 4 cores would give; the tokens per CPU-second column normalises by the CPU "
             "time all ranks used (a per-core figure that oversubscription does not distort; it excludes idle "
             "bubble time, and the 2-thread reference's figure includes its OpenMP threads' spinning).")
    lines = []
    for row, rf in ((ref, None), (p1, ref), (pg, ref), (pv, ref), (ref8, None), (p4, ref8)):
        lines.append(row_line(row, rf) + [f"{row.tokens_per_cpu_s:,.0f}",
                                          f"{ratio(row.tokens_per_cpu_s, rf.tokens_per_cpu_s):.3f}" if rf else "-"])
    rep.table(ROW_HEADERS + ["tokens per CPU-s", "per CPU-s vs ref"], lines)

    rep.text("\nBubble from engine.trace, the (Action, t_start, t_end) list of each rank (time.perf_counter is "
             "CLOCK_MONOTONIC, shared by the processes): span = first action start on any rank to last action end "
             "on any rank; compute_r = sum of rank r's forward/backward intervals (waiting in p2p is idle); "
             "measured bubble = (pp x span - sum_r compute_r) / sum_r compute_r, the idle time over compute of "
             "the whole pipeline (per rank: (span - compute_r) / compute_r). Theory: schedules.simulate (forward "
             "1, backward 2, equal stages) = (pp-1)/m, or (pp-1)/(v m) interleaved. Medians over the measured steps.")
    blines = []
    for row, pp, v, kind in pp_rows:
        theory = simulate(kind, pp, v, m).bubble
        whole, per_rank, busy = [], [[] for _ in range(pp)], [[] for _ in range(pp)]
        for st in row.per_rank:
            span = max(r["end"] for r in st) - min(r["start"] for r in st)
            whole.append((pp * span - sum(r["busy"] for r in st)) / sum(r["busy"] for r in st))
            for r in range(pp):
                per_rank[r].append((span - st[r]["busy"]) / st[r]["busy"])
                busy[r].append(st[r]["busy"])
        blines.append([row.name, f"{theory:.3f}", f"{statistics.median(whole):.3f}",
                       " / ".join(f"{statistics.median(b):.3f}" for b in per_rank),
                       " / ".join(f"{statistics.median(b):.2f}" for b in busy),
                       " / ".join(str(row.per_rank[-1][r]["in_flight"]) for r in range(pp))])
    rep.table(["layout", "theoretical bubble", "measured bubble", "per rank", "compute s per rank",
               "peak in-flight (chunk, mb) per rank"], blines)
    rep.text("Stages are not equal: with embedding_stage=none the first stage also runs the embedding and the "
             "last the final LayerNorm, the output projection (V x h, a third of a block's matmul FLOPs) and the "
             "cross-entropy, so the first stage idles more than the theory and the last less.")
    rep.text("(pp=4 on 2 cores: a rank's compute intervals include time it was descheduled for another "
             "rank, so its measured bubble is not comparable with the theory.)")
    for r in rows:
        r.drop()

    # activation memory, GPipe vs 1F1B, growing m (one step each, with the saved-tensor meter)
    log("  activation memory: pp=2 GPipe vs 1F1B")
    mlines, peaks = [], {}
    for mm in mem_ms:
        for kind in ("gpipe", "1f1b"):
            row = Row(f"pp=2 {kind} m={mm}", pool2, ("lib", lib_cfg(pp=2, schedule=kind, gbs=MBS * mm)))
            t0 = time.perf_counter()
            _, ranks = row.run(1, ("memory", "trace"))
            log(f"    {row.name}: {time.perf_counter() - t0:.1f} s")
            peaks[kind, mm] = [r[0]["act_peak"] for r in ranks]
            sim = simulate(kind, 2, 1, mm).peak_in_flight
            mlines.append([kind, mm, " / ".join(mb(p) for p in peaks[kind, mm]),
                           " / ".join(str(r[0]["in_flight"]) for r in ranks), " / ".join(map(str, sim)),
                           " / ".join(mb(r[0]["act_left"]) for r in ranks)])
            row.drop()
    ref_mem = Row("tp=pp=1 m=4", local, ("lib", lib_cfg()))
    _, ranks = ref_mem.run(1, ("memory",))
    ref_mem.drop()
    rep.text("\nActivation memory per rank (MiB; peak bytes of tensors saved for backward alive at once, counted "
             "with saved_tensors_hooks: see the method note), pp=2, S2, one step; rank 0 / rank 1. For scale: "
             f"tp=pp=1 at m=4 peaks at {mb(ranks[0][0]['act_peak'])} MiB (it holds one microbatch of all 4 blocks "
             "at a time).")
    rep.table(["schedule", "m", "peak MiB per rank", "measured peak in-flight mb", "simulated peak in-flight",
               "left after step (MiB)"], mlines)
    g = [peaks["gpipe", mm][0] for mm in mem_ms]
    f = [peaks["1f1b", mm][0] for mm in mem_ms]
    ok = all(a < b for a, b in zip(f, g)) and f[-1] <= 1.1 * f[0] and g[-1] > 1.5 * g[0]
    rep.text(f"\nRank 0: GPipe grows {g[-1] / g[0]:.2f}x from m={mem_ms[0]} to m={mem_ms[-1]}; 1F1B "
             f"{f[-1] / f[0]:.2f}x (bounded by pp - rank = 2 in-flight microbatches).")
    rep.goal("1F1B holds fewer in-flight activations than GPipe, flat as m grows (rank 0, pp=2)",
             f"1F1B {'/'.join(mb(x) for x in f)} vs GPipe {'/'.join(mb(x) for x in g)} MiB "
             f"at m={'/'.join(map(str, mem_ms))}",
             "1F1B < GPipe at every m; 1F1B flat (<= 1.1x)", ok)
    return rep


def section4(pools, steps: int, log) -> Report:
    rep = Report(4, "Section 4 (issue 5): precision, ZeRO-1, activation recompute")
    local, pool2, pool4 = pools["local"], pools[2], pools[4]
    fp32 = Row("fp32, recompute=none", local, ("lib", lib_cfg()))
    bf16 = Row("bf16", local, ("lib", lib_cfg(dtype="bf16")))
    sel = Row("recompute=selective", local, ("lib", lib_cfg(recompute="selective")))
    full = Row("recompute=full", local, ("lib", lib_cfg(recompute="full")))
    rows = [fp32, bf16, sel, full]
    measure(rows, steps, log=log)
    for r in rows:
        _, ranks = r.run(1, ("memory",))
        r.act_peak = ranks[0][0]["act_peak"]
        r.drop()
    # fp16 on CPU is ~100x slower in matmuls: compare the three precisions on one microbatch of 1 sequence
    small = dict(mbs=1, gbs=1)
    tok_small = S2.seq_len
    smalls = [Row(f"{d} (mbs=1, gbs=1)", local, ("lib", lib_cfg(dtype=d, **small)), tokens=tok_small)
              for d in ("fp32", "bf16", "fp16")]
    measure(smalls, 5, log=log)
    for r in smalls:
        r.drop()

    rep.text(f"S2 at tp=pp=dp=1, 1 process x 2 threads, {steps} measured steps per row (after 1 warmup step), "
             "interleaved; reference = fp32 with recompute=none.")
    rep.table(["configuration", "median s/step", "fastest s/step", "tokens/s", "model TFLOP/s", "vs fp32 (medians)",
               "vs fp32 (paired)", "vs fp32 (fastest)", "activation peak MiB"],
              [[r.name, f"{r.median_wall:.2f}", f"{r.min_wall:.2f}", f"{r.tokens_per_s:,.0f}", f"{r.tflops:.4f}",
                f"{ratio(r.tokens_per_s, fp32.tokens_per_s):.3f}", f"{paired(r, fp32):.3f}", f"{best(r, fp32):.3f}",
                mb(r.act_peak)] for r in rows])
    rep.text("\nfp16 on this CPU is too slow for a full S2 step in the default budget; the three precisions "
             "on one sequence (mbs=1, gbs=1, 256 tokens per step), 5 measured steps each, interleaved:")
    rep.table(["configuration", "median s/step", "fastest s/step", "tokens/s", "model TFLOP/s", "vs fp32 (medians)",
               "vs fp32 (fastest)"],
              [[r.name, f"{r.median_wall:.2f}", f"{r.min_wall:.2f}", f"{r.tokens_per_s:,.0f}", f"{r.tflops:.4f}",
                f"{ratio(r.tokens_per_s, smalls[0].tokens_per_s):.3f}", f"{best(r, smalls[0]):.3f}"] for r in smalls])

    # ZeRO-1 optimizer state per rank
    zlines, zraw = [], []
    for dtype in ("fp32", "bf16"):
        for zero, dp in ((0, 1), (1, 1), (0, 2), (1, 2), (1, 4)):
            ex = {1: local, 2: pool2, 4: pool4}[dp]
            key = f"zero{zero} dp{dp} {dtype}"
            ex.call("build", key, ("lib", lib_cfg(dtype=dtype, zero=zero)))
            states = ex.call("opt_bytes", key)
            ex.call("drop", key)
            st = states[0]
            total = st["master"] + st["moments"]
            zlines.append([dtype, zero, dp, f"{st['params']:,}", mb(st["master"]), mb(st["moments"]), mb(total),
                           f"{total / st['params']:.2f}"])
            zraw.append((dtype, zero, dp, total))
    rep.text("\nOptimizer state per rank (rank 0): sum over optimizer.ranges of master weights (counted only when "
             "a separate fp32 tensor: in fp32 the master is the parameter buffer itself) + exp_avg + exp_avg_sq.")
    rep.table(["dtype", "zero", "dp", "params", "master MiB", "Adam moments MiB", "total MiB", "bytes/param"], zlines)
    zb = {(l[0], l[1], l[2]): l[-1] for l in zraw}
    ok = all(abs(zb[d, 1, k] * k / zb[d, 1, 1] - 1) < 0.01 for d in ("fp32", "bf16") for k in (2, 4))
    rep.goal("ZeRO-1 optimizer state per rank scales as 1/dp (dp=2, 4; fp32 and bf16)",
             ", ".join(f"{d}: {mb(zb[d, 1, 1])}/{mb(zb[d, 1, 2])}/{mb(zb[d, 1, 4])} MiB at dp=1/2/4"
                       for d in ("fp32", "bf16")),
             "within 1% of 1/dp", ok)
    rep.text("\nrecompute=selective recomputes the attention core (softmax(q k^T) v). Both attention paths are "
             "fused (F.scaled_dot_product_attention with kernels=torch, the Triton flash attention with "
             "kernels=triton): the s x s probabilities are never stored, and the attention output shares its storage "
             "with the output projection's saved input (on CPU for SDPA; always for the flash kernel), so selective "
             "saves only the log-sum-exp: its memory equals none, and it pays the attention forward again. "
             "recompute=full keeps only each block's input (2 MiB per block per microbatch here) plus the head.")
    ok = full.act_peak < sel.act_peak <= fp32.act_peak
    rep.goal("activation memory full < selective <= none",
             f"{mb(full.act_peak)} < {mb(sel.act_peak)} <= {mb(fp32.act_peak)} MiB", "order", ok)
    return rep


# ============================================================================ docs
def device_line() -> str:
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"CPU: {model}, {os.cpu_count()} cores"


def write_doc(path: str, reports: list, header: dict) -> None:
    begin = "<!-- bench_train section {} begin -->"
    end = "<!-- bench_train section {} end -->"
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    if "<!-- bench_train header -->" not in text:
        text = DOC_HEADER + "\n" + "\n\n".join(begin.format(i) + "\n" + end.format(i) for i in range(1, 5)) \
               + "\n\n<!-- bench_train goals begin -->\n<!-- bench_train goals end -->\n"
    for rep in reports:
        body = (f"## {rep.title}\n\n"
                f"- command: `{header['command']}` (`make bench"
                + (f" ARGS=\"{header['args']}\"" if header['args'] else "") + "`)\n"
                f"- date: {rep.date}; this section took {rep.duration:.0f} s\n- device: {header['device']}\n"
                f"- torch {torch.__version__}; 1-minute load average during the section (sampled every round; "
                f"2 cores shared with other developers' tests): {rep.load}\n\n"
                + "\n\n".join(p.strip("\n") for p in rep.parts) + "\n")
        body = re.sub(r"\n{3,}", "\n\n", body)
        b, e = begin.format(rep.section), end.format(rep.section)
        text = text[:text.index(b) + len(b)] + "\n" + body + text[text.index(e):]
    # goals: keep rows of sections not rerun
    gb, ge = "<!-- bench_train goals begin -->", "<!-- bench_train goals end -->"
    old = text[text.index(gb) + len(gb):text.index(ge)]
    kept = {}
    for line in old.splitlines():
        m = re.match(r"\| (\d) \| (.*)", line)
        if m:
            kept.setdefault(int(m.group(1)), []).append(line)
    for rep in reports:
        kept[rep.section] = ["| " + " | ".join(map(str, g)) + " |" for g in rep.goals]
    goal_rows = [line for s in sorted(kept) for line in kept[s]]
    goals = ("\n## Goals\n\nThe verdict is on the medians (the goal's figure); the last column applies the same target "
             "to the fastest steps, the figure least disturbed by other load on the shared machine.\n\n"
             "| section | goal | measured | target | result (medians) | result (fastest steps) |\n"
             "|---|---|---|---|---|---|\n"
             + "\n".join(goal_rows) + "\n")
    text = text[:text.index(gb) + len(gb)] + goals + text[text.index(ge):]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


DOC_HEADER = """# Training benchmarks

<!-- bench_train header -->
Written by `tools/bench_train.py` (`make bench`); each section below is replaced when that section is
rerun (`make bench ARGS="--section N"`). Shape **S2**: 4 layers, 8 heads, hidden 256, sequence 256,
micro-batch 8, global batch 32 (4 microbatches at dp=1, 8192 tokens per step), vocabulary 1024, fp32
unless stated, synthetic tokens, CPU, gloo.

**Method.** All rows of a section are built once and kept alive (single-process rows in the bench
process with `torch.set_num_threads(2)`, multi-rank rows in persistent spawned gloo pools with one
thread per rank), warmed up with one step, then measured in interleaved rounds (one step per row,
order reversed every round) so that the load of a shared machine falls on every row alike. A row's
figure is the median of its steps; a multi-rank step is the slowest rank's wall time. The machine is
shared with other developers' test runs: compare rows within a section (ratios), not across runs.

**Model FLOPs per step** = 6·N·T + 12·L·h·s·T, with N = 12·L·h² + V·h (matmul weights: QKV,
attention output, MLP in and out, and the tied output projection; V the padded vocabulary) and T the
tokens per step. For S2: N = 3,407,872, T = 8192: 167.5 + 25.8 = 193.3 GFLOP per step.

**Activation memory** = peak bytes of tensors saved for backward alive at once during a step:
`torch.autograd.graph.saved_tensors_hooks` counts each saved tensor's storage once on pack
(parameters excluded) and releases it when autograd drops the packed object (weakref finalizer).
Checkpointed regions count the inputs they save (non-reentrant checkpoint saves them under the outer
hooks); the transient recomputed activations of the region being back-propagated are not counted.
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--section", type=int, action="append", choices=[1, 2, 3, 4],
                    help="run only this section (repeatable); default: all")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"measured steps per row (default per section: {DEFAULT_STEPS})")
    ap.add_argument("--doc", default=DOC, help="markdown file to update (default docs/benchmarks.md)")
    ap.add_argument("--no-doc", action="store_true", help="print only")
    ap.add_argument("--smoke", action="store_true",
                    help="a tiny model instead of S2, to check the script (writes only to an explicit --doc)")
    args = ap.parse_args()
    if args.smoke:
        global S2
        S2 = replace(S2, name="smoke", hidden_size=64, num_heads=8, seq_len=32, vocab_size=256)
        args.no_doc = args.no_doc or args.doc == DOC    # never overwrite the real figures with smoke ones
    sections = sorted(set(args.section or [1, 2, 3, 4]))
    t_start = time.time()
    load0 = os.getloadavg()[0]
    header = {"command": "OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 .venv/bin/python tools/bench_train.py"
                         + "".join(" " + shlex.quote(a) for a in sys.argv[1:]),
              "args": " ".join(shlex.quote(a) for a in sys.argv[1:]), "device": device_line()}
    print(f"{header['device']} | torch {torch.__version__} | load average {load0:.1f} | sections {sections}")

    def log(msg):
        print(f"[{time.time() - t_start:6.0f}s] {msg}", flush=True)

    pools = {"local": Local(2)}
    need = {2: any(s in sections for s in (1, 2, 3, 4)), 4: any(s in sections for s in (3, 4))}
    reports = []
    try:
        for world, needed in need.items():
            if needed:
                pools[world] = Pool(world)
        for s in sections:
            steps = args.steps or DEFAULT_STEPS[s]
            log(f"section {s}: {steps} measured steps per row")
            fn = {1: section1, 2: section2, 3: section3, 4: section4}[s]
            rep = fn(pools, steps, log)
            rep.finish()
            reports.append(rep)
            print()
    finally:
        for p in pools.values():
            p.close()
    goals = [g for rep in reports for g in rep.goals]
    print("\n=== Goals ===")
    print_table(["section", "goal", "measured", "target", "result (medians)", "result (fastest steps)"], goals)
    print(f"\ntotal time {time.time() - t_start:.0f} s")
    if not args.no_doc:
        write_doc(args.doc, reports, header)
        print(f"wrote {os.path.relpath(args.doc, REPO)}")


if __name__ == "__main__":
    main()
