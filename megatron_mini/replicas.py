"""Weights that several ranks hold must be bitwise equal: `compare` checks that they are.

Which ranks hold a parameter in common (and why their copies stay equal):
  - the DP group: every parameter (a DP rank holds a whole replica of its stage, with ZeRO-1 once the updated
    weights are all-gathered): every rank applies the same update to the same all-reduced gradient;
  - the TP group: the replicated ones (ParamSpec.tp_dim None: LayerNorms, row-parallel biases, positions): every
    TP rank computes the same gradient (with sequence parallelism, the same sum over TP);
  - the embedding group (pp > 1): the word embedding on the first stage and the output layer's copy on the last:
    both are updated with the sum of their gradients.
A difference is a fault: a kernel whose rounding differs between ranks (one that each rank autotunes on its own,
say), a missing sum, or faulty hardware. Nothing else notices it, since a checkpoint keeps one copy (DP rank 0's,
TP rank 0's, the first stage's): the run is then no longer the model of one device, and a resume would not
continue it.

Each rank hashes the bits of each parameter, P = 2^31 - 1:
    hash(x) = sum_i bits(x_i) * w_i  mod P,   w_i = ((i * A) mod P)^2 mod P + 1,  in [1, P)
(int64 throughout, CHUNK elements at a time): one element that differs always changes it (P is prime), more
cancel with a chance of about 1/P. A group all-gathers its members' hashes ([members, params], int64), so every
member sees the same differences; for the first few it then all-reduces the values themselves, to say by how
much they differ.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm
from .mesh import ParallelMesh

P = 2 ** 31 - 1
A = 48271                    # a primitive root of P (MINSTD's multiplier)
CHUNK = 1 << 22              # elements hashed at a time (three int64 temporaries of 32 MB)
SHOWN = 3                    # differing parameters measured and named per group
_INTS = {2: torch.int16, 4: torch.int32}        # a parameter's bits as integers (16- and 32-bit floats)
_GROUPS = {"dp": "DP", "tp": "TP", "emb": "embedding"}


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """hash(t) of the module doc: a 0-d int64 tensor on t's device (no host sync)."""
    bits = t.detach().reshape(-1).view(_INTS[t.element_size()])
    h = torch.zeros((), dtype=torch.int64, device=t.device)
    for lo in range(0, bits.numel(), CHUNK):
        b = bits[lo:lo + CHUNK].long()
        w = torch.arange(lo, lo + b.numel(), dtype=torch.int64, device=t.device).mul_(A).remainder_(P)
        w = w.mul_(w).remainder_(P).add_(1)                 # < 2^62: no overflow
        h = (h + b.mul_(w).remainder_(P).sum()).remainder_(P)    # |bits| * w < 2^62; a sum < 2^51
    return h


def shared(buffers: list, mesh: ParallelMesh) -> list:
    """(group, {global name: parameter}) for each group of more than one rank that holds parameters in common
    with this rank (module doc), names in the same order on every member."""
    params = {name: p for buf in buffers for p, name in buf.names.items()}
    groups = [(mesh.dp_group, params),
              (mesh.tp_group, {n: p for n, p in params.items() if p.spec.tp_dim is None}),
              (mesh.embedding_group, {n: p for n, p in params.items() if p.spec.tied})]
    return [(g, dict(sorted(ps.items()))) for g, ps in groups if g is not None and g.size > 1 and ps]


def compare(buffers: list, mesh: ParallelMesh) -> str | None:
    """None when every parameter equals its copies on the other ranks of each group (collectives of those groups
    only: every member takes part), else what differs, the same text on every member of the group where it does.
    Waits for ZeRO-1's weight gathers in flight."""
    for buf in buffers:
        buf.finish_param_gather()
    found, hashed = [], {}                       # (a parameter that several groups share is hashed once)
    for group, params in shared(buffers, mesh):
        for name, p in params.items():
            if name not in hashed:
                hashed[name] = fingerprint(p)
        own = torch.stack([hashed[name] for name in params])
        hashes = comm.all_gather(own[None], group).cpu()                     # [members, params]
        differ = [(name, p, hashes[:, i].tolist()) for i, (name, p) in enumerate(params.items())
                  if (hashes[:, i] != hashes[0, i]).any()]
        if differ:
            found.append(_describe(group, differ, len(params)))
    return "; ".join(found) or None


def _describe(group, differ: list, total: int) -> str:
    """One group's differences: the first SHOWN parameters, which ranks hold which copy, and by how much they
    differ (an all-reduce of their values over the group: every member knows the same `differ`)."""
    shown = differ[:SHOWN]
    values = torch.cat([p.detach().float().reshape(-1) for _, p, _ in shown])
    extremes = torch.stack([values, -values])
    comm.all_reduce(extremes, group, op=dist.ReduceOp.MAX)
    spread = (extremes[0] + extremes[1]).cpu()                     # max - min over the members, per element
    parts, offset = [], 0
    for name, p, hashes in shown:
        s = spread[offset:offset + p.numel()]
        offset += p.numel()
        copies = {}
        for rank, h in zip(group.ranks, hashes):
            copies.setdefault(h, []).append(str(rank))
        holders = " | ".join(", ".join(ranks) for ranks in copies.values())
        parts.append(f"{name} ({int((s != 0).sum())} of {p.numel()} elements, by up to {s.max().item():.3g}; "
                     f"copies held by ranks {holders})")
    more = f" and {len(differ) - len(shown)} more" if len(differ) > len(shown) else ""
    return (f"the {_GROUPS[group.name]} group (ranks {', '.join(map(str, group.ranks))}) holds {len(differ)} of its "
            f"{total} shared parameter{'s' * (total != 1)} differently: {', '.join(parts)}{more}")
