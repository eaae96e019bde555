"""Shared pieces of the training tests: a small config, training on N spawned ranks, comparisons."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import platform
import subprocess
import sys

import pytest
import torch

from ranks import spawn
from megatron_mini.config import DataConfig, ModelConfig, OptimizerConfig, TrainConfig, WandbConfig
from megatron_mini.model import cpu_compile_missing


# The Triton kernels' tests skip where the triton package is not installed: pyproject installs it on Linux only
# (there are no wheels for macOS or Windows); kernels=torch, which they are compared with, runs everywhere.
HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package (installed on Linux only)")


def skip_without_cpu_compiler(device) -> None:
    """Skip where torch.compile cannot build for `device`: a CPU without the C++ compiler or Python's headers that
    inductor builds with (model.cpu_compile_missing, by which train.py refuses compile=true there)."""
    if torch.device(device).type == "cpu" and (why := cpu_compile_missing()):
        pytest.skip(f"torch.compile on the CPU: {why}")


# glibc's malloc takes an M_MMAP_THRESHOLD above 32 MiB (hardware.REUSED_BLOCK_BYTES) from 2.35 on
needs_glibc_2_35 = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or tuple(map(int, platform.libc_ver()[1].split("."))) < (2, 35),
    reason="glibc's malloc takes a 48 MiB M_MMAP_THRESHOLD from 2.35 on")

# (in a process of its own: the allocator's settings are the process's)
NEW_BLOCK_FAULTS = """
import json, resource, torch

def faults():
    # a 48 MiB tensor written after eight of that size were freed: above glibc's largest dynamic mmap threshold
    # (32 MiB), so without the setting each is a new mapping that the kernel faults in page by page; with it, the
    # first few may each leave a hole in the heap that the next (memaligned: a little larger) does not fit, where
    # small blocks (the triton interpreter's) were placed after it: with three, 3 runs in 16 faulted 12288 times
    for _ in range(8):
        torch.ones(12 << 20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.ones(12 << 20)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

before = faults()
{setup}
print(json.dumps([before, faults()]))
"""


def new_block_faults(setup: str) -> int:
    """The page faults of writing a new 48 MiB tensor after the Python code `setup` ran, in a process of its own
    (the repository and tools/ importable); the test skips where such a tensor faults fewer than 1000 times before
    `setup` (huge pages?): nothing to compare."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", NEW_BLOCK_FAULTS.replace("{setup}", setup)], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.path.join(repo, "tools")])})
    assert proc.returncode == 0, proc.stderr
    before, after = json.loads(proc.stdout.splitlines()[-1])
    if before < 1000:
        pytest.skip(f"this system faults a new 48 MiB block in {before} times (huge pages?): nothing to compare")
    return after


def small_config(data: DataConfig, run_dir, **overrides) -> TrainConfig:
    """8 blocks, hidden 64, 4 heads, sequence 32, vocabulary 512: splits up to tp=4 and pp=4 x vpp=2."""
    model = ModelConfig(name="test", num_layers=8, hidden_size=64, num_heads=4, seq_len=32, vocab_size=data.vocab_size)
    # Adam eps 1e-6, not 1e-8: the key bias's gradient is analytically zero (softmax ignores q.b_k), so
    # it is pure rounding noise, which eps=1e-8 turns into updates of ~lr*noise/eps that differ from
    # layout to layout (up to 2e-5 in 20 steps). With 1e-6 every weight agrees to ~2e-7 (fp32 rounding).
    optimizer = OptimizerConfig(lr=2e-3, min_lr=2e-4, warmup_steps=5, eps=1e-6)
    # device=cpu: multi-rank tests run on gloo CPU ranks on any machine (on a one-GPU machine device=auto
    # would refuse more ranks than GPUs); a test that wants the GPU asks for device="auto".
    # memory_plan=False: the planner's start-up report (seconds on rank 0) is tested on its own (test_planner)
    # compile=False: eager wherever it runs (unset compiles on CUDA); the compile tests ask for it
    # a copy of `data`: a "data.KEY" override must not change the session's DataConfig other tests share
    cfg = TrainConfig(model=model, data=dataclasses.replace(data), optimizer=optimizer,
                      wandb=WandbConfig(mode="disabled"), mbs=2, gbs=16, steps=20, run_dir=str(run_dir),
                      log_interval=1000, eval_interval=0, resume="never", device="cpu", memory_plan=False,
                      compile=False)
    for key, value in overrides.items():
        if "." in key:
            section, field = key.split(".")
            setattr(getattr(cfg, section), field, value)
        else:
            setattr(cfg, key, value)
    return cfg


