"""Layout-free checkpoints: every tensor stored full, under its parameter's global name.

    {run_dir}/checkpoints/step_000100/
        model_pp00.pt ...   {global name: full fp32 weight} of each pipeline stage
        optim_pp00.pt ...   {global name: {master, exp_avg, exp_avg_sq}}, step count, loss scaler
        rng_rank0000.pt ... each rank's dropout RNG streams (restored when the layout is the same)
        meta.json           step, consumed_samples, layout, config
    {run_dir}/checkpoints/latest   the name of the newest complete checkpoint

All ranks write into `step_N.tmp/`; once every file is there, rank 0 renames it to
`step_N/` and only then rewrites `latest` (tmp + rename), so a crash never leaves a
half-written checkpoint behind the `latest` pointer. A checkpoint loads into any layout
(tp, pp, vpp, dp, ZeRO), since each rank slices what it needs from the full tensors.
"""
from __future__ import annotations

import glob
import json
import os
import shutil

import torch
import torch.distributed as dist

from . import comm
from .tensor_parallel import gather_full, shard

OPTIM_STATES = ("master", "exp_avg", "exp_avg_sq")


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _atomic_write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def latest_checkpoint(run_dir: str) -> str | None:
    pointer = os.path.join(run_dir, "checkpoints", "latest")
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        path = os.path.join(run_dir, "checkpoints", f.read().strip())
    return path if os.path.isdir(path) else None


def _full_optimizer_states(optimizer) -> dict:
    """{buffer index: {state: flat tensor over the whole buffer}}, all-gathered over DP with ZeRO."""
    out = {}
    for i, buf in enumerate(optimizer.buffers):
        flat = {k: torch.zeros_like(buf.grads_flat) for k in OPTIM_STATES}
        for r in (r for r in optimizer.ranges if r.buffer is buf):
            bucket = next(b for b in buf.buckets if b.start <= r.lo < b.end)
            for k in OPTIM_STATES:
                local = getattr(r, k).float()
                if optimizer.zero and buf.dp > 1:
                    comm.all_gather_into(flat[k][bucket.start:bucket.end], local.contiguous(), buf.mesh.dp_group)
                else:
                    flat[k][r.lo:r.hi] = local
        out[i] = flat
    return out


def save(path: str, step: int, consumed_samples: int, chunks, optimizer, rng, mesh, config: dict) -> None:
    tmp = path + ".tmp"
    if mesh.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    writer = mesh.tp_rank == 0 and mesh.dp_rank == 0
    model, optim = {}, {}
    states = _full_optimizer_states(optimizer)
    for i, buf in enumerate(optimizer.buffers):
        for p, name in buf.names.items():
            lo, n = buf.offsets[p], p.numel()
            model[name] = gather_full(p.detach().float(), p.spec, mesh.tp_group).cpu()
            optim[name] = {k: gather_full(states[i][k][lo:lo + n].view(p.shape), p.spec, mesh.tp_group).cpu()
                           for k in OPTIM_STATES}
    if writer:
        torch.save(model, os.path.join(tmp, f"model_pp{mesh.pp_rank:02d}.pt"))
        extra = {"step_count": optimizer.step_count,
                 "scaler": optimizer.scaler.state_dict() if optimizer.scaler else None}
        torch.save({"params": optim, **extra}, os.path.join(tmp, f"optim_pp{mesh.pp_rank:02d}.pt"))
    torch.save(rng.get_states(), os.path.join(tmp, f"rng_rank{mesh.rank:04d}.pt"))
    if mesh.rank == 0:
        meta = {"step": step, "consumed_samples": consumed_samples, "world_size": mesh.world_size,
                "layout": {"tp": mesh.tp, "pp": mesh.pp, "dp": mesh.dp}, "config": config}
        _atomic_write_text(os.path.join(tmp, "meta.json"), json.dumps(meta, indent=2))
    _barrier()
    if mesh.rank == 0:
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
        _atomic_write_text(os.path.join(os.path.dirname(path), "latest"), os.path.basename(path))
    _barrier()


def load_model_tensors(path: str) -> dict:
    """{global name: full tensor} from every pipeline stage's file of a checkpoint."""
    tensors = {}
    for f in sorted(glob.glob(os.path.join(path, "model_pp*.pt"))):
        tensors.update(torch.load(f, weights_only=True, map_location="cpu"))
    return tensors


def read_meta(path: str) -> dict:
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


@torch.no_grad()
def load(path: str, optimizer, rng, mesh) -> dict:
    """Restore weights and optimizer state (any layout) and, same layout only, RNG; returns meta."""
    meta = read_meta(path)
    model = load_model_tensors(path)
    optim = {}
    for f in sorted(glob.glob(os.path.join(path, "optim_pp*.pt"))):
        saved = torch.load(f, weights_only=True, map_location="cpu")
        optim.update(saved["params"])
        optimizer.step_count = saved["step_count"]
        if optimizer.scaler and saved["scaler"]:
            optimizer.scaler.load_state_dict(saved["scaler"])
    for buf in optimizer.buffers:
        for p, name in buf.names.items():
            p.copy_(shard(model[name], p.spec, mesh.tp, mesh.tp_rank))
    for r in optimizer.ranges:
        for p, name, a, b in r.buffer.segments(r.lo, r.hi):
            first = r.buffer.offsets[p]
            for k in OPTIM_STATES:
                flat = shard(optim[name][k], p.spec, mesh.tp, mesh.tp_rank).reshape(-1)
                getattr(r, k)[a - r.lo:b - r.lo] = flat[a - first:b - first]
        if r.master.data_ptr() != r.param.data_ptr():
            r.param.copy_(r.master)
    rng_file = os.path.join(path, f"rng_rank{mesh.rank:04d}.pt")
    if meta["world_size"] == mesh.world_size and meta["layout"] == {"tp": mesh.tp, "pp": mesh.pp, "dp": mesh.dp}:
        rng.set_states(torch.load(rng_file, weights_only=True))
    return meta
