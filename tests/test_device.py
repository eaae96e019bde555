"""Devices, backends and throughput accounting: the mesh's rank order, which device and backend each rank gets
(with any number of GPUs, mocked on CPU), the model-FLOPs formula against torch's FLOP counter, the MFU
peak table, and, on a machine with a GPU, several ranks sharing it over gloo."""
import dataclasses
import inspect
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from ranks import spawn
from harness import (assert_same_training, needs_glibc_2_35, needs_triton, new_block_faults, small_config,
                     train_on_a_fake_clock, train_on_ranks)
from megatron_mini.config import ConfigError, ModelConfig, TrainConfig, WandbConfig
from megatron_mini import hardware
from megatron_mini.hardware import GPUS, gpu_key_of_name, math_dtype, peak_tflops, set_tf32
from megatron_mini.launch import gpu_slot
from megatron_mini.mesh import ParallelMesh, choose_device, ranks_per_gpu
from megatron_mini.model import ParallelContext, build_chunks


def test_mesh_orders_ranks_tp_fastest_then_dp_then_pp():
    """Every rank of a tp=2 x dp=3 x pp=4 mesh (virtual: no processes) has the coordinates and groups of
    Megatron's tp-dp-pp order, global rank = tp_rank + tp (dp_rank + dp pp_rank): a TP group is tp consecutive
    ranks, DP peers are tp apart, PP peers tp*dp apart; the embedding group is the first and last stage of its
    (tp, dp) column (the stages between are in none), the model-parallel group the tp*pp ranks of its DP replica."""
    tp, dp, pp = 2, 3, 4
    coords = []
    for rank in range(tp * dp * pp):
        mesh = ParallelMesh(tp, pp, dp, virtual_rank=rank)
        t, d, p = mesh.tp_rank, mesh.dp_rank, mesh.pp_rank
        coords.append((t, d, p))
        assert rank == t + tp * (d + dp * p), (rank, t, d, p)
        assert mesh.tp_group.ranks == [rank - t + i for i in range(tp)]
        assert mesh.dp_group.ranks == [rank + tp * (i - d) for i in range(dp)]
        assert mesh.pp_group.ranks == [rank + tp * dp * (i - p) for i in range(pp)]
        if p in (0, pp - 1):
            assert mesh.embedding_group.ranks == [rank - tp * dp * p, rank + tp * dp * (pp - 1 - p)]
        else:
            assert mesh.embedding_group is None             # (a middle stage holds no word embedding)
        assert sorted(mesh.mp_group.ranks) == [r for r in range(tp * dp * pp) if r // tp % dp == d]
        assert (mesh.tp_group.rank, mesh.dp_group.rank, mesh.pp_group.rank) == (t, d, p)
    assert sorted(coords) == sorted(itertools.product(range(tp), range(dp), range(pp)))


@pytest.mark.parametrize("local_world, gpus, expected", [
    (2, 0, [("cpu", "gloo"), ("cpu", "gloo")]),                 # a CPU machine: as before
    (1, 1, [("cuda:0", "nccl")]),                               # a workstation, one rank per GPU
    (2, 4, [("cuda:0", "nccl"), ("cuda:1", "nccl")]),
])
def test_auto_gives_each_rank_its_own_gpu_or_the_cpu(local_world, gpus, expected):
    got = [choose_device("auto", "auto", r, local_world, gpus) for r in range(local_world)]
    assert [(str(d), b) for d, b in got] == expected


def test_auto_refuses_more_ranks_than_gpus_on_every_rank_with_the_ways_out():
    messages = set()
    for local_rank in range(2):        # rank 0 has a GPU, rank 1 does not: both must stop, with one message
        with pytest.raises(ConfigError) as e:
            choose_device("auto", "auto", local_rank, 2, 1)
        messages.add(str(e.value))
    (msg,) = messages
    assert "2 ranks" in msg and "1 GPU" in msg and "--nproc_per_node=1" in msg and "device=cuda" in msg


def test_device_cuda_shares_gpus_over_gloo():
    got = [choose_device("cuda", "auto", r, 4, 1) for r in range(4)]
    assert [(str(d), b) for d, b in got] == [("cuda:0", "gloo")] * 4
    assert [str(choose_device("cuda", "gloo", r, 3, 2)[0]) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]


@pytest.mark.parametrize("device, backend, local_world, gpus, fact", [
    ("cuda", "auto", 1, 0, "no CUDA GPU"),
    ("cpu", "nccl", 1, 0, "nccl needs device=cuda"),
    ("cuda", "nccl", 4, 1, "cannot put 4 ranks on 1 GPU"),
])
def test_impossible_device_choices_are_refused(device, backend, local_world, gpus, fact):
    with pytest.raises(ConfigError, match=fact):
        choose_device(device, backend, 0, local_world, gpus)


LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
                 "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE",
                 "SLURM_STEP_TASKS_PER_NODE", "SLURM_GPUS_PER_TASK", "MASTER_ADDR", "MASTER_PORT")
