"""Every collective and p2p transfer goes through here, and is counted.

A `Group` is one process group seen from this rank (name "tp", "dp", "pp", "emb", "mp" or
"world"). Each call records (group name, op, bytes) in the group's `Ledger`, so tests compare
a step's traffic with the analytic count. Bytes are those of the full tensor involved: the
reduced tensor (all_reduce), the gathered output (all_gather), the unreduced input
(reduce_scatter), the message (send/recv). An async collective that its caller overlaps with a
GEMM also records that GEMM's FLOPs (`beside_flops`), for the planner. Size-1 groups do nothing
and record nothing.
A virtual group (one of a ParallelMesh built for a rank that is not this process, to plan a
layout on the meta device) records every call and moves nothing: only shapes matter there.
"""
from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .errors import CommError


@dataclass
class Ledger:
    """Counts the calls of each (group, op, bytes, FLOPs of the GEMM it ran beside): a step has a few
    dozen distinct kinds, so the ledger stays the same size over a run of any length."""
    counts: Counter = field(default_factory=Counter)

    def record(self, group: str, op: str, nbytes: int, beside_flops: float = 0.0) -> None:
        self.counts[(group, op, nbytes, beside_flops)] += 1

    def reset(self) -> None:
        self.counts.clear()

    def summary(self) -> dict:
        """{(group, op): (calls, bytes)}."""
        calls, nbytes = Counter(), Counter()
        for (group, op, b, _), n in self.counts.items():
            calls[(group, op)] += n
            nbytes[(group, op)] += n * b
        return {key: (calls[key], nbytes[key]) for key in calls}

    def overlaps(self) -> dict:
        """{(group, op, bytes, FLOPs of the GEMM it ran beside): calls} of the collectives that recorded
        `beside_flops` (those of tensor_parallel._Linear's backward; the DP buckets, which overlap the
        backward as a whole, record none)."""
        return dict(sorted((key, n) for key, n in self.counts.items() if key[3]))


@dataclass
class Group:
    name: str
    ranks: list          # global ranks, in group order
    pg: object           # torch ProcessGroup; None for a group of one, or a virtual group
    ledger: Ledger
    me: int | None = None    # a virtual group's rank (global); None: this process's

    def __post_init__(self):
        self.size = len(self.ranks)
        self.virtual = self.me is not None and self.size > 1
        me = self.me if self.me is not None else (dist.get_rank() if self.size > 1 else self.ranks[0])
        self.rank = self.ranks.index(me)                                  # this rank's index in the group
        # gloo moves CUDA tensors in most collectives but not in point-to-point or gather: stage those on the host
        self.via_host = self.pg is not None and dist.get_backend(self.pg) == "gloo"


# torch >= 2.13 names the flat collectives *_single (the *_tensor names are deprecated there)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@contextlib.contextmanager
def _named(group: Group, op: str):
    """Re-raise torch's failure of `op` as a CommError that names this rank, the op and the group."""
    try:
        yield
    except RuntimeError as e:           # torch's DistBackendError / DistError, gloo's timeouts
        lines = [line for line in str(e).splitlines() if line.strip()]
        raise CommError(f"rank {dist.get_rank()}: {op} over the {group.name} group (ranks {group.ranks}) failed: "
                        f"{lines[0] if lines else type(e).__name__}") from e


class Work:
    """An async collective's handle whose wait() fails as a CommError (None: a virtual group's)."""

    def __init__(self, work, group: Group, op: str):
        self.work, self.group, self.op = work, group, op

    def wait(self) -> None:
        if self.work is not None:
            with _named(self.group, self.op):
                self.work.wait()


def _run(group: Group, name: str, nbytes: int, fn, *args, async_op: bool = False, beside_flops: float = 0.0,
         **kwargs):
    """Record (group, name, bytes, beside_flops) and run the collective `fn` on the group's process group.
    beside_flops: the FLOPs of the GEMM the caller runs while this async collective is in flight."""
    group.ledger.record(group.name, name, nbytes, beside_flops)
    work = None
    if not group.virtual:
        with _named(group, name):
            work = fn(*args, group=group.pg, async_op=async_op, **kwargs)
    return Work(work, group, name) if async_op else None


