"""Mixed-precision AdamW over flat fp32 ranges, with ZeRO-1, gradient clipping and loss scaling.

The optimizer owns, for every bucket of every `GradBuffer`, the range whose gradient this
rank holds after the DP sync: the whole bucket, or with ZeRO-1 its 1/dp shard. For each
range it keeps fp32 master weights (the parameter buffer itself in fp32), and Adam's moments.
So optimizer state per rank shrinks by dp with ZeRO-1: bf16 weights cost
2 (weight) + 4 (main grad) + (4 + 8) / dp bytes per parameter.

A step: finalize gradients (sum sequence-parallel replicated params over TP, the tied word
embedding over the embedding group) -> unscale (fp16) -> global norm (TP-replicated params and
the tied copy counted once; the same all-reduce detects inf/nan everywhere) -> skip or clip ->
AdamW -> copy to 16-bit weights -> ZeRO all-gather.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import comm
from .config import OptimizerConfig, PrecisionConfig
from .data_parallel import WORD_EMBEDDING, GradBuffer
from .mesh import ParallelMesh


class DynamicLossScaler:
    """fp16 loss scale: x growth_factor after growth_interval clean steps; x backoff_factor once
    `hysteresis` overflows have been seen since the last growth; never below min_scale."""

    def __init__(self, cfg: PrecisionConfig):
        self.scale = cfg.initial_loss_scale
        self.growth_factor, self.growth_interval = cfg.loss_scale_growth_factor, cfg.loss_scale_growth_interval
        self.backoff_factor, self.hysteresis, self.min_scale = cfg.loss_scale_backoff_factor, cfg.loss_scale_hysteresis, cfg.min_loss_scale
        self.clean_steps, self.hysteresis_left = 0, self.hysteresis

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.clean_steps, self.hysteresis_left = 0, self.hysteresis
                self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "hysteresis_left": self.hysteresis_left}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps, self.hysteresis_left = state["scale"], state["clean_steps"], state["hysteresis_left"]


@dataclass
class Range:
    """A flat [lo, hi) slice of one buffer that this rank updates."""
    buffer: GradBuffer
    lo: int
    hi: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    decay_segments: list      # (a, b) offsets within the range that get weight decay
    norm_segments: list       # (a, b) offsets counted in the global norm
    tp_sum_segments: list     # (a, b) offsets of sequence-parallel replicated params
    tied: bool                # the range belongs to the tied word-embedding bucket

    @property
    def grad(self) -> torch.Tensor:
        return self.buffer.grads_flat[self.lo:self.hi]

    @property
    def param(self) -> torch.Tensor:
        return self.buffer.params_flat[self.lo:self.hi]


class Optimizer:
    def __init__(self, buffers: list, mesh: ParallelMesh, cfg: OptimizerConfig, precision: PrecisionConfig, zero: bool):
        self.buffers, self.mesh, self.cfg, self.zero = buffers, mesh, cfg, zero
        self.scaler = DynamicLossScaler(precision) if precision.dtype == "fp16" else None
        self.step_count = 0
        self.ranges = []
        for buf in buffers:
            for bucket in buf.buckets:
                lo, hi = buf.valid_range(bucket)
                param = buf.params_flat[lo:hi]
                master = param if param.dtype == torch.float32 else param.float()
                decay, norm, tp_sum, tied = [], [], [], False
                for p, name, a, b in buf.segments(lo, hi):
                    seg = (a - lo, b - lo)
                    if not p.spec.no_weight_decay:
                        decay.append(seg)
                    replicated_copy = p.spec.tp_dim is None and mesh.tp_rank > 0
                    if not replicated_copy and not p.spec.tied:
                        norm.append(seg)
                    if p.spec.sequence_parallel:
                        tp_sum.append(seg)
                    tied = tied or (name == WORD_EMBEDDING and mesh.pp > 1)
                self.ranges.append(Range(buf, lo, hi, master, torch.zeros_like(master), torch.zeros_like(master),
                                         decay, norm, tp_sum, tied))

    # -- gradients
    def finalize_grads(self) -> None:
        """Sums that make replicated gradients whole: SP params over TP (one flat all-reduce),
        the tied word embedding over the embedding group (first and last stage)."""
        pieces = [(r, a, b) for r in self.ranges for a, b in r.tp_sum_segments]
        if pieces and self.mesh.tp > 1:
            flat = torch.cat([r.grad[a:b] for r, a, b in pieces])
            comm.all_reduce(flat, self.mesh.tp_group)
            offset = 0
            for r, a, b in pieces:
                r.grad[a:b].copy_(flat[offset:offset + b - a])
                offset += b - a
        for r in self.ranges:
            if r.tied:
                comm.all_reduce(r.grad, self.mesh.embedding_group)

    def global_grad_norm(self) -> float:
        """sqrt of the sum of squares of the whole model's gradient; nan if any gradient element on
        any rank is inf/nan (replicated copies are checked too, though counted once in the norm)."""
        stats = torch.zeros(2, dtype=torch.float32, device=self.buffers[0].grads_flat.device)
        for r in self.ranges:
            stats[1] += r.grad.sum()
            for a, b in r.norm_segments:
                stats[0] += r.grad[a:b].pow(2).sum()
        comm.all_reduce(stats, self.mesh.world_group if self.zero else self.mesh.mp_group)
        norm_sq, total = stats.tolist()
        return math.sqrt(norm_sq) if math.isfinite(norm_sq) and math.isfinite(total) else float("nan")

    def zero_grad(self) -> None:
        for buf in self.buffers:
            buf.zero_grad()

    # -- the step
    @torch.no_grad()
    def step(self, lr: float) -> tuple[float, bool]:
        """Update the weights from the synced main grads; returns (grad norm, skipped)."""
        self.finalize_grads()
        if self.scaler:
            for r in self.ranges:
                r.grad.mul_(1.0 / self.scaler.scale)
        norm = self.global_grad_norm()
        if not math.isfinite(norm):
            if self.scaler is None:
                raise FloatingPointError("the gradient norm is not finite")
            self.scaler.update(found_inf=True)
            self.zero_grad()
            return norm, True
        if self.scaler:
            self.scaler.update(found_inf=False)
        clip = self.cfg.grad_clip / (norm + 1e-6) if self.cfg.grad_clip > 0 else 1.0
        self.step_count += 1
        c = self.cfg
        bias1, bias2 = 1 - c.beta1 ** self.step_count, 1 - c.beta2 ** self.step_count
        for r in self.ranges:
            g = r.grad
            if clip < 1.0:
                g.mul_(clip)
            for a, b in r.decay_segments:
                r.master[a:b].mul_(1 - lr * c.weight_decay)
            r.exp_avg.lerp_(g, 1 - c.beta1)
            r.exp_avg_sq.mul_(c.beta2).addcmul_(g, g, value=1 - c.beta2)
            denom = (r.exp_avg_sq.sqrt() / math.sqrt(bias2)).add_(c.eps)
            r.master.addcdiv_(r.exp_avg, denom, value=-lr / bias1)
            if r.master.data_ptr() != r.param.data_ptr():
                r.param.copy_(r.master)
        for buf in self.buffers:
            buf.all_gather_params()
        self.zero_grad()
        return norm, False