SRUN_5_OF_8 = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
               "SLURM_TASKS_PER_NODE": "4(x2)", "MASTER_ADDR": "node0"}   # srun -n 8 on 2 nodes, no --ntasks-per-node


@pytest.mark.parametrize("env, slot, device", [
    ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "node0"}, (1, 4),
     "cuda:1"),
    (SRUN_5_OF_8, (1, 4), "cuda:1"),
    # srun --gpus-per-task=1: each task sees only its own GPU, as cuda:0
    ({**SRUN_5_OF_8, "SLURM_GPUS_PER_TASK": "1"}, (0, 1), "cuda:0"),
], ids=["torchrun", "slurm", "slurm-gpus-per-task"])
def test_gpu_slot_under_each_launcher(monkeypatch, env, slot, device):
    """With 4 GPUs visible (torchrun, plain srun) ranks take cuda:local_rank on NCCL; with one GPU bound
    per SLURM task (device_count() = 1 in each of 4 tasks) every task takes its own cuda:0, on NCCL, not
    a refusal for 4 ranks on 1 GPU."""
    _set_launcher_env(monkeypatch, env)
    assert gpu_slot() == slot
    gpus = 1 if "SLURM_GPUS_PER_TASK" in env else 4
    assert [str(x) for x in choose_device("auto", "auto", *gpu_slot(), gpus)] == [device, "nccl"]


def _set_launcher_env(monkeypatch, env: dict) -> None:
    for k in LAUNCHER_VARS:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("per_node, step_per_node, node, tasks", [
    ("4(x2),2", None, 0, 4), ("4(x2),2", None, 1, 4), ("4(x2),2", None, 2, 2),
    ("8(x2)", "3,5", 1, 5),                  # the step's own count (srun -n 8 in a 2-node allocation of 8 each)
])
def test_slurm_tasks_of_a_node_are_the_same_for_all_of_them(monkeypatch, per_node, step_per_node, node, tasks):
    """Every task of a node reads the same number (it was SLURM_LOCALID + 1 without SLURM_NTASKS_PER_NODE,
    so on a node with fewer GPUs than tasks some ranks took a GPU and the others stopped)."""
    for local in range(tasks):
        env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "10", "SLURM_LOCALID": str(local), "SLURM_NODEID": str(node),
               "SLURM_TASKS_PER_NODE": per_node, "MASTER_ADDR": "node0"}
        if step_per_node:
            env["SLURM_STEP_TASKS_PER_NODE"] = step_per_node
        _set_launcher_env(monkeypatch, env)
        assert gpu_slot() == (local, tasks)


@pytest.mark.parametrize("per_node, node", [(None, 2), ("4(x2)", 2), ("4(x)", 2), ("4(x),2", 0)])
def test_slurm_without_this_nodes_task_count_is_refused(monkeypatch, per_node, node):
    """A third node that the list does not have; a list with a malformed entry gives no node its count
    (skipping the entry would shift every later node's)."""
    env = {**SRUN_5_OF_8, "SLURM_NODEID": str(node)}
    if per_node is None:
        del env["SLURM_TASKS_PER_NODE"]
    else:
        env["SLURM_TASKS_PER_NODE"] = per_node
    _set_launcher_env(monkeypatch, env)
    with pytest.raises(ConfigError, match=f"SLURM_NODEID={node}"):
        gpu_slot()


