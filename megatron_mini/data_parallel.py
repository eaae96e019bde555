"""Data parallelism: flat parameter/main-grad buffers, bucketed gradient reduction over DP.

One `GradBuffer` per model chunk. Its parameters become views of one flat buffer in the
model dtype, and each gets `main_grad`, a view of one flat fp32 buffer that microbatch
gradients are accumulated into (BLOOM's BF16Optimizer; `.grad` never persists). The
buffer is cut into buckets, in reverse forward order so backward fills them front to back.
On the last microbatch a bucket is reduced over DP as soon as all its gradients are in
(async, overlapping the rest of backward): an all-reduce, or with ZeRO-1 a reduce-scatter
that leaves this rank the sum for its 1/dp shard of every bucket. Buckets are padded to a
multiple of dp. With pp > 1 the tied word embedding has a bucket of its own, so its shards
line up between the first and last stage for the embedding-group sum. ZeRO-1 all-gathers the
updated weights after the step, async, and a layer's forward waits only for its own buckets
(Megatron's overlap_param_gather): the gathers overlap the next step's forward.
`saved_weights()` / `load_weights()` give a checkpoint this rank's slices of the weights by global
name, and take them back from a checkpoint saved in any layout.
"""
from __future__ import annotations

import bisect
import functools
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from . import comm
from .mesh import ParallelMesh



@dataclass(eq=False)            # hashed and compared by identity
class Bucket:
    start: int
    end: int                        # padded end: (end - start) % dp == 0
    params: list = field(default_factory=list)
    pending: int = 0
    launched: bool = False
    work: object = None              # the async collective's handle (None for a group of one)
    gather: object = None            # ZeRO-1: the in-flight all-gather of the updated weights

    def shard(self, dp_rank: int, dp: int) -> tuple[int, int]:
        n = (self.end - self.start) // dp
        return self.start + dp_rank * n, self.start + (dp_rank + 1) * n

    def wait_gather(self) -> None:
        """Wait until this bucket's weights are whole again (nothing to do when no gather is in flight)."""
        if self.gather is not None:
            self.gather.wait()
            self.gather = None


def _wait_gathers(buckets: list, module: nn.Module, args) -> None:
    """A forward pre-hook: the layer's weights must be whole before it runs."""
    for bucket in buckets:
        bucket.wait_gather()


def _call(buffer: weakref.ref, method: str, p: nn.Parameter) -> None:
    owner = buffer()
    if owner is None:
        raise RuntimeError("this parameter's GradBuffer was garbage-collected: its owner (the Trainer) must keep it")
    getattr(owner, method)(p)


