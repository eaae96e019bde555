"""Weights that several ranks hold must be bitwise equal: `compare` checks that they are.

Which ranks hold a parameter in common (and why their copies stay equal):
  - the DP group: every parameter (a DP rank holds a whole replica of its stage, with ZeRO-1 once the updated
    weights are all-gathered): every rank applies the same update to the same all-reduced gradient;
  - the TP group: the replicated ones (ParamSpec.tp_dim None: LayerNorms, row-parallel biases, positions): every
    TP rank computes the same gradient (with sequence parallelism, the same sum over TP);
  - the embedding group (pp > 1): the word embedding on the first stage and the output layer's copy on the last:
    both are updated with the sum of their gradients.
With 16-bit weights the fp32 masters too (the optimizer's ranges of those parameters: over DP only without ZeRO-1,
whose shards differ), as a drifting gradient moves them long before a 16-bit weight flips (Adam's moments follow
the same gradients, and a master that drifts shows them). A difference is a fault: a kernel whose rounding differs
between ranks (one that each rank autotunes on its own, say), a missing sum, or faulty hardware. Nothing else
notices it, since a checkpoint keeps one copy (DP rank 0's, TP rank 0's, the first stage's): the run is then no
longer the model of one device, and a resume would not continue it.

Each rank hashes each tensor's bits as 16-bit integers b (two per fp32 element), CHUNK at a time, P = 2^31 - 1:
    H_c = sum_j b_cj * w_j  mod P,   hash = sum_c H_c * w_c  mod P,   w_j = ((j + 1) * A mod P)^2 mod P + 1
(int64, no overflow): w is never 0 mod P (P = 3 mod 4: u^2 = -1 has no root) and takes distinct values for
j + 1 <= (P - 1) / 2 (x^2 = y^2 only for y = +-x), so one 16-bit half that differs always changes the hash
(|b - b'| < 2^16 < P); other differences, an fp32 element's two halves among them, cancel with a chance of about
1/P. A group all-gathers its members' hashes ([members, tensors], int64), so every member sees the
same differences; for the first few it then all-reduces the tensors, a chunk at a time, to count the elements
that differ and say by how much.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm
from .mesh import ParallelMesh

P = 2 ** 31 - 1
A = 48271                    # a primitive root of P (MINSTD's multiplier)
CHUNK = 1 << 22              # 16-bit values hashed at a time (two int64 temporaries of 32 MB, and the weights')
DESCRIBE_CHUNK = 1 << 20     # elements compared at a time where a difference is described (four float64 copies)
SHOWN = 3                    # differing tensors measured and named per group
_INTS = {2: torch.int16, 4: torch.int32}        # a tensor's bits as integers (16- and 32-bit floats)
_GROUPS = {"dp": "DP", "tp": "TP", "emb": "embedding"}


def weight(j: torch.Tensor | int):
    """w_j of the module doc (an int64 tensor of them for a tensor of positions j < (P - 1) / 2)."""
    u = (j + 1) * A % P
    return u * u % P + 1


def fingerprint(t: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """hash(t) of the module doc: a 0-d int64 tensor on t's device (no host sync). `weights`: weight(arange(n)) on
    that device, n >= min(CHUNK, 16-bit values of t)."""
    bits = t.detach().reshape(-1).view(torch.int16)
    h = torch.zeros((), dtype=torch.int64, device=t.device)
    for c, lo in enumerate(range(0, bits.numel(), CHUNK)):
        b = bits[lo:lo + CHUNK].long()
        chunk = b.mul_(weights[:b.numel()]).remainder_(P).sum()           # |b| * w < 2^46; the sum < 2^53
        h = (h + chunk.remainder_(P) * weight(c)).remainder_(P)          # < 2^62
    return h


def shared(buffers: list, optimizer, mesh: ParallelMesh) -> list:
    """(group, {name: tensor}) for each group of more than one rank that holds tensors in common with this rank
    (module doc): weights by their global name, fp32 masters as "<name> (fp32 master)", names in the same order
    on every member."""
    params = {name: p for buf in buffers for p, name in buf.names.items()}
    masters = {name: (p, r.master[a - r.lo:b - r.lo]) for r in optimizer.ranges if r.separate_master
               for p, name, a, b in r.buffer.segments(r.lo, r.hi)}

    def held(keep, dp: bool = False) -> dict:
        tensors = {n: p for n, p in params.items() if keep(p)}
        if not (dp and optimizer.zero):                 # (ZeRO-1: each DP rank holds its own shard of the masters)
            tensors.update({f"{n} (fp32 master)": m for n, (p, m) in masters.items() if keep(p)})
        return dict(sorted(tensors.items()))
    groups = [(mesh.dp_group, held(lambda p: True, dp=True)),
              (mesh.tp_group, held(lambda p: p.spec.tp_dim is None)),
              (mesh.embedding_group, held(lambda p: p.spec.tied))]
    return [(g, ts) for g, ts in groups if g is not None and g.size > 1 and ts]


def compare(buffers: list, optimizer, mesh: ParallelMesh) -> str | None:
    """None when every tensor equals its copies on the other ranks of each group (collectives of those groups
    only: every member takes part), else what differs, the same text on every member of the group where it does.
    Waits for ZeRO-1's weight gathers in flight."""
    optimizer.finish_param_gather()
    found, hashed, groups = [], {}, shared(buffers, optimizer, mesh)
    largest = max((t.numel() * t.element_size() // 2 for _, ts in groups for t in ts.values()), default=0)
    weights = weight(torch.arange(min(CHUNK, largest), dtype=torch.int64, device=buffers[0].params_flat.device))
    for group, tensors in groups:
        for name, t in tensors.items():                 # (a tensor that several groups share is hashed once)
            if name not in hashed:
                hashed[name] = fingerprint(t, weights)
        own = torch.stack([hashed[name] for name in tensors])
        hashes = comm.all_gather(own[None], group).cpu()                     # [members, tensors]
        differ = [(name, t, hashes[:, i].tolist()) for i, (name, t) in enumerate(tensors.items())
                  if (hashes[:, i] != hashes[0, i]).any()]
        if differ:
            found.append(_describe(group, differ, len(tensors)))
    return "; ".join(found) or None


def _differences(t: torch.Tensor, group) -> tuple[int, float]:
    """(elements whose bits differ between the members' copies of t, the largest max - min of an element's values):
    all-reduces over the group, DESCRIBE_CHUNK elements at a time (every member runs the same)."""
    flat, count, spread = t.detach().reshape(-1), 0, 0.0
    for lo in range(0, flat.numel(), DESCRIBE_CHUNK):
        part = flat[lo:lo + DESCRIBE_CHUNK]
        values, bits = part.double(), part.view(_INTS[part.element_size()]).double()      # (both exact)
        extremes = torch.stack([values, -values, bits, -bits])
        comm.all_reduce(extremes, group, op=dist.ReduceOp.MAX)
        count += int((extremes[2] + extremes[3] != 0).sum())
        spread = max(spread, float((extremes[0] + extremes[1]).max()))
    return count, spread


def _describe(group, differ: list, total: int) -> str:
    """One group's differences: the first SHOWN tensors, which ranks hold which copy, how many elements differ and
    by how much (every member knows the same `differ`)."""
    parts = []
    for name, t, hashes in differ[:SHOWN]:
        count, spread = _differences(t, group)
        copies = {}
        for rank, h in zip(group.ranks, hashes):
            copies.setdefault(h, []).append(str(rank))
        holders = " | ".join(", ".join(ranks) for ranks in copies.values())
        parts.append(f"{name} ({count} of {t.numel()} elements, by up to {spread:.3g}; copies held by ranks {holders})")
    more = f" and {len(differ) - SHOWN} more" if len(differ) > SHOWN else ""
    return (f"the {_GROUPS[group.name]} group (ranks {', '.join(map(str, group.ranks))}) holds {len(differ)} of its "
            f"{total} shared tensor{'s' * (total != 1)} differently: {', '.join(parts)}{more}")
