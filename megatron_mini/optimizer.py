"""Mixed-precision AdamW over flat fp32 ranges, with ZeRO-1, gradient clipping and loss scaling.

The optimizer owns, for every bucket of every `GradBuffer`, the range whose gradient this
rank holds after the DP sync: the whole bucket, or with ZeRO-1 its 1/dp shard. For each
range it keeps fp32 master weights (the parameter buffer itself in fp32), and Adam's moments.
So optimizer state per rank shrinks by dp with ZeRO-1: bf16 weights cost
2 (weight) + 4 (main grad) + (4 + 8) / dp bytes per parameter.

A step: finalize gradients (sum sequence-parallel replicated params over TP, or average the other replicated
ones where each TP rank's autotuned kernel may round them otherwise; the tied word embedding over the embedding
group) -> global norm (TP-replicated params and the tied copy counted once; the same all-reduce detects inf/nan
everywhere) -> skip, or AdamW with the gradients divided by (fp16 loss scale / clip factor) inside the fused
kernel -> copy to 16-bit weights -> ZeRO all-gather, async: each layer of the next forward waits for its own
weights. The lr of each update comes from `learning_rate` (warmup, then a decay, optionally warmup-stable-decay);
`schedule_note` says where a resumed run's schedule departs from the saved run's.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from . import comm
from .config import MAX_LOSS_SCALE, OptimizerConfig, PrecisionConfig, TrainConfig
from .data_parallel import GradBuffer
from .mesh import ParallelMesh

STATES = ("master", "exp_avg", "exp_avg_sq")   # what Adam keeps per parameter element, in fp32
FP32_MAX = torch.finfo(torch.float32).max
NORM_PIECE = 1 << 14    # elements per piece of the gradient norm on a CPU (Optimizer.norm_pieces)


class DynamicLossScaler:
    """fp16 loss scale: x growth_factor after growth_interval clean steps (at most MAX_LOSS_SCALE); x backoff_factor
    once `hysteresis` overflows have been seen since the last growth; never below min_scale."""

    def __init__(self, cfg: PrecisionConfig):
        self.scale = cfg.initial_loss_scale
        self.growth_factor, self.growth_interval = cfg.loss_scale_growth_factor, cfg.loss_scale_growth_interval
        self.backoff_factor, self.hysteresis = cfg.loss_scale_backoff_factor, cfg.loss_scale_hysteresis
        self.min_scale = cfg.min_loss_scale
        self.clean_steps, self.hysteresis_left = 0, self.hysteresis
        self.skips_at_min = 0        # overflows in a row at min_scale: the run cannot recover past some
        self.skipped_steps = 0       # overflowed (skipped) steps since the run began, resumes included

    def update(self, found_inf: bool) -> None:
        self.skips_at_min = self.skips_at_min + 1 if found_inf and self.scale <= self.min_scale else 0
        self.skipped_steps += found_inf
        if found_inf:
            self.clean_steps = 0
            self.hysteresis_left -= 1
            if self.hysteresis_left <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
        else:
            self.clean_steps += 1
            if self.clean_steps >= self.growth_interval:     # (>=: a resume may shorten the interval)
                self.clean_steps, self.hysteresis_left = 0, self.hysteresis
                self.scale = min(self.scale * self.growth_factor, MAX_LOSS_SCALE)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps, "hysteresis_left": self.hysteresis_left,
                "skips_at_min": self.skips_at_min, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean_steps = state["scale"], state["clean_steps"]
        self.hysteresis_left = min(state["hysteresis_left"], self.hysteresis)   # a resume may lower the hysteresis
        # (checkpoints written before these two were kept start them at 0)
        self.skips_at_min, self.skipped_steps = state.get("skips_at_min", 0), state.get("skipped_steps", 0)


@dataclass
class Range:
    """A flat [lo, hi) slice of one buffer that this rank updates."""
    buffer: GradBuffer
    lo: int
    hi: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    tp_sum_segments: list     # (a, b, n): offsets of replicated params summed over TP, then divided by n (1, or tp)
    tied: bool                # the range belongs to the tied word-embedding bucket

    @property
    def grad(self) -> torch.Tensor:
        return self.buffer.grads_flat[self.lo:self.hi]

    @property
    def param(self) -> torch.Tensor:
        return self.buffer.params_flat[self.lo:self.hi]

    @property
    def separate_master(self) -> bool:
        """16-bit weights keep an fp32 master copy; fp32 weights are their own master."""
        return self.buffer.params_flat.dtype != torch.float32


class Optimizer:
    """AdamW on this rank's ranges through torch's fused multi-tensor kernel (`torch._fused_adamw_`,
    what torch.optim.AdamW(fused=True) runs), one call for the weight-decayed parameter pieces and
    one for the rest. The kernel divides every gradient by `grad_scale` first, which carries both
    the fp16 loss scale and the clipping factor, so neither needs a pass of its own."""

    def __init__(self, buffers: list, mesh: ParallelMesh, cfg: OptimizerConfig, precision: PrecisionConfig, zero: bool,
                 average_replicated: bool = False):
        """average_replicated: average the TP ranks' gradients of the replicated parameters that sequence
        parallelism does not sum (rank.build_rank: where the Triton LayerNorm runs at tp > 1 without sp, as each
        rank autotunes its tiles, so its sums, and so these gradients, may round otherwise on each rank)."""
        self.buffers, self.mesh, self.cfg, self.zero = buffers, mesh, cfg, zero
        self.scaler = DynamicLossScaler(precision) if precision.dtype == "fp16" else None
        self.step_count = 0
        self.ranges = []
        # per-parameter views (of master, grad, exp_avg, exp_avg_sq) for the multi-tensor kernels
        self.groups = {True: ([], [], [], []), False: ([], [], [], [])}    # keyed by "gets weight decay"
        self.norm_views, self.check_views = [], []    # counted once in the global norm / checked for inf
        self.norm_masters = []                        # the fp32 weights of norm_views' gradients (param_norm)
        for buf in buffers:
            for bucket in buf.buckets:
                lo, hi = buf.valid_range(bucket)
                param = buf.params_flat[lo:hi]
                master = param if param.dtype == torch.float32 else param.float()
                exp_avg, exp_avg_sq = torch.zeros(2, hi - lo, dtype=torch.float32, device=param.device)
                r = Range(buf, lo, hi, master, exp_avg, exp_avg_sq, [], False)
                grad = r.grad
                for p, name, a, b in buf.segments(lo, hi):
                    a, b = a - lo, b - lo
                    views = (master[a:b], grad[a:b], exp_avg[a:b], exp_avg_sq[a:b])
                    for group, view in zip(self.groups[not p.spec.no_weight_decay], views):
                        group.append(view)
                    replicated_copy = p.spec.tp_dim is None and mesh.tp_rank > 0
                    if replicated_copy or p.spec.copy:
                        self.check_views.append(views[1])
                    else:
                        self.norm_views.append(views[1])
                        self.norm_masters.append(views[0])
                    if p.spec.sequence_parallel:
                        r.tp_sum_segments.append((a, b, 1))
                    elif average_replicated and p.spec.tp_dim is None:
                        r.tp_sum_segments.append((a, b, mesh.tp))
                    r.tied = r.tied or (p.spec.tied and mesh.pp > 1)
                self.ranges.append(r)
        device = buffers[0].grads_flat.device
        # torch's fp32 norm on a CPU sums in order, 2.7e-3 low for 38M elements (gpt2-small's embedding): there the
        # norm is of pieces of NORM_PIECE elements (2.6e-8 at 38M, a quarter of an fp64 norm's time, no copy)
        self.norm_pieces = [piece for v in self.norm_views for piece in v.split(NORM_PIECE)] \
            if device.type == "cpu" else self.norm_views
        self._step = torch.zeros((), dtype=torch.float32, device=device)          # the kernel's step count
        self._grad_scale = torch.ones((), dtype=torch.float32, device=device)

    # -- gradients
    def finalize_grads(self) -> None:
        """Sums that make replicated gradients whole: SP params over TP (one flat all-reduce, which also averages
        the other replicated ones where asked), the tied word embedding over the embedding group (first and last
        stage)."""
        pieces = [(r, a, b, n) for r in self.ranges for a, b, n in r.tp_sum_segments]
        if pieces and self.mesh.tp > 1:
            flat = torch.cat([r.grad[a:b] for r, a, b, _ in pieces])
            comm.all_reduce(flat, self.mesh.tp_group)
            offset = 0
            for r, a, b, n in pieces:
                piece = flat[offset:offset + b - a]
                r.grad[a:b].copy_(piece if n == 1 else piece.div_(n))
                offset += b - a
        for r in self.ranges:
            if r.tied:
                comm.all_reduce(r.grad, self.mesh.embedding_group)

    def norm_stats(self, weights: bool = False) -> torch.Tensor:
        """[the whole model's sum of squared gradients, a sum that is inf/nan if any gradient element on
        any rank is (, with `weights`, the sum of squares of its fp32 weights)]: one all-reduce of 2 (3) numbers
        (replicated copies are checked, counted once)."""
        stats = torch.zeros(2 + weights, dtype=torch.float32, device=self._step.device)
        if self.norm_pieces:
            stats[0] = torch.stack(torch._foreach_norm(self.norm_pieces)).double().square().sum()
        if self.check_views:
            stats[1] = torch.stack(torch._foreach_norm(self.check_views)).sum()
        if weights and self.norm_masters:
            stats[2] = torch.stack(torch._foreach_norm(self.norm_masters, 2, dtype=torch.float64)).square().sum()
        return self.reduce_norm_stats(stats)

    def reduce_norm_stats(self, stats: torch.Tensor) -> torch.Tensor:
        """Sum every rank's [squares, check] over the model-parallel group (the world with ZeRO-1)."""
        comm.all_reduce(stats, self.mesh.world_group if self.zero else self.mesh.mp_group)
        return stats

    def global_norms(self, weights: bool = False) -> tuple[float, float | None]:
        """(the L2 norm of the whole model's gradient, as it is in the buffers: still loss-scaled with fp16, nan if
        any gradient element on any rank is inf/nan; with `weights` that of its fp32 weights, else None), from
        one all-reduce."""
        norm_sq, check, *weights_sq = self.norm_stats(weights).tolist()
        grad = math.sqrt(norm_sq) if math.isfinite(norm_sq) and math.isfinite(check) else float("nan")
        return grad, math.sqrt(weights_sq[0]) if weights else None

    def zero_grad(self) -> None:
        for buf in self.buffers:
            buf.zero_grad()

    def finish_param_gather(self) -> None:
        """Wait for ZeRO-1's weight all-gathers still in flight (before the weights are read or written)."""
        for buf in self.buffers:
            buf.finish_param_gather()

    # -- the step
    @torch.no_grad()
    def step(self, lr: float, weight_norm: bool = False) -> tuple[float, bool, float | None]:
        """Update the weights from the synced main grads; returns (grad norm, skipped, with `weight_norm` the L2
        norm of the fp32 weights the step began with (those its forward ran with: Megatron's params norm),
        else None). With ZeRO-1 the updated weights are all-gathered over DP in the background
        (GradBuffer.start_param_gather)."""
        self.finish_param_gather()
        self.finalize_grads()
        scale = self.scaler.scale if self.scaler else 1.0
        norm, weights = self.global_norms(weight_norm)
        norm /= scale
        if not math.isfinite(norm):
            if self.scaler is None:
                raise FloatingPointError("the gradient norm is not finite")
            self.scaler.update(found_inf=True)
            self.zero_grad()
            return norm, True, weights
        if self.scaler:
            self.scaler.update(found_inf=False)
        clip = self.cfg.grad_clip / (norm + 1e-6) if self.cfg.grad_clip > 0 else 1.0
        self.step_count += 1
        self._step.fill_(self.step_count)
        # g <- g / (loss scale / clip factor), at most fp32's largest (a tiny grad_clip: the step is ~0 anyway)
        divide = min(scale / clip if clip < 1.0 else scale, FP32_MAX)
        self._grad_scale.fill_(divide)
        c = self.cfg
        for decay, (params, grads, exp_avgs, exp_avg_sqs) in self.groups.items():
            if params:
                torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], [self._step] * len(params), lr=lr,
                                    beta1=c.beta1, beta2=c.beta2, weight_decay=c.weight_decay if decay else 0.0,
                                    eps=c.eps, amsgrad=False, maximize=False,
                                    grad_scale=self._grad_scale if divide != 1.0 else None, found_inf=None)
        for r in self.ranges:
            if r.separate_master:
                r.param.copy_(r.master)
        for buf in self.buffers:
            buf.start_param_gather()
        self.zero_grad()
        return norm, False, weights

    # -- what it holds, by parameter name
    def memory_bytes(self) -> dict:
        """Bytes this rank holds: weights, fp32 main grads, optimizer state (a separate fp32 master and
        Adam's two moments, sharded over DP by ZeRO-1)."""
        return {"weights": sum(b.params_flat.nbytes for b in self.buffers),
                "grads": sum(b.grads_flat.nbytes for b in self.buffers),
                "optimizer": sum(r.exp_avg.nbytes + r.exp_avg_sq.nbytes + (r.master.nbytes if r.separate_master else 0)
                                 for r in self.ranges)}

    def saved_state(self) -> dict:
        """{global name: ([lo, hi], {exp_avg, exp_avg_sq[, master]: fp32 copy on the CPU})}: the optimizer
        state this rank writes in a checkpoint, the flat [lo, hi) of each parameter's TP slice that its
        ranges hold (all of it without ZeRO-1, on DP rank 0 only; with ZeRO-1 every rank's own shard), for
        the parameters GradBuffer.saves. The master only with 16-bit weights: fp32 weights are their own
        master, and the checkpoint's weights hold it (12 bytes per parameter, not 16). No collective: no
        rank holds more than its own state."""
        self.finish_param_gather()
        if not self.zero and self.mesh.dp_rank:
            return {}                             # a replica of DP rank 0's state
        saved = {}
        for r in self.ranges:
            for p, name, a, b in r.buffer.segments(r.lo, r.hi):
                if r.buffer.saves(p):
                    first = r.buffer.offsets[p]
                    saved[name] = ([a - first, b - first],
                                   {k: getattr(r, k)[a - r.lo:b - r.lo].to("cpu", torch.float32, copy=True)
                                    for k in STATES if k != "master" or r.separate_master})
        return saved

    def counters(self) -> dict:
        """What a checkpoint keeps besides the tensors (the same on every rank): Adam's step count and the
        fp16 loss scaler's state."""
        return {"step_count": self.step_count, "scaler": self.scaler.state_dict() if self.scaler else None}

    @torch.no_grad()
    def load_state_dict(self, reader, counters: dict | None) -> None:
        """Take this rank's slices from a checkpoint.ShardReader saved in any layout, and `counters`
        (the weights are loaded already). counters None (init_from): the fp32 masters alone (a checkpoint's
        fp32 weights where they were their own), Adam's moments, the step count and the loss scale as new."""
        self.finish_param_gather()
        if counters is not None:
            self.step_count = counters["step_count"]
            if self.scaler and counters["scaler"]:
                self.scaler.load_state_dict(counters["scaler"])
        mesh = self.mesh
        for r in self.ranges:
            for p, name, a, b in r.buffer.segments(r.lo, r.hi):
                first = r.buffer.offsets[p]
                for k in STATES if counters is not None else ("master",):
                    flat = reader.local(name, k, p, mesh.tp, mesh.tp_rank).reshape(-1)
                    getattr(r, k)[a - r.lo:b - r.lo] = flat[a - first:b - first]
            if r.separate_master:
                r.param.copy_(r.master)