class GradBuffer:
    def __init__(self, named_params: list, mesh: ParallelMesh, dtype: torch.dtype, zero: bool, bucket_numel: int):
        """`named_params` in forward order; a bucket closes at the parameter that brings it to `bucket_numel`
        elements or more (TrainConfig.ddp_bucket_numel), then is padded to a multiple of dp. Where the buckets
        end moves ZeRO-1's shards, never what a checkpoint holds (by global name: Optimizer.saved_state)."""
        self.mesh, self.zero, self.dp = mesh, zero, mesh.dp
        named_params = list(reversed(named_params))
        tied = [(n, p) for n, p in named_params if p.spec.tied and mesh.pp > 1]
        rest = [(n, p) for n, p in named_params if not (p.spec.tied and mesh.pp > 1)]
        groups, current, size = [], [], 0
        for n, p in rest:
            current.append((n, p))
            size += p.numel()
            if size >= bucket_numel:
                groups.append(current)
                current, size = [], 0
        groups += [g for g in (current, tied) if g]

        self.buckets, self.names, self.offsets, offset = [], {}, {}, 0
        for group in groups:
            bucket = Bucket(offset, offset)
            for n, p in group:
                self.names[p], self.offsets[p] = n, offset
                offset += p.numel()
                bucket.params.append(p)
            bucket.end = offset = offset + (-(offset - bucket.start)) % self.dp
            self.buckets.append(bucket)
        self._order, self._starts = list(self.offsets), list(self.offsets.values())    # increasing offsets
        device = named_params[0][1].device
        self.params_flat = torch.zeros(offset, dtype=dtype, device=device)
        self.grads_flat = torch.zeros(offset, dtype=torch.float32, device=device)
        self.bucket_of = {}
        # The parameters reach this buffer weakly: autograd keeps their hooks where the garbage
        # collector cannot see them, so a strong reference would keep a dropped model's buffers alive.
        buffer = weakref.ref(self)
        for bucket in self.buckets:
            for p in bucket.params:
                lo = self.offsets[p]
                view = self.params_flat[lo:lo + p.numel()].view(p.shape)
                view.copy_(p.data)
                p.data = view
                p.main_grad = self.grads_flat[lo:lo + p.numel()].view(p.shape)
                p.main_grad_ready = functools.partial(_call, buffer, "_main_grad_ready", p)
                p.register_post_accumulate_grad_hook(functools.partial(_call, buffer, "_on_grad"))
                self.bucket_of[p] = bucket
        self.overlap = False
        self.first_used = {}       # ZeRO-1: the buckets in the order the forward first uses them (wait_before)

    def valid_range(self, bucket: Bucket) -> tuple[int, int]:
        """The part of `bucket` whose reduced gradient this rank holds after the DP sync."""
        return bucket.shard(self.mesh.dp_rank, self.dp) if self.zero else (bucket.start, bucket.end)

    # -- accumulation and overlapped reduction
    def _on_grad(self, p: nn.Parameter) -> None:
        """AccumulateGrad's hook, after every use of p in a backward pass: moves the microbatch's 16-bit .grad into
        the fp32 main grad and says it is in. Where the ops added p's gradient into the main grad themselves
        (tensor_parallel's gradient-accumulation fusion, the Triton LayerNorm) there is no .grad, and they say so
        in their backward (p.main_grad_ready()), not this hook: AccumulateGrad runs it without a gradient only from
        pytorch#155521 (June 2025) on, an undocumented change; before it, no bucket holding such a parameter would
        start reducing before the backward ends."""
        if p.grad is None:
            return
        p.main_grad.add_(p.grad)
        p.grad = None
        self._main_grad_ready(p)

    def _main_grad_ready(self, p: nn.Parameter) -> None:
        """p's gradient of this microbatch is in its main grad (from the hook above, or added there by the op that
        formed it, at p's last use in the backward): on the last microbatch its bucket may start reducing."""
        if self.overlap:
            bucket = self.bucket_of[p]
            bucket.pending -= 1
            if bucket.pending == 0:
                self._launch(bucket)

    def start_last_microbatch(self) -> None:
        """Call before the chunk's last backward: buckets reduce as soon as they are complete."""
        self.overlap = True
        for bucket in self.buckets:
            bucket.pending = len(bucket.params)

    def _launch(self, bucket: Bucket) -> None:
        grads = self.grads_flat[bucket.start:bucket.end]
        if self.zero:      # in place, as Megatron's: the output is this rank's own slice of the input (NCCL
            lo, hi = self.valid_range(bucket)     # documents in-place reduce-scatter; tests/test_zero.py runs gloo)
            bucket.work = comm.reduce_scatter_into(self.grads_flat[lo:hi], grads, self.mesh.dp_group, async_op=True)
        else:
            bucket.work = comm.all_reduce(grads, self.mesh.dp_group, async_op=True)
        bucket.launched = True

    def finish_grad_sync(self) -> None:
        """Reduce what was not launched yet and wait for every bucket."""
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.launched, bucket.work = False, None
        self.overlap = False

    def zero_grad(self) -> None:
        self.grads_flat.zero_()

    # -- ZeRO-1: the updated weights, all-gathered beside the next forward
    def start_param_gather(self) -> None:
        """ZeRO-1: every rank updated its shard of each bucket; start sharing the updated weights over DP,
        async, in the order the forward first uses the buckets (a group's collectives complete in launch
        order; the tied bucket, last in the layout, is the first stage's first and the last stage's last),
        then any it does not use (none may be in flight: Optimizer.step finishes them first). The hooks of
        wait_before() wait for them layer by layer; what reads or writes the weights outside a forward
        calls finish_param_gather() first. In place, as Megatron's: the input is this rank's shard, the output's
        own slice (NCCL documents in-place all-gather; tests/test_zero.py runs it on gloo)."""
        if not self.zero or self.dp == 1:
            return
        for bucket in [*self.first_used, *(b for b in reversed(self.buckets) if b not in self.first_used)]:
            lo, hi = self.valid_range(bucket)
            bucket.gather = comm.all_gather_into(self.params_flat[bucket.start:bucket.end], self.params_flat[lo:hi],
                                                 self.mesh.dp_group, async_op=True)

    def finish_param_gather(self) -> None:
        """Wait for every bucket's weight all-gather still in flight."""
        for bucket in self.buckets:
            bucket.wait_gather()

    def wait_before(self, modules: list) -> None:
        """Give each module a forward pre-hook that waits for the all-gathers of the buckets holding its
        parameters (of this buffer), and gather the buckets in the order the modules first use them.
        `modules`: in forward order, across calls (the rank's chunks in turn: a chunk may use another's
        weights, the tied word embedding at pp = 1); each must run its hooks eagerly, not inside a
        compiled graph (GPTChunk.param_users())."""
        if not self.zero or self.dp == 1:
            return
        for module in modules:
            buckets = list(dict.fromkeys(self.bucket_of[p] for p in module.parameters() if p in self.bucket_of))
            if buckets:
                module.register_forward_pre_hook(functools.partial(_wait_gathers, buckets))
                self.first_used.update(dict.fromkeys(buckets))      # (a key already there keeps its place)

    def saves(self, p: nn.Parameter) -> bool:
        """Whether this rank's checkpoint holds `p` (its TP slice): replicated parameters only on TP rank 0,
        and not the output layer's copy of the tied embedding (the first stage saves it). Which DP ranks save
        a parameter is the caller's: the weights on DP rank 0, the optimizer state where its range lives."""
        return not p.spec.copy and (p.spec.tp_dim is not None or self.mesh.tp_rank == 0)

    def saved_weights(self) -> dict:
        """{global name: this rank's TP slice, a copy on the CPU in the model's dtype} of the weights that this
        rank writes in a checkpoint (DP rank 0, `saves`); no collective. (With 16-bit weights the fp32 master is
        the optimizer's: a checkpoint holds 2 + 12 bytes per parameter, as BLOOM's did.)"""
        self.finish_param_gather()
        if self.mesh.dp_rank:
            return {}
        return {name: p.detach().to("cpu", copy=True) for p, name in self.names.items() if self.saves(p)}

    @torch.no_grad()
    def load_weights(self, reader) -> None:
        """Copy this rank's slice of each parameter from a checkpoint.ShardReader (saved in any layout)."""
        self.finish_param_gather()
        for p, name in self.names.items():
            p.copy_(reader.local(name, "weight", p, self.mesh.tp, self.mesh.tp_rank))

    def segments(self, lo: int, hi: int):
        """(param, name, seg_lo, seg_hi) for each parameter overlapping the flat range [lo, hi)."""
        starts, params = self._starts, self._order
        for i in range(max(bisect.bisect_right(starts, lo) - 1, 0), len(params)):
            p = params[i]
            a, b = starts[i], starts[i] + p.numel()
            if a >= hi:
                break
            if b > lo:
                yield p, self.names[p], max(a, lo), min(b, hi)