def test_set_tf32_returns_the_previous_setting_and_leaves_every_reader_working():
    """The switch round-trips, and afterwards torch's TF32 state can still be read through every API
    (torch >= 2.9 raises in get_float32_matmul_precision and `allow_tf32` when the CUDA matmul's new
    `fp32_precision` was set alone: inductor's max-autotune reads them)."""
    matmul = torch.backends.cuda.matmul
    raw = torch.get_float32_matmul_precision()
    try:
        set_tf32(True)
        assert set_tf32(False) is True
        assert torch.get_float32_matmul_precision() == "highest" and not matmul.allow_tf32
        assert set_tf32(True) is False
        assert torch.get_float32_matmul_precision() == "high" and matmul.allow_tf32
        if hasattr(matmul, "fp32_precision"):
            assert matmul.fp32_precision == "tf32"
    finally:
        torch.set_float32_matmul_precision(raw)


@needs_glibc_2_35
def test_a_cpu_rank_reuses_the_memory_of_freed_tensors():
    """training.setup_device on the CPU has malloc keep freed blocks (hardware.reuse_freed_host_memory): a big
    tensor freed and allocated again costs no page faults, where it cost one per 4 KiB page (a 16 MiB
    [tokens, vocab] tensor per microbatch made 12K-42K faults a step of a `make train` rank)."""
    assert new_block_faults("from megatron_mini.config import TrainConfig\n"
                            "from megatron_mini.training import setup_device\n"
                            "setup_device(TrainConfig(device='cpu'))") < 100


MMAP, TRIM = hardware.M_MMAP_THRESHOLD, hardware.M_TRIM_THRESHOLD


class _Mallopt:
    """glibc's mallopt (malloc.c) as far as reuse_freed_host_memory reaches it: M_MMAP_THRESHOLD refused above
    `mmap_max` (HEAP_MAX_SIZE / 2 before 2.35; None: no limit), M_TRIM_THRESHOLD always taken; `takes_nothing`: musl's
    stub, which returns 0. `settings`: what took."""

    def __init__(self, mmap_max=None, takes_nothing=False):
        self.mmap_max, self.takes_nothing, self.settings = mmap_max, takes_nothing, {}

    def mallopt(self, param, value):
        if self.takes_nothing or (param == MMAP and self.mmap_max and value > self.mmap_max):
            return 0
        self.settings[param] = value
        return 1


@pytest.mark.parametrize("libc, took, settings", [
    (_Mallopt(), True, {MMAP: 1 << 30, TRIM: 1 << 30}),                  # glibc >= 2.35
    (_Mallopt(mmap_max=32 << 20), True, {MMAP: 32 << 20, TRIM: 1 << 30}),  # glibc < 2.35: the largest it takes
    (_Mallopt(takes_nothing=True), False, {}),                           # musl
    (TypeError("LoadLibrary() argument 1 must be str, not None"), False, None),   # Windows' ctypes.CDLL(None)
    (OSError("no such library"), False, None),
], ids=["glibc", "glibc-2.34", "musl", "windows", "no-libc"])
def test_reuse_freed_host_memory_never_sets_the_trim_threshold_alone(libc, took, settings, monkeypatch):
    """hardware.reuse_freed_host_memory with the C libraries' mallopt: a glibc before 2.35 refuses an mmap threshold
    of 1 GiB, so the largest it takes, 32 MiB, is set, never M_TRIM_THRESHOLD alone (which fixes the mmap threshold
    where it stands: 3.2M page faults in 20 steps of a 1-rank run, against 1.4M without either); a libc whose mallopt
    takes nothing, or none to load, changes nothing and is no error."""
    def cdll(name):
        if isinstance(libc, Exception):
            raise libc
        return libc
    monkeypatch.setattr(hardware.ctypes, "CDLL", cdll)
    assert hardware.reuse_freed_host_memory() is took
    if settings is not None:
        assert libc.settings == settings


def test_peak_table_and_tf32():
    assert math_dtype("fp32", tf32=True) == "tf32" and math_dtype("fp32", tf32=False) == "fp32"
    assert math_dtype("bf16", tf32=True) == "bf16"
    assert GPUS["h100-80gb"].tflops["bf16"] == 989.4 and GPUS["a100-80gb"].tflops["bf16"] == 312.0
    cpu = torch.device("cpu")
    assert peak_tflops(cpu, "bf16", True) is None                  # unknown: no MFU is claimed
    assert peak_tflops(cpu, "bf16", True, override=123.0) == 123.0