def all_reduce(t: torch.Tensor, group: Group, op=dist.ReduceOp.SUM, async_op: bool = False,
               beside_flops: float = 0.0):
    """In-place all-reduce of `t` over `group`; returns a work handle when async_op."""
    if group.size == 1:
        return None
    return _run(group, "all_reduce", _nbytes(t), dist.all_reduce, t, op=op, async_op=async_op,
                beside_flops=beside_flops)


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group: Group, async_op: bool = False,
                    beside_flops: float = 0.0):
    """Flat all-gather: `out` (size * shard.numel()) receives every rank's `shard` in group order."""
    if group.size == 1:
        return None
    return _run(group, "all_gather", _nbytes(out), _all_gather_flat, out, shard, async_op=async_op,
                beside_flops=beside_flops)


def reduce_scatter_into(out: torch.Tensor, t: torch.Tensor, group: Group, async_op: bool = False,
                        beside_flops: float = 0.0):
    """Flat reduce-scatter of `t` into `out` (t.numel() / size elements)."""
    if group.size == 1:
        return None
    return _run(group, "reduce_scatter", _nbytes(t), _reduce_scatter_flat, out, t, async_op=async_op,
                beside_flops=beside_flops)


def broadcast(t: torch.Tensor, group: Group) -> None:
    """In place: every rank's `t` becomes the group's first rank's."""
    if group.size == 1:
        return
    _run(group, "broadcast", _nbytes(t), dist.broadcast, t, src=group.ranks[0])


def all_gather(t: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim` (group order)."""
    if group.size == 1:
        return t
    t = t.movedim(dim, 0).contiguous()
    out = torch.empty((group.size * t.shape[0],) + t.shape[1:], dtype=t.dtype, device=t.device)
    all_gather_into(out, t, group)
    return out.movedim(0, dim).contiguous() if dim else out


def gather(t: torch.Tensor, group: Group) -> torch.Tensor | None:
    """Every rank's `t` stacked on a new dim 0 (group order) on the group's first rank; None on the others.
    (gloo gathers host tensors only: a CUDA `t` travels through a host copy there.)"""
    if group.size == 1:
        return t.unsqueeze(0)
    wire = t.cpu() if group.via_host else t
    out = [torch.empty_like(wire) for _ in range(group.size)] if group.rank == 0 else None
    _run(group, "gather", _nbytes(t) * group.size, dist.gather, wire, out, dst=group.ranks[0])
    return torch.stack(out).to(t.device) if out else None


def reduce_scatter(t: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Sum `t` over the group and keep this rank's 1/size slice along `dim`."""
    if group.size == 1:
        return t
    t = t.movedim(dim, 0).contiguous()
    out = torch.empty((t.shape[0] // group.size,) + t.shape[1:], dtype=t.dtype, device=t.device)
    reduce_scatter_into(out, t, group)
    return out.movedim(0, dim).contiguous() if dim else out


def batch_p2p(ops: list, group: Group, what: str = "send/recv") -> None:
    """Post [(\"send\"|\"recv\", tensor, peer_index)] together and wait for all of them; `what` names
    them in a failure's message. On gloo, CUDA tensors travel through host copies (sent from a copy,
    received into one)."""
    if not ops:
        return
    p2p, staged = [], []
    for kind, tensor, peer in ops:
        group.ledger.record(group.name, kind, _nbytes(tensor))
        if group.virtual:
            continue
        wire = tensor
        if group.via_host and tensor.is_cuda:
            wire = tensor.cpu() if kind == "send" else torch.empty(tensor.shape, dtype=tensor.dtype)
            if kind == "recv":
                staged.append((tensor, wire))
        fn = dist.isend if kind == "send" else dist.irecv
        p2p.append(dist.P2POp(fn, wire, group.ranks[peer], group=group.pg))
    with _named(group, what):
        for work in dist.batch_isend_irecv(p2p) if p2p else []:
            work.wait()
    for tensor, wire in staged:
        tensor.copy_(wire)