# ----------------------------------------------------------------------------- the learning-rate schedule
def learning_rate(update: int, o: OptimizerConfig, steps: int) -> float:
    """The lr of applied update `update` (0-based) of a run of `steps`: linear warmup over w = warmup_steps
    (lr/w, 2 lr/w, ..., lr at update w - 1), then the decay_style from lr at update k to min_lr at update D - 1
    (D: decay_steps, or `steps` when 0; min_lr after it): k = max(w - 1, 0), the peak, or with cooldown_steps
    C > 0 (warmup-stable-decay) k = max(D - 1 - C, the peak), lr held until then; with p = min(1, (update - k)
    / max(1, D - 1 - k)) (a run of no more steps than its warmup: min_lr after it),

        cosine: min_lr + (lr - min_lr) (1 + cos(pi p)) / 2     linear: lr - (lr - min_lr) p
        sqrt:   lr - (lr - min_lr) sqrt(p)  (WSD's "1 - sqrt" cooldown)     constant: lr

    An fp16 step skipped on an overflow applies no update and does not advance the schedule (as Megatron's),
    so warmup is not spent on them. Megatron's OptimizerParamScheduler is this schedule one update later: its
    first update takes init_lr (0 by default), its peak is update w and its min_lr update D. A fixed
    decay_steps (Megatron's lr-decay-iters) keeps the schedule when a resumed run raises `steps`."""
    if update < o.warmup_steps:
        return o.lr * (update + 1) / o.warmup_steps
    if o.decay_style == "constant":
        return o.lr
    start, last = _decay_span(o, steps)
    progress = min(1.0, max(0.0, (update - start) / max(1, last - start)))
    if o.decay_style == "linear":
        return o.lr - (o.lr - o.min_lr) * progress
    if o.decay_style == "sqrt":
        return o.lr - (o.lr - o.min_lr) * math.sqrt(progress)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * progress))