def test_gpu_names_pick_their_own_entry():
    """Names as torch.cuda.get_device_name gives them: an NVL card is not taken for the SXM one whose
    name it contains (an H200 NVL's dense bf16 peak is 835.5, not 989.4)."""
    names = {"NVIDIA H100 80GB HBM3": "h100-80gb", "NVIDIA H100 PCIe": "h100-pcie", "NVIDIA H100 NVL": "h100-nvl",
             "NVIDIA H200": "h200", "NVIDIA H200 NVL": "h200-nvl", "NVIDIA A100-SXM4-80GB": "a100-80gb",
             "NVIDIA A100-PCIE-40GB": "a100-40gb", "NVIDIA A100 80GB PCIe": "a100-80gb",
             "NVIDIA A100-SXM-80GB": "a100-80gb", "NVIDIA PG509-210": "a100-80gb", "NVIDIA GH200 480GB": "gh200",
             "NVIDIA GH200 144G HBM3e": "gh200-144g",
             "NVIDIA GeForce RTX 4090": None}
    assert {name: gpu_key_of_name(name) for name in names} == names
    assert GPUS[gpu_key_of_name("NVIDIA H200 NVL")].tflops["bf16"] == 835.5


def test_a_gpu_missing_from_the_table_says_why_there_is_no_mfu(monkeypatch):
    """An unknown GPU gets one start-up note naming it and precision.peak_tflops (the console line just had no
    MFU); a known one, a given peak, or a CPU get none. (CUDA is stood in for: only its name is read.)"""
    from megatron_mini.config import PrecisionConfig, TrainConfig
    from megatron_mini.logger import Throughput

    cuda = torch.device("cuda", 0)
    for name, peak, expected in (("NVIDIA GeForce RTX 4090", 0.0, True), ("NVIDIA H100 80GB HBM3", 0.0, False),
                                 ("NVIDIA GeForce RTX 4090", 165.2, False)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        cfg = TrainConfig(precision=PrecisionConfig(dtype="fp32", peak_tflops=peak))
        note = Throughput(cfg, 1, cuda, "nccl", rank=0).missing_peak_note()
        assert (note is not None) == expected, (name, peak, note)
        if expected:
            assert name in note and "precision.peak_tflops" in note and "tf32 peak" in note, note
    assert Throughput(TrainConfig(), 1, torch.device("cpu"), "gloo", rank=0).missing_peak_note() is None


def test_flops_per_token_equals_torch_flop_count():
    """ModelConfig.flops_per_token() (6N + 12 L h s) is what torch's FLOP counter measures for one
    forward + backward of the model (tp=1, attention through SDPA's math backend so its matmuls count)."""
    model = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, seq_len=32, vocab_size=300)
    cpu = torch.device("cpu")
    (chunk,) = build_chunks(model, ParallelContext.one_device(cpu), [(0, model.num_layers + 2)], 1, cpu)
    b = 3
    ids = torch.randint(0, model.vocab_size, (b, model.seq_len + 1))
    with FlopCounterMode(display=False) as counter, sdpa_kernel([SDPBackend.MATH]):
        chunk(ids[:, :-1], ids[:, 1:]).sum().backward()
    assert counter.get_total_flops() == model.flops_per_token() * b * model.seq_len


def test_console_reports_tflops_mfu_and_memory(small_data, tmp_path):
    """On 2 ranks (dp=2): tokens/s is the run's tokens (steps x gbs x seq_len) over its time, and TFLOP/s per
    rank is the README's FLOPs per token x tokens/s / 2 ranks. The peak memory of a line is its rank's, and says
    so: the console's (rank 0's) is summary.json's, rank 1's log has its own (it read as the job's)."""
    cfg = small_config(small_data, tmp_path, steps=2, log_interval=1, **{"precision.peak_tflops": 0.001})
    started = time.perf_counter()
    history = train_on_ranks(2, cfg)
    wall = time.perf_counter() - started
    s = history["summary"]
    assert 0 < s["elapsed_s"] < wall
    assert s["tokens_per_s"] == pytest.approx(cfg.steps * cfg.gbs * cfg.model.seq_len / s["elapsed_s"], rel=1e-9)
    expected = cfg.model.flops_per_token() * s["tokens_per_s"] / 2 / 1e12
    assert s["tflops"] == pytest.approx(expected, rel=1e-9)
    assert s["mfu"] == pytest.approx(s["tflops"] / 0.001, rel=1e-9)
    assert s["peak_mem_gib"] > 0
    # the console's lines, as rank 0's log has them after their time stamp (the rank is a pooled process,
    # whose stdout no fixture of this test captures)
    log = (tmp_path / "logs" / "rank0000.log").read_text()
    lines = re.findall(r"^\S+ \S+ ((?:step|done:) .*(?:tok/s|included).*)$", log, re.M)
    assert len(lines) == 3 and all(" TFLOP/s/rank" in line and "MFU " in line for line in lines), lines
    assert lines[-1].endswith(f"| peak mem {s['peak_mem_gib']:.2f} GiB (rank 0)"), lines
    assert all(re.search(r"\| peak mem \d+\.\d\d GiB \(rank 0\)( \||$)", line) for line in lines), lines
    other = (tmp_path / "logs" / "rank0001.log").read_text()
    assert len(re.findall(r"\| peak mem \d+\.\d\d GiB \(rank 1\)( \||$)", other, re.M)) == 3, other


