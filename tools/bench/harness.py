"""Rows measured side by side. Every configuration of a section is built once and kept alive:
single-process ones in this process (2 intra-op threads), multi-rank ones in persistent pools of
spawned gloo ranks (1 thread each) that wait on a queue between commands; each process set up as
train.py's CPU ranks (hardware.configure_device: freed memory reused). After one warmup step each,
the rows are measured in interleaved rounds (row A one step, row B one step, ..., order reversed every
round), so the noise of a shared machine hits every row alike; a row's figure is the median of its
steps. A multi-rank step is the slowest rank's wall time (ranks start each command from a barrier).
"""
from __future__ import annotations

import datetime
import gc
import os
import queue
import statistics
import time
import traceback

import torch
import torch.multiprocessing as mp

from bench.meters import measured_step
from bench.workload import BaselineRunner, LibRunner, lib_cfg
from megatron_mini.hardware import configure_device
from megatron_mini.launch import free_port


def handle(state: dict, op: str, args: tuple):
    """Commands run identically by this process (world 1) and by every rank of a pool."""
    objs = state["objs"]
    if op == "build":
        key, baseline, cfg = args
        if baseline:
            objs[key] = BaselineRunner(cfg.model, cfg.mbs, cfg.gbs // cfg.mbs)
        else:
            from megatron_mini.mesh import ParallelMesh
            layout = (cfg.tp, cfg.pp, state["world"] // (cfg.tp * cfg.pp))
            if layout not in state["meshes"]:
                state["meshes"][layout] = ParallelMesh(*layout)
            objs[key] = LibRunner(cfg, state["meshes"][layout])
    elif op == "ping":
        return os.getpid()
    elif op == "drop":
        objs.pop(args[0], None)
        gc.collect()
    elif op == "memory_bytes":
        return objs[args[0]].memory_bytes()
    elif op == "steps":
        key, n, flags = args
        if state["world"] > 1:
            torch.distributed.barrier()
        return [measured_step(objs[key], flags) for _ in range(n)]
    else:
        raise ValueError(op)
    return None


class Local:
    """Runs commands in this process with `threads` intra-op threads."""

    def __init__(self, threads: int = 2):
        torch.set_num_threads(threads)
        configure_device(torch.device("cpu"))
        self.desc, self.world = f"1 process x {threads} threads", 1
        self.state = {"world": 1, "meshes": {}, "objs": {}}

    def call(self, op, *args) -> list:
        return [handle(self.state, op, args)]

    def close(self):
        self.state["objs"].clear()


def _pool_rank(rank: int, world: int, port: int, commands, results):
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      WANDB_MODE="disabled")
    torch.set_num_threads(1)
    configure_device(torch.device("cpu"))
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
        port = free_port()
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
            except queue.Empty:          # check the ranks are alive
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


class Row:
    """One configuration built on one executor (Local or Pool), and its measured steps (ranks combined:
    the slowest rank's wall time, the sum of the ranks' CPU time)."""

    def __init__(self, name: str, ex, cfg, baseline: bool = False):
        self.name, self.ex, self.cfg = name, ex, cfg
        self.model, self.tokens = cfg.model, cfg.gbs * cfg.model.seq_len
        self.steps, self.per_rank = [], []
        ex.call("build", name, baseline, cfg)

    def run(self, n: int, flags=()) -> tuple:
        """n steps: (combined records, per-rank records)."""
        ranks = self.ex.call("steps", self.name, n, tuple(flags))
        combined = [{"wall": max(r[i]["wall"] for r in ranks), "cpu": sum(r[i]["cpu"] for r in ranks),
                     "loss": ranks[0][i]["loss"]} for i in range(n)]
        return combined, ranks

    def memory_bytes(self) -> list:
        return self.ex.call("memory_bytes", self.name)

    def drop(self):
        self.ex.call("drop", self.name)

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
        return self.model.flops_per_token() * self.tokens_per_s / 1e12

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.tokens / statistics.median(s["cpu"] for s in self.steps)

    def speedup(self, ref: Row) -> float:
        """Throughput ratio of the medians."""
        return self.tokens_per_s / ref.tokens_per_s

    def paired(self, ref: Row) -> float:
        """Median over rounds of (row tokens/s) / (ref tokens/s) with both steps from the same round."""
        return statistics.median((self.tokens / s["wall"]) / (ref.tokens / r["wall"])
                                 for s, r in zip(self.steps, ref.steps))

    def fastest(self, ref: Row) -> float:
        """Throughput ratio of the fastest steps."""
        return (self.tokens / self.min_wall) / (ref.tokens / ref.min_wall)


class Bench:
    """One benchmark run: the model shape (smoke: a tiny one that checks the script), the executors (this
    process with 2 threads and a pool per world size), the log, and the 1-minute load averages sampled
    after every round."""

    def __init__(self, model, worlds, log=print, smoke: bool = False):
        self.model, self.log, self.loads, self.smoke = model, log, [], smoke
        self.local, self.pools = Local(2), {}
        try:
            for world in worlds:
                self.pools[world] = Pool(world)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Bench:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for ex in [self.local, *self.pools.values()]:
            ex.close()

    def row(self, name: str, ex, model=None, baseline: bool = False, **overrides) -> Row:
        """A Row of lib_cfg(model or this run's model, **overrides) on `ex`."""
        return Row(name, ex, lib_cfg(model or self.model, **overrides), baseline)

    def measure(self, rows: list, steps: int, flags=(), warmup: int = 1) -> None:
        """Warm up every row, then `steps` interleaved rounds of one step per row (order alternating)."""
        for row in rows:
            if warmup:
                t0 = time.perf_counter()
                row.run(warmup)
                self.log(f"    warmup {row.name}: {time.perf_counter() - t0:.1f} s")
        for i in range(steps):
            for row in rows if i % 2 == 0 else rows[::-1]:
                combined, ranks = row.run(1, flags)
                row.steps += combined
                row.per_rank.append([r[0] for r in ranks])
            self.loads.append(os.getloadavg()[0])
            self.log(f"    round {i + 1}/{steps}: " + ", ".join(f"{r.name} {r.steps[-1]['wall']:.2f}s" for r in rows)
                     + f" | load {self.loads[-1]:.1f}")