def _decay_span(o: OptimizerConfig, steps: int) -> tuple[int, int]:
    """(k, D - 1) of learning_rate: the updates at which the decay starts (from lr) and ends (at min_lr)."""
    last = (o.decay_steps or steps) - 1
    return max(o.warmup_steps - 1, 0, last - o.cooldown_steps if o.cooldown_steps else 0), last


SCHEDULE_KEYS = ("lr", "min_lr", "warmup_steps", "decay_style", "decay_steps", "cooldown_steps")


def _decays(o: OptimizerConfig) -> bool:
    """Whether the schedule's lr moves after the warmup (not constant, and min_lr below lr)."""
    return o.decay_style != "constant" and o.min_lr != o.lr


def warmup_note(o: OptimizerConfig, steps: int) -> str | None:
    """A start-up line where the warmup lasts the whole run (warmup_steps >= steps: a short fine-tune with the
    default warmup): its lr rises to its last step, and what follows the warmup (a decay) never comes."""
    if o.warmup_steps < steps or not o.lr:
        return None
    return (f"note: optimizer.warmup_steps={o.warmup_steps} >= steps={steps}: the lr warms up over the whole run, "
            f"from {learning_rate(0, o, steps):.2e} to {learning_rate(steps - 1, o, steps):.2e} at its last step "
            f"(lower optimizer.warmup_steps for the {o.decay_style} schedule after the warmup)")


