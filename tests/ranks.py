"""The one helper that runs a function on N gloo ranks inside pytest.

    results = spawn(4, fn, arg1, arg2)   # fn(arg1, arg2) runs on every rank; returns [result_rank0, ...]

Each rank is a fresh process forked from a fork server that imported torch and the library once
(forkserver: nothing CUDA-initialised is ever forked, so ranks may use a GPU; importing torch in every
rank would cost seconds of CPU each), has OMP_NUM_THREADS=1, a gloo process group on a free
localhost port (launch.free_port; RANK/WORLD_SIZE/MASTER_* set as torchrun would), and the test process's sys.path
(the fork server takes it on). A failing rank's traceback is raised in the test; a hang ends at `timeout`.
"""
from __future__ import annotations

import os
import traceback
from datetime import timedelta

import torch.multiprocessing as mp

from megatron_mini.launch import free_port


def _rank_main(rank, world_size, port, fn, args, queue, init_group, collected):
    os.environ.update(
        OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        WANDB_MODE="disabled",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        if init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        queue.put((rank, True, fn(*args)))
    except BaseException:  # noqa: BLE001 - reported to the parent test
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if init_group and dist.is_initialized():
            dist.destroy_process_group()
        # alive until the test has read every result: a tensor in the queue is a handle to this process's shared
        # memory, which the reader fetches from it (torch 2.4 failed in rebuild_storage_fd where the rank had gone)
        collected.wait(timeout=600)


PRELOAD = ["torch", "torch.distributed", "megatron_mini.training", "megatron_mini.plan_meta", "pytest", "harness"]


def _context():
    """The fork-server context, its server preloading PRELOAD (started once, on first use)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def spawn(world_size: int, fn, *args, timeout: float = 600, init_group: bool = True):
    """Run fn(*args) on `world_size` ranks; return the list of per-rank results (rank order)."""
    assert 1 <= world_size <= 8, "tests keep world sizes at 8 or fewer"
    ctx = _context()
    queue, collected = ctx.Queue(), ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, fn, args, queue, init_group, collected))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, errors = {}, []
    try:
        for _ in range(world_size):
            rank, ok, value = queue.get(timeout=timeout)
            if ok:
                results[rank] = value
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                break
    finally:
        collected.set()
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