def test_step_lines_leave_out_evaluation_and_save_time(small_data, tmp_path):
    """Each step line's tokens/s is its steps' own: the evaluation and the save after a line are not
    charged to the next one (which showed a tenth of the real rate after each evaluation)."""
    cfg = small_config(small_data, tmp_path, steps=6, log_interval=1, eval_interval=2, save_interval=3, eval_iters=1)
    spawn(1, train_on_a_fake_clock, cfg, init_group=False)
    rates = [r["tokens_per_s"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
             if "tokens_per_s" in r]
    assert rates == [cfg.gbs * cfg.model.seq_len / 1.0] * cfg.steps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("layout", [dict(tp=2, pp=2, sp=True), dict(tp=2, sp=True, zero=1)],
                         ids=["tp2-pp2-sp", "tp2-dp2-sp-zero1"])
def test_four_ranks_share_one_gpu_over_gloo(small_data, tmp_path, layout):
    """4 ranks sharing cuda:0 over gloo (collectives on CUDA tensors, p2p staged on the host, RNG tracker,
    kernels under SP and checkpoints on CUDA; at dp=2 ZeRO-1's reduce-scatter and its in-place weight
    gather beside the forward) train like 1 rank on the GPU, fp32 with TF32 off: per-step loss within 1e-5
    relative, final weights within 1e-5. MFU is the GPU's: k ranks on one GPU count k times a rank's TFLOP/s."""
    common = {"device": "cuda", "precision.tf32": False, "steps": 6, "precision.peak_tflops": 100.0}
    ref = train_on_ranks(1, small_config(small_data, tmp_path / "one", **common))
    shared = train_on_ranks(4, dataclasses.replace(small_config(small_data, tmp_path / "four", **common), **layout))
    assert_same_training(ref, shared, rtol=1e-5)      # (the GPU's sums: not measured at the CPU runs' 1e-6)
    k = 4 / min(4, torch.cuda.device_count())
    for run, share in ((ref, 1), (shared, k)):
        assert run["summary"]["mfu"] == pytest.approx(share * run["summary"]["tflops"] / 100.0, rel=1e-9)


def test_mfu_of_a_gpu_that_ranks_share():
    """TFLOP/s stays per rank (the job's model FLOP/s / world size); MFU is the GPU's use: where 4 ranks share
    one, 4 times the rank's TFLOP/s over its peak (it read a quarter of the GPU's use)."""
    from megatron_mini.config import TrainConfig
    from megatron_mini.logger import Throughput
    cfg = TrainConfig()
    cfg.precision.peak_tflops = 100.0
    r = Throughput(cfg, 4, torch.device("cpu"), "gloo", ranks_per_device=4, rank=0)(tokens=10_000, seconds=2.0)
    assert r["tflops"] == pytest.approx(cfg.model.flops_per_token() * 5_000 / 4 / 1e12, rel=1e-12)
    assert r["mfu"] == pytest.approx(4 * r["tflops"] / 100.0, rel=1e-12)


@pytest.mark.parametrize("device, local_world, gpus, share", [
    ("cuda:0", 4, 1, 4.0), ("cuda:1", 4, 2, 2.0), ("cuda:0", 3, 2, 1.5), ("cuda:3", 4, 8, 1.0), ("cpu", 4, 0, 1.0),
    ("cpu", 4, 2, 1.0)])
def test_ranks_per_gpu(device, local_world, gpus, share):
    """The share that the MFU multiplies a rank's TFLOP/s by: ranks over the GPUs they take round-robin
    (choose_device with device=cuda), fewer ranks than GPUs one each, none on a CPU (even with GPUs present)."""
    assert ranks_per_gpu(torch.device(device), local_world, gpus) == share


def test_local_rank_without_local_world_size_is_refused_on_every_rank(monkeypatch):
    """A launcher that sets RANK, WORLD_SIZE and LOCAL_RANK but not LOCAL_WORLD_SIZE (DeepSpeed's sets LOCAL_SIZE,
    torch.distributed.launch before torchrun none): each rank counted LOCAL_RANK + 1 ranks on its node, so with 2
    ranks on one GPU rank 0 took cuda:0 on NCCL while rank 1 refused (device=auto) or took it on gloo (device=cuda),
    and rank 0 waited for it until timeout_s. Every rank now stops with the same message, naming the variable."""
    outcomes = []
    for device in ("auto", "cuda"):
        for local_rank in range(2):
            _set_launcher_env(monkeypatch, {"RANK": str(local_rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(local_rank)})
            try:
                outcomes.append(str(choose_device(device, "auto", *gpu_slot(), 1)))
            except ConfigError as e:
                outcomes.append(f"refused: {e}")
    assert len(set(outcomes)) == 1, outcomes
    assert outcomes[0].startswith("refused: ") and "LOCAL_WORLD_SIZE" in outcomes[0], outcomes


def test_a_job_on_several_nodes_without_master_addr_is_refused_on_every_rank(monkeypatch):
    """srun on 2 nodes without MASTER_ADDR: each node's ranks fell back to 127.0.0.1 and the job met nowhere until
    timeout_s. Every rank of every node now refuses at once, naming the variable; on one node it stays optional."""
    from megatron_mini.launch import launch_env
    no_address = {k: v for k, v in SRUN_5_OF_8.items() if k != "MASTER_ADDR"}
    refusals = set()
    for rank in range(8):
        _set_launcher_env(monkeypatch, {**no_address, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank % 4),
                                        "SLURM_NODEID": str(rank // 4)})
        with pytest.raises(ConfigError) as refused:
            launch_env()
        refusals.add(str(refused.value))
    assert len(refusals) == 1 and "spans several nodes (8 ranks, 4 on this one) but MASTER_ADDR" in refusals.pop()
    _set_launcher_env(monkeypatch, {**no_address, "SLURM_TASKS_PER_NODE": "8", "SLURM_NODEID": "0"})
    assert launch_env() == (5, 8, 1, 8)


@pytest.mark.parametrize("port", ["²", "29²"])
def test_a_master_port_of_superscript_digits_is_refused_in_one_line(monkeypatch, port):
    """str.isdigit() holds for superscript digits, which int() refuses: int()'s ValueError traceback, not the
    one-line ConfigError MASTER_PORT=abc gets."""
    from megatron_mini.launch import launch_env
    _set_launcher_env(monkeypatch, {"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": port})
    with pytest.raises(ConfigError, match="is not a TCP port"):
        launch_env()


C_MODULE = """#include <Python.h>
static struct PyModuleDef probe = {PyModuleDef_HEAD_INIT, "probe", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_probe(void) { return PyModule_Create(&probe); }
"""


def _triton_build(tmp_path) -> BaseException | None:
    """What Triton's own build of a C module that includes Python.h (triton.runtime.build._build, which builds its
    CUDA driver's utilities and each kernel's launcher; on any machine) raises; None where it builds."""
    from triton.runtime import build
    if hasattr(build, "_find_compiler"):            # (triton >= 3.4 keeps the compiler it found)
        build._find_compiler.cache_clear()
    src = tmp_path / "probe.c"
    src.write_text(C_MODULE)
    lists = {k: [] for k in ("library_dirs", "include_dirs", "libraries", "ccflags")
             if k in inspect.signature(build._build).parameters}
    try:
        build._build("probe", str(src), str(tmp_path), **lists)
    except (RuntimeError, OSError, subprocess.CalledProcessError) as e:
        return e
    return None


@needs_triton
@pytest.mark.parametrize("case", ["as-is", "no-compiler", "cc-not-found", "cc-on-path", "no-python-headers"])
def test_what_triton_lacks_to_build_is_what_fails_its_own_build(case, tmp_path, monkeypatch):
    """model.triton_build_missing, by which train.py refuses torch.compile and the Triton kernels on CUDA before
    they fail at the first step, names what fails Triton's own build of a C module, and nothing where it builds:
    no C compiler on PATH (no $CC, gcc or clang), a $CC that is not there, Python.h not in the include directory;
    a $CC found on PATH builds."""
    import sysconfig
    from megatron_mini.model import triton_build_missing
    compiler = shutil.which("gcc") or shutil.which("clang")
    if case in ("as-is", "cc-on-path") and (compiler is None or triton_build_missing() is not None):
        pytest.skip(f"this machine cannot build C for Triton: {triton_build_missing()}")
    bin_dir, empty = tmp_path / "bin", tmp_path / "include"
    bin_dir.mkdir()
    empty.mkdir()
    monkeypatch.delenv("CC", raising=False)
    if case == "no-compiler":
        monkeypatch.setenv("PATH", str(bin_dir))
    elif case == "cc-not-found":
        monkeypatch.setenv("CC", "/nonexistent/cc")
    elif case == "cc-on-path":
        (bin_dir / "mycc").symlink_to(compiler)
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")    # (gcc runs `as` from PATH)
        monkeypatch.setenv("CC", "mycc")
    elif case == "no-python-headers":
        get_paths = sysconfig.get_paths
        monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {**get_paths(*a, **k), "include": str(empty)})
    (tmp_path / "build").mkdir()
    why, failed = triton_build_missing(), _triton_build(tmp_path / "build")
    what = "Triton builds C there (its driver's utilities and each kernel's launcher)"
    expected = {"no-compiler": (RuntimeError, f"{what} and finds no C compiler (no $CC, gcc or clang on PATH): "
                                              "install gcc (Debian/Ubuntu: apt install gcc) or set CC to one"),
                "cc-not-found": (FileNotFoundError, f"{what} with $CC=/nonexistent/cc, which is not found: set CC to "
                                                    "a C compiler, or unset it (gcc, else clang)"),
                "no-python-headers": (subprocess.CalledProcessError, f"{what} that includes Python.h, which is not "
                                      f"in {empty}: install Python's headers (Debian/Ubuntu: apt install python"
                                      f"{sys.version_info.major}.{sys.version_info.minor}-dev)")}
    if case in expected:
        assert isinstance(failed, expected[case][0]) and why == expected[case][1], (repr(failed), why)
    else:
        assert failed is None and why is None, (repr(failed), why)


@pytest.mark.parametrize("compile_, kernels, refused", [
    (True, "torch", "compile=true on CUDA: {why}; or set compile=false."),
    (None, "torch", "compile (unset: true on CUDA) on CUDA: {why}; or set compile=false."),
    (False, "layer_norm", "kernels=layer_norm (the Triton layer_norm) on CUDA: {why}; or set kernels=torch."),
    (True, "triton", "compile=true and kernels=triton (the Triton layer_norm, attention, cross_entropy) on CUDA: "
                     "{why}; or set compile=false and kernels=torch."),
    (False, "torch", None)])
def test_cuda_runs_that_need_triton_are_refused_where_it_cannot_build(compile_, kernels, refused, monkeypatch):
    """training.setup_device on a CUDA device (mocked) refuses, before any collective, a run whose torch.compile or
    Triton kernels need Triton's C build where it cannot build (model.triton_build_missing: here $CC is not there),
    saying which of the two needs it and how to do without; an eager run of torch's ops needs no build."""
    from megatron_mini import training
    from megatron_mini.model import triton_build_missing
    monkeypatch.setattr(training, "choose_device", lambda *a: (torch.device("cuda", 0), "nccl"))
    monkeypatch.setattr(training, "configure_device", lambda *a: None)
    monkeypatch.setattr(training, "triton_installed", lambda: True)         # (kernels=layer_norm's first check)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    why = triton_build_missing()
    assert why and "$CC=/nonexistent/cc" in why
    cfg = TrainConfig(device="cuda", compile=compile_, kernels=kernels, wandb=WandbConfig(mode="disabled"))
    if refused is None:
        assert training.setup_device(cfg) == (torch.device("cuda", 0), "nccl")
    else:
        with pytest.raises(ConfigError) as e:
            training.setup_device(cfg)
        assert str(e.value) == refused.format(why=why)