def schedule_note(saved: dict, cfg: TrainConfig, update: int, updates: int) -> str | None:
    """A resume's log line when one of the `updates` this run may apply (the first: `update`, 0-based) takes
    another lr than in the run that saved the checkpoint (`saved`: its config): the first such update, counted
    from 1 as steps are, both lrs, and what changed (a raised `steps` moves a decay that ends at the last step).

    Each schedule is one closed form between its breaks (the warmup's end, the decay's start and end): the lrs
    are compared at the first four updates from each break and at sixteenths of the spans between them, a few
    hundred whatever the run's length (a change that shows only within a span, as a longer cosine's first
    updates barely leave lr, is named where it shows, a sixteenth of the span at the latest)."""
    fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    if not isinstance(saved.get("optimizer"), dict) or not isinstance(saved.get("steps"), int):
        return None                            # (a meta.json edited by hand: nothing to compare with)
    runs = ((OptimizerConfig(**{k: v for k, v in saved["optimizer"].items() if k in fields}), saved["steps"]),
            (cfg.optimizer, cfg.steps))
    end = update + updates
    edges = sorted({update, end} | {b for o, steps in runs for b in (o.warmup_steps, *_decay_span(o, steps))})
    at = sorted(u for a, b in zip(edges, edges[1:]) for u in {a + d for d in range(4)} |
                {a + (b - a) * i // 16 for i in range(1, 16)} if update <= u < end)
    lrs = ((u, *(learning_rate(u, o, steps) for o, steps in runs)) for u in at)
    u, was, now = next((lr for lr in lrs if not math.isclose(lr[1], lr[2], rel_tol=1e-12)), (None, 0, 0))
    if u is None:
        return None
    (old, old_steps), (new, _) = runs
    moved = old_steps != cfg.steps and any(_decays(o) and not o.decay_steps for o in (old, new))
    changed = [f"steps: {old_steps} -> {cfg.steps}"] if moved else []
    changed += [f"optimizer.{k}: {getattr(old, k)} -> {getattr(new, k)}" for k in SCHEDULE_KEYS
                if getattr(old, k) != getattr(new, k)]
    keep = (f"; optimizer.decay_steps={old_steps} keeps the saved run's decay"
            if moved and not old.decay_steps and not new.decay_steps and _decays(new) else "")
    digits = next((d for d in range(3, 17) if f"{now:.{d}g}" != f"{was:.{d}g}"), 17)     # (as many as differ)
    return (f"the lr schedule changed ({', '.join(changed)}): update {u + 1} takes lr {now:.{digits}g}, where the "
            f"run that saved it would have taken {was:.{digits}g}{keep}")