def _train(cfg: TrainConfig) -> dict:
    from megatron_mini.training import train
    return train(cfg)


def train_on_ranks(world_size: int, cfg: TrainConfig) -> dict:
    """Train on `world_size` gloo ranks; returns rank 0's history (losses are global)."""
    return spawn(world_size, _train, cfg, init_group=False)[0]


def train_on_a_fake_clock(cfg: TrainConfig, first_step: float = 1.0) -> dict:
    """train(cfg) on this spawned rank, on a clock where a training step takes 1 s (the first `first_step`: a GPU's
    compilation and autotuning) and an evaluation, a save or the writing of a profile (profile.*) 100 s."""
    import time
    import types
    from megatron_mini import profiling, training
    clock = [0.0]

    def taking(seconds, fn):
        def timed(*args, **kwargs):
            clock[0] += seconds
            return fn(*args, **kwargs)
        return timed
    training.time = types.SimpleNamespace(**{**vars(time), "time": lambda: clock[0]})
    profiling.time = types.SimpleNamespace(**{**vars(time), "perf_counter": lambda: clock[0]})
    profiling.StepProfiler._write = taking(100.0, profiling.StepProfiler._write)
    for name, seconds in (("train_step", 1.0), ("evaluate", 100.0), ("save", 100.0)):
        setattr(training.Trainer, name, taking(seconds, getattr(training.Trainer, name)))
    step, steps = training.Trainer.train_step, []

    def first_slower(self, *args, **kwargs):
        clock[0] += (first_step - 1.0) * (not steps)
        steps.append(1)
        return step(self, *args, **kwargs)
    training.Trainer.train_step = first_slower
    return training.train(cfg)


def make_trainer(cfg: TrainConfig):
    """A Trainer on this spawned rank (the process group exists), without the training loop."""
    import torch.distributed as dist
    from megatron_mini.dataset import load_datasets
    from megatron_mini.mesh import ParallelMesh
    from megatron_mini.training import Trainer

    mesh = ParallelMesh(cfg.tp, cfg.pp, dist.get_world_size() // (cfg.tp * cfg.pp))
    datasets = load_datasets(cfg.data, cfg.model.seq_len, cfg.seed, cfg.model.vocab_size)
    return Trainer(cfg, mesh, datasets, torch.device("cpu"))


def final_weights(history: dict) -> dict:
    from megatron_mini.checkpoint import load_model_tensors
    return load_model_tensors(history["checkpoint"])


def assert_same_training(ref: dict, other: dict, rtol: float = 1e-6, wtol: float = 1e-5) -> None:
    """Per-step losses within rtol (relative), the gradient norms within 10 rtol, and final weights within wtol
    (absolute) of the reference run. Measured over the 41 layout comparisons of the suite (fp32, a few steps; the
    sums' orders differ by layout): losses at most 1.6e-7 (pp4 mbs4), norms 6.0e-7 and weights 5.6e-7 (tp4)."""
    a, b = torch.tensor(ref["loss"]), torch.tensor(other["loss"])
    assert a.shape == b.shape
    rel = ((a - b).abs() / a.abs()).max().item()
    assert rel <= rtol, f"per-step loss differs by {rel:.2e} (relative) > {rtol}: {a.tolist()} vs {b.tolist()}"
    na, nb = torch.tensor(ref["grad_norm"]), torch.tensor(other["grad_norm"])
    rel = ((na - nb).abs() / na.abs()).max().item()   # clipping sees the same global norm
    assert rel <= 10 * rtol, f"grad norm differs by {rel:.2e} (relative): {na.tolist()} vs {nb.tolist()}"
    wa, wb = final_weights(ref), final_weights(other)
    assert wa.keys() == wb.keys()
    for name in wa:
        diff = (wa[name] - wb[name]).abs().max().item()
        assert diff <= wtol, f"{name}: final weights differ by {diff:.2e} > {wtol}"


def replace(cfg: TrainConfig, **changes) -> TrainConfig:
    return dataclasses.replace(cfg, **changes)


def pretend_read_only(monkeypatch, directory) -> None:
    """os.access says `directory` may not be written (a chmod does not stop root, whom the tests run as)."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, *args, **kwargs: (
        False if os.path.abspath(path) == os.path.abspath(directory) and mode & os.W_OK
        else real(path, mode, *args, **kwargs)))
