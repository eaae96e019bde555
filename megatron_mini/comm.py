"""Every collective and p2p transfer goes through here, and is counted.

A `Group` is one process group seen from this rank (name "tp", "dp", "pp", "emb", "mp" or
"world"). Each call records (group name, op, bytes) in the group's `Ledger`, so tests compare
a step's traffic with the analytic count. Bytes are those of the full tensor involved: the
reduced tensor (all_reduce), the gathered output (all_gather), the unreduced input
(reduce_scatter), the message (send/recv). Size-1 groups do nothing and record nothing.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Ledger:
    """Counts (group, op) -> [calls, bytes]."""
    records: list = field(default_factory=list)

    def record(self, group: str, op: str, nbytes: int) -> None:
        self.records.append((group, op, nbytes))

    def reset(self) -> None:
        self.records.clear()

    def summary(self) -> dict:
        calls, nbytes = Counter(), Counter()
        for group, op, b in self.records:
            calls[(group, op)] += 1
            nbytes[(group, op)] += b
        return {key: (calls[key], nbytes[key]) for key in calls}


@dataclass
class Group:
    name: str
    ranks: list          # global ranks, in group order
    pg: object           # torch ProcessGroup, or None for a group of one
    ledger: Ledger

    def __post_init__(self):
        self.size = len(self.ranks)
        self.rank = self.ranks.index(dist.get_rank()) if self.size > 1 else 0      # this rank's index
        # gloo moves CUDA tensors in collectives but not in point-to-point: stage those on the host
        self.p2p_via_host = self.pg is not None and dist.get_backend(self.pg) == "gloo"


# torch >= 2.13 names the flat collectives *_single (the *_tensor names are deprecated there)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(t: torch.Tensor, group: Group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """In-place all-reduce of `t` over `group`; returns a work handle when async_op."""
    if group.size == 1:
        return None
    group.ledger.record(group.name, "all_reduce", _nbytes(t))
    return dist.all_reduce(t, op=op, group=group.pg, async_op=async_op)


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group: Group, async_op: bool = False):
    """Flat all-gather: `out` (size * shard.numel()) receives every rank's `shard` in group order."""
    if group.size == 1:
        return None
    group.ledger.record(group.name, "all_gather", _nbytes(out))
    return _all_gather_flat(out, shard, group=group.pg, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, t: torch.Tensor, group: Group, async_op: bool = False):
    """Flat reduce-scatter of `t` into `out` (t.numel() / size elements)."""
    if group.size == 1:
        return None
    group.ledger.record(group.name, "reduce_scatter", _nbytes(t))
    return _reduce_scatter_flat(out, t, group=group.pg, async_op=async_op)


def all_gather(t: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim` (group order)."""
    if group.size == 1:
        return t
    t = t.movedim(dim, 0).contiguous()
    out = torch.empty((group.size * t.shape[0],) + t.shape[1:], dtype=t.dtype, device=t.device)
    all_gather_into(out, t, group)
    return out.movedim(0, dim).contiguous() if dim else out


def reduce_scatter(t: torch.Tensor, group: Group, dim: int = 0) -> torch.Tensor:
    """Sum `t` over the group and keep this rank's 1/size slice along `dim`."""
    if group.size == 1:
        return t
    t = t.movedim(dim, 0).contiguous()
    out = torch.empty((t.shape[0] // group.size,) + t.shape[1:], dtype=t.dtype, device=t.device)
    reduce_scatter_into(out, t, group)
    return out.movedim(0, dim).contiguous() if dim else out


def broadcast(t: torch.Tensor, group: Group, src_index: int = 0) -> None:
    if group.size == 1:
        return
    group.ledger.record(group.name, "broadcast", _nbytes(t))
    dist.broadcast(t, src=group.ranks[src_index], group=group.pg)


def batch_p2p(ops: list, group: Group) -> None:
    """Post [(\"send\"|\"recv\", tensor, peer_index)] together and wait for all of them.
    On gloo, CUDA tensors travel through host copies (sent from a copy, received into one)."""
    if not ops:
        return
    p2p, staged = [], []
    for kind, tensor, peer in ops:
        group.ledger.record(group.name, kind, _nbytes(tensor))
        wire = tensor
        if group.p2p_via_host and tensor.is_cuda:
            wire = tensor.cpu() if kind == "send" else torch.empty(tensor.shape, dtype=tensor.dtype)
            if kind == "recv":
                staged.append((tensor, wire))
        fn = dist.isend if kind == "send" else dist.irecv
        p2p.append(dist.P2POp(fn, wire, group.ranks[peer], group=group.pg))
    for work in dist.batch_isend_irecv(p2p):
        work.wait()
    for tensor, wire in staged:
        tensor.copy_(wire)
