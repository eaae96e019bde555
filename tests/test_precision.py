"""Mixed precision: the fp16 loss scaler, mesh-wide overflow skipping, fp32 main grads, 16-bit training."""
import json
import math

import pytest
import torch

from ranks import spawn
from harness import make_trainer, small_config, train_on_ranks
from megatron_mini.config import PrecisionConfig, TrainConfig, register_configs
from megatron_mini.optimizer import DynamicLossScaler


def test_loss_scaler_state_machine():
    s = DynamicLossScaler(PrecisionConfig(dtype="fp16", initial_loss_scale=1024.0, loss_scale_growth_interval=3,
                                          loss_scale_hysteresis=2, min_loss_scale=256.0))
    s.update(found_inf=True)
    assert s.scale == 1024.0                 # hysteresis: the first overflow is tolerated
    s.update(found_inf=True)
    assert s.scale == 512.0                  # the second backs off
    s.update(found_inf=True)
    assert s.scale == 256.0                  # until growth, every further overflow backs off
    s.update(found_inf=True)
    assert s.scale == 256.0                  # clamped at min_loss_scale
    for _ in range(2):
        s.update(found_inf=False)
    assert s.scale == 256.0
    s.update(found_inf=False)
    assert s.scale == 512.0                  # growth after growth_interval clean steps ...
    s.update(found_inf=True)
    assert s.scale == 512.0                  # ... which also restores the hysteresis
    for _ in range(3):
        s.update(found_inf=False)
    assert s.scale == 1024.0                 # an overflow resets the clean-step count


def test_loss_scaler_resumed_under_new_settings():
    """A checkpoint's counts under a shorter growth interval or a lower hysteresis (precision may change on
    resume): the scale still grows after the new interval, and backs off after the new hysteresis."""
    saved = {"scale": 1024.0, "clean_steps": 500, "hysteresis_left": 2, "skips_at_min": 0, "skipped_steps": 3}
    s = DynamicLossScaler(PrecisionConfig(dtype="fp16", loss_scale_growth_interval=100, loss_scale_hysteresis=1))
    s.load_state_dict(saved)
    s.update(found_inf=False)
    assert s.scale == 2048.0 and s.clean_steps == 0
    s.update(found_inf=True)
    assert s.scale == 1024.0                 # hysteresis 1: the first overflow backs off
    s = DynamicLossScaler(PrecisionConfig(dtype="fp16", loss_scale_hysteresis=1))
    s.load_state_dict(saved)                 # 2 overflows left under the old hysteresis: capped at the new 1
    s.update(found_inf=True)
    assert s.scale == 512.0


def test_loss_scale_grows_no_further_than_its_cap():
    """Growth stops at MAX_LOSS_SCALE (a scale past fp32's range would be inf, and inf x backoff stays inf)."""
    from megatron_mini.config import MAX_LOSS_SCALE
    s = DynamicLossScaler(PrecisionConfig(dtype="fp16", initial_loss_scale=MAX_LOSS_SCALE / 2,
                                          loss_scale_growth_factor=1e30, loss_scale_growth_interval=1))
    s.update(found_inf=False)
    s.update(found_inf=False)
    assert s.scale == MAX_LOSS_SCALE == 2.0 ** 64


@pytest.mark.parametrize("dtype,clip", [("fp16", 1.0), ("bf16", 1e3), ("fp16", 1e-40)])
def test_an_optimizer_step_is_adamw_of_the_unscaled_clipped_gradient(dtype, clip):
    """Optimizer.step against AdamW in fp64: the fused kernel's grad_scale divides the main grads by the fp16 loss
    scale and the clipping factor (min(1, grad_clip / (norm + 1e-6))), moments with bias correction, weight decay
    lr * wd * w on the weights (not LayerNorm-like no_weight_decay ones), on the fp32 masters of 16-bit weights.
    A grad_clip so small that the divisor passes fp32's largest (1e-40: the fill raised) leaves weight decay alone."""
    from megatron_mini.config import OptimizerConfig
    from megatron_mini.data_parallel import GradBuffer
    from megatron_mini.mesh import ParallelMesh
    from megatron_mini.optimizer import Optimizer
    from megatron_mini.tensor_parallel import ParamSpec

    torch.manual_seed(0)
    shapes, dt = {"weight": (37, 11), "bias": (11,)}, {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    params = [(n, torch.nn.Parameter(torch.randn(s).to(dt))) for n, s in shapes.items()]
    for n, p in params:
        p.spec = ParamSpec(no_weight_decay=n == "bias")
    mesh = ParallelMesh(1, 1, 1)
    buffer = GradBuffer(params, mesh, dt, zero=False, bucket_numel=TrainConfig.ddp_bucket_numel)
    # eps of the order of the clipped gradient's elements: Adam is scale-free but for eps, which so tells a gradient
    # left loss-scaled or unclipped from the right one; and each step's gradient of another size (another clip)
    o = OptimizerConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-2, grad_clip=clip)
    optimizer = Optimizer([buffer], mesh, o, PrecisionConfig(dtype=dtype, initial_loss_scale=1024.0), zero=False)
    w = {n: p.detach().double() for n, p in params}
    m, v = ({n: torch.zeros(s, dtype=torch.float64) for n, s in shapes.items()} for _ in range(2))
    for t, size in ((1, 1.0), (2, 4.0), (3, 0.25)):
        g = {n: size * torch.randn(s, dtype=torch.float64) for n, s in shapes.items()}
        scale = optimizer.scaler.scale if optimizer.scaler else 1.0
        for n, p in params:
            p.main_grad.copy_(g[n] * scale)
        norm = math.sqrt(sum(x.square().sum().item() for x in g.values()))
        assert optimizer.step(o.lr)[0] == pytest.approx(norm, rel=1e-6)       # the unscaled norm
        clipped = min(1.0, clip / (norm + 1e-6))
        for n in shapes:
            w[n] *= 1 - o.lr * (0.0 if n == "bias" else o.weight_decay)
            m[n] = o.beta1 * m[n] + (1 - o.beta1) * clipped * g[n]
            v[n] = o.beta2 * v[n] + (1 - o.beta2) * (clipped * g[n]).square()
            w[n] -= o.lr * (m[n] / (1 - o.beta1 ** t)) / ((v[n] / (1 - o.beta2 ** t)).sqrt() + o.eps)
    assert clip > 1e2 or clipped < 0.5                                         # (fp16: the clip was taken)
    (r,) = optimizer.ranges
    for p, n, a, b in buffer.segments(r.lo, r.hi):
        master = r.master[a - r.lo:b - r.lo].view(shapes[n]).double()
        assert (master - w[n]).abs().max().item() < 1e-6, n
        assert torch.equal(p.detach(), master.to(dt))                         # the 16-bit weights: the masters'


def _steps_beside_torch_adamw(cfg, steps):
    """Train `steps` steps on one rank; before each update, give the same gradients to an fp64 copy of the model
    under torch.nn.utils.clip_grad_norm_ and torch.optim.AdamW, its parameters grouped by Megatron's rule (no
    weight decay for biases and other 1-D parameters: LayerNorm). Returns ({name: no_weight_decay}, [(torch's
    total norm, ours)], {name: the largest |ours - torch's|})."""
    trainer = make_trainer(cfg)
    named = [(n, p) for chunk in trainer.chunks for n, p in chunk.named_global_parameters()]
    ref = {n: torch.nn.Parameter(p.detach().double().clone()) for n, p in named}
    o = cfg.optimizer
    adam = torch.optim.AdamW([{"params": [ref[n] for n, p in named if p.ndim > 1], "weight_decay": o.weight_decay},
                              {"params": [ref[n] for n, p in named if p.ndim == 1], "weight_decay": 0.0}],
                             betas=(o.beta1, o.beta2), eps=o.eps, foreach=False)
    step, norms = trainer.optimizer.step, []

    def step_beside(lr, weight_norm=False):
        for n, p in named:
            ref[n].grad = p.main_grad.double()
        norms.append([torch.nn.utils.clip_grad_norm_(list(ref.values()), o.grad_clip).item()])
        for group in adam.param_groups:
            group["lr"] = lr
        adam.step()
        out = step(lr, weight_norm)
        norms[-1].append(out[0])
        return out
    trainer.optimizer.step = step_beside
    for _ in range(steps):
        trainer.train_step()
    return ({n: p.spec.no_weight_decay for n, p in named}, norms,
            {n: (p.detach().double() - ref[n].detach()).abs().max().item() for n, p in named})


def test_the_models_updates_are_torch_adamw_with_megatrons_weight_decay(small_data, tmp_path):
    """The whole model (fp32, one rank) for 4 steps against torch.optim.AdamW in fp64 on the same gradients,
    clipped by torch.nn.utils.clip_grad_norm_ at every step: the same global norm, the same weights to fp32
    rounding. Weight decay as Megatron's (and nanoGPT's): on the matrices, the word and position embeddings
    included; not on biases and LayerNorm."""
    cfg = small_config(small_data, tmp_path, steps=4, **{"optimizer.grad_clip": 0.2})
    no_decay, norms, worst = spawn(1, _steps_beside_torch_adamw, cfg, cfg.steps)[0]
    assert not no_decay["embedding.word_embeddings.weight"] and not no_decay["embedding.position_embeddings"]
    assert no_decay["head.ln_f.weight"] and no_decay["blocks.0.ln1.bias"] and no_decay["blocks.0.mlp.fc2.bias"]
    assert all(torch_norm > cfg.optimizer.grad_clip for torch_norm, _ in norms), norms     # (clipped throughout)
    for torch_norm, ours in norms:
        assert ours == pytest.approx(torch_norm, rel=1e-6), norms
    assert max(worst.values()) < 1e-6, sorted(worst.items(), key=lambda kv: -kv[1])[:3]


def test_learning_rate_schedule():
    """Warmup lr/w, 2 lr/w, ..., lr (once), then a cosine or a line down to exactly min_lr at the last step
    (or at update decay_steps - 1, whatever `steps`), min_lr after it; constant: lr after the warmup."""
    from megatron_mini.config import OptimizerConfig
    from megatron_mini.optimizer import learning_rate
    o = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=3)
    warmup = [1 / 3, 2 / 3]
    cosine = [0.1 + 0.45 * (1 + math.cos(math.pi * k / 5)) for k in range(6)]   # the peak at update 2 = k 0
    assert [learning_rate(u, o, 8) for u in range(8)] == pytest.approx(warmup + cosine, abs=1e-12)
    assert learning_rate(20, o, 8) == pytest.approx(0.1)                           # past the end: min_lr
    o.decay_style = "linear"
    assert [learning_rate(u, o, 8) for u in range(8)] == pytest.approx(warmup + [1 - 0.9 * k / 5 for k in range(6)],
                                                                        abs=1e-12)
    o.decay_style, o.decay_steps = "cosine", 8          # the same decay in a run of any length
    for steps in (4, 8, 100):
        assert [learning_rate(u, o, steps) for u in range(12)] == pytest.approx(warmup + cosine + [0.1] * 4,
                                                                                 abs=1e-12)
    o.decay_style = "constant"
    assert [learning_rate(u, o, 8) for u in range(8)] == pytest.approx(warmup + [1.0] * 6, abs=1e-12)
    o.decay_style, o.decay_steps, o.cooldown_steps = "sqrt", 0, 3     # warmup-stable-decay: the last 3 decay
    assert [learning_rate(u, o, 10) for u in range(12)] == pytest.approx(
        warmup + [1.0] * 5 + [1 - 0.9 * math.sqrt(k / 3) for k in (1, 2, 3)] + [0.1] * 2, abs=1e-12)
    o.decay_style = "linear"                                           # (the stable part grows with steps)
    assert [learning_rate(u, o, 20)for u in (16, 17, 18, 19)] == pytest.approx([1.0, 0.7, 0.4, 0.1], abs=1e-12)
    o.cooldown_steps = 7                                               # (all of it: from the peak)
    assert [learning_rate(u, o, 10) for u in range(2, 10)] == pytest.approx([1 - 0.9 * k / 7 for k in range(8)],
                                                                            abs=1e-12)
    o.cooldown_steps = 0
    o.decay_style, o.decay_steps, o.warmup_steps = "cosine", 0, 0
    assert [learning_rate(u, o, 8) for u in (0, 7)] == pytest.approx([1.0, 0.1])


def test_a_warmup_as_long_as_the_run_is_noted():
    """warmup_steps >= steps (a short fine-tune with the default warmup): a start-up note with the first and last
    lr (learning_rate's: lr/w and lr * steps/w) and the fix; a shorter warmup, or lr 0, none."""
    from megatron_mini.config import OptimizerConfig
    from megatron_mini.optimizer import warmup_note
    o = OptimizerConfig(lr=3e-3, min_lr=3e-4, warmup_steps=20)
    assert warmup_note(o, 6) == ("note: optimizer.warmup_steps=20 >= steps=6: the lr warms up over the whole run, "
                                 "from 1.50e-04 to 9.00e-04 at its last step (lower optimizer.warmup_steps for the "
                                 "cosine schedule after the warmup)")
    assert "from 1.50e-04 to 3.00e-03 at its last step" in warmup_note(o, 20)
    assert warmup_note(o, 21) is None and warmup_note(OptimizerConfig(lr=0.0, warmup_steps=20), 6) is None


def test_a_resume_that_moves_the_lr_schedule_says_so():
    """A resume one of whose updates gets another lr than in the run that saved it (steps raised under a decay
    that ends at the last step; an optimizer.* changed) names the first such update (counted from 1), what
    changed, both lrs, and the fix for steps."""
    import dataclasses
    from megatron_mini.config import OptimizerConfig, TrainConfig
    from megatron_mini.optimizer import schedule_note as note

    def schedule_note(saved, cfg, update, skipped=0):     # (a run of steps - update steps, `skipped` before it)
        return note(saved, cfg, update, cfg.steps - update - skipped)
    saved = dataclasses.asdict(TrainConfig(steps=100, optimizer=OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=0)))
    saved = json.loads(json.dumps(saved))                                       # as meta.json holds it
    del saved["optimizer"]["decay_steps"], saved["optimizer"]["decay_style"]     # (a checkpoint of before them)
    same = TrainConfig(steps=100, optimizer=OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=0))
    assert schedule_note(saved, same, 99) is None
    longer = TrainConfig(steps=199, optimizer=OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=0))
    assert schedule_note(saved, longer, 99) == (
        "the lr schedule changed (steps: 100 -> 199): update 100 takes lr 0.55, where the run that saved it would "
        "have taken 0.1; optimizer.decay_steps=100 keeps the saved run's decay")
    longer.optimizer.decay_steps = 100
    assert schedule_note(saved, longer, 99) is None
    assert schedule_note(saved, longer, 150) is None                           # (both at min_lr past the decay)
    wsd = TrainConfig(steps=100, optimizer=OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=0, cooldown_steps=20))
    assert schedule_note(saved, wsd, 0) == ("the lr schedule changed (optimizer.cooldown_steps: 0 -> 20): update 2 "
                                            "takes lr 1, where the run that saved it would have taken 0.9998")
    lower = TrainConfig(steps=100, optimizer=OptimizerConfig(lr=0.5, min_lr=0.1, warmup_steps=0))
    assert schedule_note(saved, lower, 0) == ("the lr schedule changed (optimizer.lr: 1.0 -> 0.5): update 1 takes "
                                              "lr 0.5, where the run that saved it would have taken 1")
    assert schedule_note(saved, lower, 99) is None                             # (the same min_lr at the end)
    mid = dict(saved, steps=101)                   # (p = 1/2 at update 51: cosine and linear agree there)
    linear = TrainConfig(steps=101, optimizer=OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=0,
                                                               decay_style="linear"))
    assert schedule_note(mid, linear, 50) == ("the lr schedule changed (optimizer.decay_style: cosine -> linear): "
                                              "update 52 takes lr 0.541, where the run that saved it would have "
                                              "taken 0.536")
    warm = dict(saved, optimizer=dict(saved["optimizer"], warmup_steps=10))
    later = TrainConfig(steps=199, optimizer=OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=10))
    assert schedule_note(warm, later, 3).startswith("the lr schedule changed (steps: 100 -> 199): update 11 takes")
    assert schedule_note({"config": "edited by hand"}, same, 0) is None
    lower.optimizer.lr = 1.0
    lower.optimizer.min_lr = 0.2
    assert schedule_note(saved, lower, 100) is None                  # (no update left: an owed evaluation's start)
    assert schedule_note(saved, lower, 95, skipped=5) is None        # (nor after 5 fp16 steps skipped)


def test_the_schedule_note_looks_at_this_runs_updates_only_and_few(monkeypatch):
    """No note for updates past this run's steps, nor for a change that leaves every lr as it was (a flat
    schedule's steps or decay_steps, a cooldown as long as the whole decay); in schedules 10**7 steps long it
    computes a few hundred lrs, the first that differs 9 million updates on among them (a warmup-stable-decay
    run extended: its cooldown moves); a constant lr's note does not blame steps."""
    import dataclasses
    from megatron_mini import optimizer
    from megatron_mini.config import OptimizerConfig, TrainConfig

    def saved(steps, **o):
        return json.loads(json.dumps(dataclasses.asdict(TrainConfig(steps=steps, optimizer=OptimizerConfig(**o)))))
    shorter = TrainConfig(steps=100, optimizer=OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=200))
    assert optimizer.schedule_note(saved(1000, lr=1.0, min_lr=0.1, warmup_steps=200), shorter, 50, 50) is None
    lrs, learning_rate = [], optimizer.learning_rate
    monkeypatch.setattr(optimizer, "learning_rate", lambda *a: lrs.append(a) or learning_rate(*a))
    for before, after in ((dict(decay_style="constant"), dict(decay_style="constant")),
                          (dict(min_lr=1.0), dict(min_lr=1.0)),
                          (dict(decay_style="constant"), dict(decay_style="constant", decay_steps=10**8)),
                          (dict(steps=10**7), dict(steps=10**7, cooldown_steps=10**7 - 20))):
        longer = TrainConfig(steps=after.pop("steps", 10**7),
                             optimizer=OptimizerConfig(**{"lr": 1.0, "min_lr": 0.1, **after}))
        old = saved(before.pop("steps", 100), **{"lr": 1.0, "min_lr": 0.1, **before})
        assert optimizer.schedule_note(old, longer, 100, longer.steps - 100) is None
    wsd = saved(10**7, lr=1.0, min_lr=0.1, cooldown_steps=10**6)
    extended = TrainConfig(steps=2 * 10**7, optimizer=OptimizerConfig(lr=1.0, min_lr=0.1, cooldown_steps=10**6))
    assert optimizer.schedule_note(wsd, extended, 10**5, 2 * 10**7 - 10**5).startswith(
        "the lr schedule changed (steps: 10000000 -> 20000000): update 9000001 takes lr 1, where the run that saved "
        "it would have taken 0.99999")
    flat_start = TrainConfig(steps=10**7, optimizer=OptimizerConfig(lr=1.0, min_lr=0.1, cooldown_steps=5 * 10**6))
    assert optimizer.schedule_note(saved(10**7, lr=1.0, min_lr=0.1), flat_start, 20, 10**7 - 20).startswith(
        "the lr schedule changed (optimizer.cooldown_steps: 0 -> 5000000): update 312519 takes lr 1, where")
    assert len(lrs) < 1000                     # (a cosine barely leaves lr at first: a sixteenth of the span on)
    constant = TrainConfig(steps=200, optimizer=OptimizerConfig(lr=0.5, decay_style="constant", warmup_steps=0))
    assert optimizer.schedule_note(saved(100, lr=1.0, decay_style="constant", warmup_steps=0), constant, 100,
                                   100) == ("the lr schedule changed (optimizer.lr: 1.0 -> 0.5): update 101 takes lr "
                                            "0.5, where the run that saved it would have taken 1")


def test_the_resumed_run_logs_the_schedule_note(small_data, tmp_path):
    cfg = small_config(small_data, tmp_path / "run", steps=2, resume="auto", **{"optimizer.warmup_steps": 0})
    train_on_ranks(1, cfg)
    cfg.steps = 4
    train_on_ranks(1, cfg)
    assert "resume: the lr schedule changed (steps: 2 -> 4): update 3 takes lr 0.00065" in \
        (tmp_path / "run" / "logs" / "rank0000.log").read_text()


def _lrs_through_skips(cfg):
    trainer = make_trainer(cfg)
    return [(out["lr"], out["skipped"]) for out in (trainer.train_step() for _ in range(10))]


def test_skipped_fp16_steps_do_not_spend_the_warmup(small_data, tmp_path):
    """A loss scale of 2^24 overflows fp16 for the first steps: they apply nothing, and the first update
    that applies gets the first warmup lr (lr / warmup_steps), the next the second."""
    cfg = small_config(small_data, tmp_path, gbs=4,
                       **{"precision.dtype": "fp16", "precision.initial_loss_scale": 2.0 ** 24})
    steps = spawn(1, _lrs_through_skips, cfg)[0]
    o = cfg.optimizer
    assert steps[0][1] and sum(not skipped for _, skipped in steps) >= 2, steps
    applied = 0                              # updates applied before each step
    for lr, skipped in steps:
        if applied < o.warmup_steps:
            assert lr == pytest.approx(o.lr * (applied + 1) / o.warmup_steps), steps
        applied += not skipped


def _megatron_scaler_states(overflows, scale, growth_interval, hysteresis):
    """Megatron's DynamicGradScaler, written out: its (scale, growth tracker, hysteresis tracker) and the steps
    skipped so far, after each step of `overflows` (True: that step's gradients had an inf)."""
    growth, left, skipped, states = 0, hysteresis, 0, []
    for inf in overflows:
        if inf:
            growth, left, skipped = 0, left - 1, skipped + 1
            if left <= 0:
                scale = max(scale * 0.5, 1.0)
        else:
            growth += 1
            if growth == growth_interval:
                growth, left, scale = 0, hysteresis, scale * 2.0
        states.append((scale, growth, left, skipped))
    return states


def _train_with_an_inf_on_one_rank(cfg, rank, steps):
    """train(cfg), where global rank `rank` (negative: from the last) puts an inf into one element of the gradient
    it holds after the DP sync (with ZeRO-1: its own shard) at each 1-based step in `steps`: (rank 0's history,
    whether each step of this run was skipped on this rank)."""
    import torch.distributed as dist
    from megatron_mini import optimizer
    from megatron_mini.training import train

    finalize, step, skipped = optimizer.Optimizer.finalize_grads, optimizer.Optimizer.step, []

    def poisoned(self):
        finalize(self)
        step_index = self.step_count + (self.scaler.skipped_steps if self.scaler else 0)      # (0-based)
        if dist.get_rank() == rank % dist.get_world_size() and step_index + 1 in steps:
            self.ranges[0].grad[5] = float("inf")

    def recorded(self, *args, **kwargs):
        out = step(self, *args, **kwargs)
        skipped.append(out[1])
        return out
    optimizer.Optimizer.finalize_grads, optimizer.Optimizer.step = poisoned, recorded
    return train(cfg), skipped


def test_an_overflow_on_one_rank_skips_everywhere_and_resumes_bitwise(small_data, tmp_path):
    """fp16 at pp=2 x dp=2 with ZeRO-1, an inf in one element of rank 3's gradient shard at steps 2 and 4 of 6
    (growth interval 2, hysteresis 2; no other step overflows at 2^16): every rank skips those steps and no other;
    a skipped step leaves the weights, fp32 masters, Adam's moments and step count as they were (its checkpoint
    holds the step before's), logs grad_norm null and the lr of the update it did not apply, which the next step
    takes; the scaler's state after each step is Megatron's (_megatron_scaler_states). Resumed from step 2 (right
    after an overflow, mid-hysteresis: it backs off at step 4 and grows at step 6 only where both trackers were
    kept), the run continues bitwise: losses, scaler, final weights."""
    from megatron_mini.checkpoint import ShardReader, read_meta
    from megatron_mini.optimizer import learning_rate

    overflows = [step in (2, 4) for step in range(1, 7)]
    kw = dict(steps=6, save_interval=1, keep_checkpoints=6, gbs=8, pp=2, zero=1, log_interval=1,
              **{"precision.dtype": "fp16", "precision.initial_loss_scale": 2.0 ** 16,
                 "precision.loss_scale_growth_interval": 2, "precision.loss_scale_hysteresis": 2})
    cfg = small_config(small_data, tmp_path / "full", **kw)
    runs = spawn(4, _train_with_an_inf_on_one_rank, cfg, 3, {2, 4}, init_group=False)
    assert [skipped for _, skipped in runs] == [overflows] * 4
    full = runs[0][0]
    saved = [read_meta(str(tmp_path / "full" / "checkpoints" / f"step_{k:06d}")) for k in range(1, 7)]
    expected = [(k + 1 - skipped, scale, growth, left, skipped)        # (Adam's step count first)
                for k, (scale, growth, left, skipped) in enumerate(_megatron_scaler_states(overflows, 2.0 ** 16, 2, 2))]
    assert [(m["optimizer"]["step_count"], *(m["optimizer"]["scaler"][k] for k in (
        "scale", "clean_steps", "hysteresis_left", "skipped_steps"))) for m in saved] == expected
    records = [json.loads(line) for line in open(tmp_path / "full" / "metrics.jsonl")]
    applied = [sum(not o for o in overflows[:k]) for k in range(6)]        # updates applied before each step
    assert [r["lr"] for r in records] == [learning_rate(a, cfg.optimizer, cfg.steps) for a in applied]
    assert [r["grad_norm"] is None for r in records] == overflows
    for k in (2, 4):                     # the skipped step's checkpoint holds the state of the step before's
        before, after = (ShardReader(p, read_meta(p)) for p in (
            str(tmp_path / "full" / "checkpoints" / f"step_{j:06d}") for j in (k - 1, k)))
        for name in before.names():
            for key in ("weight", "master", "exp_avg", "exp_avg_sq"):
                assert torch.equal(before.full(name, key), after.full(name, key)), (k, name, key)
    step2 = str(tmp_path / "full" / "checkpoints" / "step_000002")
    resumed = spawn(4, _train_with_an_inf_on_one_rank, small_config(small_data, tmp_path / "resumed", resume=step2,
                                                                     **kw), 3, {2, 4}, init_group=False)
    assert [skipped for _, skipped in resumed] == [overflows[2:]] * 4
    assert resumed[0][0]["loss"] == full["loss"][2:]
    last = [str(tmp_path / run / "checkpoints" / "step_000006") for run in ("full", "resumed")]
    assert read_meta(last[0])["optimizer"] == read_meta(last[1])["optimizer"]
    readers = [ShardReader(p, read_meta(p)) for p in last]
    assert all(torch.equal(readers[0].full(name), readers[1].full(name)) for name in readers[0].names())


def _step_with_injected_value(cfg, poisoned_rank, value):
    """One clean step, then the gradients of another batch with `value` (inf, nan) in an element of the (reduced)
    gradient that `poisoned_rank` owns, and Optimizer.step on them: (its return value, or the FloatingPointError's
    message, whether the weights and Adam's state are as they were, whether Adam's step count is, the fp16 scaler's
    state before and after (None without one))."""
    import torch.distributed as dist

    trainer = make_trainer(cfg)
    trainer.train_step()                     # one clean step, so optimizer state is non-trivial
    trainer.optimizer.finish_param_gather()  # (ZeRO-1: the step's weight gathers are still in flight)
    before = [t.clone() for buf in trainer.buffers for t in (buf.params_flat,)]
    state = [(r.master.clone(), r.exp_avg.clone(), r.exp_avg_sq.clone()) for r in trainer.optimizer.ranges]
    scaler = trainer.optimizer.scaler
    steps, scaler_before = trainer.optimizer.step_count, scaler and scaler.state_dict()
    batch = torch.zeros(cfg.num_microbatches(trainer.mesh.dp), cfg.mbs, cfg.model.seq_len + 1, dtype=torch.long)
    trainer.engine.train_step(batch, scaler.scale if scaler else 1.0, cfg.gbs * cfg.model.seq_len, 0)
    if dist.get_rank() == poisoned_rank:
        trainer.optimizer.ranges[0].grad[3] = value
    try:
        result = trainer.optimizer.step(lr=1e-3)
    except FloatingPointError as e:
        result = str(e)
    unchanged = all(torch.equal(a, buf.params_flat) for a, buf in zip(before, trainer.buffers))
    unchanged &= all(torch.equal(m, r.master) and torch.equal(a, r.exp_avg) and torch.equal(v, r.exp_avg_sq)
                     for (m, a, v), r in zip(state, trainer.optimizer.ranges))
    return result, unchanged, trainer.optimizer.step_count == steps, scaler_before, scaler and scaler.state_dict()


@pytest.mark.parametrize("zero", [0, 1])
def test_injected_inf_skips_the_step_on_every_rank(zero, small_data, tmp_path):
    cfg = small_config(small_data, tmp_path, tp=2, pp=2, zero=zero, gbs=8, **{"precision.dtype": "fp16",
                                                                              "precision.initial_loss_scale": 1024.0})
    results = spawn(8 if zero else 4, _step_with_injected_value, cfg, 3, float("inf"))
    for (_, skipped, _), unchanged, same_step_count, scaler_before, scaler_after in results:
        assert skipped and unchanged and same_step_count
        assert scaler_after["hysteresis_left"] == scaler_before["hysteresis_left"] - 1


def test_a_nan_gradient_in_bf16_stops_every_rank_before_the_update(small_data, tmp_path):
    """Without a loss scaler (bf16; fp32 alike) a gradient element that is nan on one rank while the loss is finite
    is no step to skip: every rank raises the same FloatingPointError (the norm's all-reduce carries it to all;
    training.train makes it one message), and no weight or Adam state has moved (Megatron's
    check_for_nan_in_grad raises too)."""
    cfg = small_config(small_data, tmp_path, tp=2, pp=2, gbs=8, **{"precision.dtype": "bf16"})
    for result, unchanged, same_step_count, _, _ in spawn(4, _step_with_injected_value, cfg, 3, float("nan")):
        assert result == "the gradient norm is not finite" and unchanged and same_step_count


def test_a_gradient_norm_that_is_not_finite_names_its_step(small_data, tmp_path):
    """bf16 (no loss scaler) at pp=2, an inf in the last stage's gradient at step 2 of 3: every rank stops with one
    line that names the step, as a loss that is not finite does."""
    cfg = small_config(small_data, tmp_path, steps=3, gbs=8, pp=2, **{"precision.dtype": "bf16"})
    with pytest.raises(RuntimeError, match=r"Training stopped \(bf16\): the gradient norm is not finite at step 2\. "
                                           r"Nothing was saved over the last good checkpoint \(none\)"):
        spawn(2, _train_with_an_inf_on_one_rank, cfg, 1, {2}, init_group=False)


@pytest.fixture(scope="module")
def fp32_run(small_data, tmp_path_factory):
    return train_on_ranks(1, small_config(small_data, tmp_path_factory.mktemp("fp32")))


# how far (relative, worst step of 20) 16-bit compute with fp32 master weights may stray from fp32: measured
# 1.4e-4 (bf16), 2.8e-4 (bf16 at tp2 pp2 dp2 sp) and 1.3e-5 (fp16); master weights rounded to 16 bits at every
# step give 1.65e-3 and 7.4e-5, and must fail
TRACKS_FP32 = {"bf16": 6e-4, "fp16": 4e-5}


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_16bit_training_tracks_fp32(dtype, fp32_run, small_data, tmp_path):
    """16-bit compute with fp32 master weights stays within TRACKS_FP32 (relative) of fp32 at every step
    (the fp16 scaler starts at 2^16, which these gradients never overflow: a skipped step would show here)."""
    tolerance = TRACKS_FP32[dtype]
    cfg = small_config(small_data, tmp_path, **{"precision.dtype": dtype, "precision.initial_loss_scale": 2.0 ** 16})
    history = train_on_ranks(1, cfg)
    a, b = torch.tensor(fp32_run["loss"]), torch.tensor(history["loss"])
    rel = ((a - b).abs() / a).max().item()
    assert rel < tolerance, (dtype, a.tolist(), b.tolist())
    assert b[-1] < b[0] - 0.3                # and it trains


def test_fp32_main_grads_beat_bf16_accumulation():
    """Accumulating 8 bf16 microbatch gradients into fp32 main grads (GradBuffer) keeps their exact sum;
    accumulating them in a bf16 `.grad` rounds at every add — the reason main grads exist."""
    from megatron_mini.data_parallel import GradBuffer
    from megatron_mini.mesh import ParallelMesh
    from megatron_mini.tensor_parallel import ParamSpec

    torch.manual_seed(0)
    weight = (torch.randn(256, 256) * 0.05).bfloat16()
    inputs = [torch.randn(64, 256).bfloat16() for _ in range(8)]

    def microbatch_grads():
        w = torch.nn.Parameter(weight.clone())
        grads = []
        for x in inputs:
            (x @ w).float().square().sum().backward()
            grads.append(w.grad.double())
            w.grad = None
        return grads

    exact = sum(microbatch_grads())                      # the same bf16 gradients, summed in fp64

    def accumulated(use_buffer):
        w = torch.nn.Parameter(weight.clone())
        w.spec = ParamSpec()
        buffer = GradBuffer([("w", w)], ParallelMesh(1, 1, 1), torch.bfloat16, zero=False,
                            bucket_numel=TrainConfig.ddp_bucket_numel) if use_buffer else None
        for x in inputs:
            (x @ w).float().square().sum().backward()
        return (buffer.grads_flat.view(w.shape) if use_buffer else w.grad).double()

    main_grad_error = ((accumulated(True) - exact).norm() / exact.norm()).item()
    bf16_grad_error = ((accumulated(False) - exact).norm() / exact.norm()).item()
    assert main_grad_error < 1e-6 < 1e-4 < bf16_grad_error, (main_grad_error, bf16_grad_error)


def _main_grads_beside_their_sources(cfg, loss_scale: float) -> dict:
    """One step's forward and backward (and the gradient sums of finalize_grads) in cfg's 16-bit dtype, on
    this rank, with the fp32-output gradient GEMM of a GPU (gemm_into_fp32 "addmm"), which is exact on the CPU
    as an fp32 GEMM of the 16-bit inputs. Beside it, the fp64 sum of every microbatch's exact gradient,
    formed from the tensors that microbatch's 16-bit forward and backward produced, caught by hooks: for
    each linear dy^T x and the sum of dy (its input x, its output's gradient dy), for the word embedding
    the rows of its output's gradient summed at the ids plus the output layer's dlogits^T x (x: ln_f's output),
    for the position embeddings the embedding's output gradient summed over the batch; summed over DP and,
    for the tied embedding, over the embedding group. Returns {global name: (main grad, reference)} of those,
    and the names of the parameters with no reference (the LayerNorms')."""
    from unittest import mock
    from megatron_mini import comm, tensor_parallel
    from megatron_mini.dataset import first_sample, get_batch
    from megatron_mini.model import Embedding, Head
    from megatron_mini.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    exact_addmm = {"addmm": lambda out, a, b: out.addmm_(a.float(), b.float())}
    with mock.patch.object(tensor_parallel, "gemm_into_fp32", lambda device, dtype: "addmm"), \
            mock.patch.dict(tensor_parallel.GEMM_INTO_FP32, exact_addmm):
        trainer = make_trainer(cfg)
        mesh = trainer.mesh
        params = {p: name for buf in trainer.buffers for p, name in buf.names.items()}
        ref = {p: torch.zeros(p.shape, dtype=torch.float64) for p in params}

        def rows(t):
            return t.detach().double().reshape(-1, t.shape[-1])

        def on_grad(out, add):            # add(dy) once the backward reaches `out`; dy passes on unchanged
            def hook(dy):
                add(dy.detach().double())
            out.register_hook(hook)

        def linear_hook(module, args, out):
            x = rows(args[0])

            def add(dy):
                ref[module.weight].add_(rows(dy).t() @ x)
                ref[module.bias].add_(rows(dy).sum(0))
            on_grad(out, add)

        def lookup_hook(module, args, out):
            ids = args[0].reshape(-1)
            on_grad(out, lambda dy: ref[module.weight].index_add_(0, ids, rows(dy)))

        def positions_hook(module, args, out):             # out, dy [s, b, h]: positions 0 .. s - 1
            on_grad(out, lambda dy: ref[module.position_embeddings][:dy.shape[0]].add_(dy.sum(1)))

        for chunk in trainer.chunks:
            for module in chunk.modules():
                if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                    module.register_forward_hook(linear_hook)
                elif isinstance(module, Embedding):
                    module.register_forward_hook(positions_hook)
                    module.word_embeddings.register_forward_hook(lookup_hook)
                elif isinstance(module, Head):
                    normed, cross_entropy, last = module.ln_f.add_and_norm, module.cross_entropy, {}

                    def add_and_norm(x, r, normed=normed, last=last):
                        h, y = normed(x, r)
                        last["x"] = rows(y)
                        return h, y

                    def head_loss(logits, *args, module=module, cross_entropy=cross_entropy, last=last):
                        x = last["x"]
                        on_grad(logits, lambda dy: ref[module.word_embeddings].add_(rows(dy).t() @ x))
                        return cross_entropy(logits, *args)
                    module.ln_f.add_and_norm, module.cross_entropy = add_and_norm, head_loss

        batch = get_batch(trainer.train_data, 0, cfg.gbs, cfg.mbs, mesh.dp_rank, mesh.dp)
        trainer.engine.train_step(batch, loss_scale, cfg.gbs * cfg.model.seq_len,
                                  first_sample(0, cfg.gbs, mesh.dp_rank, mesh.dp))
        trainer.optimizer.finalize_grads()
    out, unreferenced = {}, []
    for p, name in params.items():
        if not ref[p].any():
            unreferenced.append(name)
            continue
        comm.all_reduce(ref[p], mesh.dp_group)
        if p.spec.tied:
            comm.all_reduce(ref[p], mesh.embedding_group)
        out[name] = (p.main_grad.clone(), ref[p])
    return out, sorted(unreferenced)


def _16bit_main_grads(cfgs: dict) -> dict:
    return {name: _main_grads_beside_their_sources(cfg, scale) for name, (cfg, scale) in cfgs.items()}


# the loss scale: fp16's gradients of the mean token loss stay normal numbers
SIXTEEN_BIT_LAYOUTS = {"pp1-dp2-bf16": (dict(), "bf16", 1.0), "pp1-dp2-fp16": (dict(), "fp16", 2.0 ** 12),
                       "pp2-bf16": (dict(pp=2), "bf16", 1.0)}


@pytest.fixture(scope="module")
def sixteen_bit_grads(small_data, tmp_path_factory):
    cfgs = {name: (small_config(small_data, tmp_path_factory.mktemp(name), gbs=8, mbs=2,
                                **{"model.num_layers": 2, "precision.dtype": dtype}, **layout), scale)
            for name, (layout, dtype, scale) in SIXTEEN_BIT_LAYOUTS.items()}
    return spawn(2, _16bit_main_grads, cfgs)


@pytest.mark.parametrize("layout", list(SIXTEEN_BIT_LAYOUTS))
def test_16bit_microbatch_gradients_accumulate_in_fp32(layout, sixteen_bit_grads):
    """In bf16 and fp16, with 2 microbatches per rank, every linear's, the tied word embedding's and the position
    embeddings' main grad is the fp64 sum of each microbatch's exact gradient of its 16-bit forward
    (_main_grads_beside_their_sources), to fp32 rounding (measured: 1.8e-7 relative at most): no microbatch's
    gradient is rounded to 16 bits first. At pp = 1 the word embedding's gradients from the lookup and from the
    output layer each go into the main grad (autograd summed them into a 16-bit .grad, after the lookup's had
    summed repeated ids in 16 bits on a CPU: 2.4e-3 relative error in bf16, 3.0e-4 in fp16); at pp = 2 each
    stage's part, summed in fp32 over the embedding group (1.6e-3 when each was a bf16 .grad); the position
    embeddings' sum over the batch (1.8e-3 in a bf16 .grad). The LayerNorms' gradients (torch's kernels give them
    in the weights' dtype) are the parameters left."""
    for rank, (grads, unreferenced) in enumerate(r[layout] for r in sixteen_bit_grads):
        assert unreferenced and all(".ln" in name for name in unreferenced), unreferenced
        for name, (main_grad, reference) in grads.items():
            error = ((main_grad.double() - reference).norm() / reference.norm()).item()
            assert error < 1e-6, (rank, name, error)


def test_bf16_trains_at_a_3d_layout(fp32_run, small_data, tmp_path):
    """bf16 compute with fp32 main grads works across tp=2 x pp=2 x dp=2 with sequence parallelism."""
    cfg = small_config(small_data, tmp_path, tp=2, pp=2, sp=True, **{"precision.dtype": "bf16"})
    history = train_on_ranks(8, cfg)
    a, b = torch.tensor(fp32_run["loss"]), torch.tensor(history["loss"])
    assert ((a - b).abs() / a).max().item() < TRACKS_FP32["bf16"], (a.tolist(), b.tolist())


def test_nan_loss_stops_without_saving(small_data, tmp_path):
    """A diverging fp32 run stops with one clear message and saves nothing (no checkpoint directory)."""
    cfg = small_config(small_data, tmp_path, steps=30, save_interval=1, **{"optimizer.lr": 1e6,
                                                                          "optimizer.warmup_steps": 1,
                                                                          "optimizer.grad_clip": 0.0})
    with pytest.raises(RuntimeError,
                       match=r"Training stopped \(fp32\): the (training loss|gradient norm) is (nan|inf)") as err:
        train_on_ranks(1, cfg)
    saved = [int(p.name.split("_")[1]) for p in (tmp_path / "checkpoints").glob("step_*")]
    assert "Nothing was saved over the last good checkpoint" in str(err.value)
    assert len(saved) < 30 and not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_a_precision_preset_is_its_dtype_key():
    """precision=fp16 and precision.dtype=fp16 compose the same PrecisionConfig (the preset started the loss
    scale at 2^16 and the dataclass at 2^32), and so for every preset."""
    import os
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_configs()
    conf = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
    with initialize_config_dir(config_dir=conf, version_base=None):
        for dtype in ("fp32", "fp16", "bf16"):
            preset, key = (OmegaConf.to_object(compose(config_name="config", overrides=[o])).precision
                           for o in (f"precision={dtype}", f"precision.dtype={dtype}"))
            assert preset == key, (dtype, preset, key)


def _clipped_step(cfg):
    """One training step on this rank: ([(global name, tp_rank, ParamSpec, local shape, [a, b), main grad, Adam's
    exp_avg)] of the flat pieces of each parameter's local slice in this rank's optimizer ranges (its ZeRO-1 shard),
    the gradient as the norm saw it (after finalize_grads), exp_avg after the update; the grad_norm the step
    logged). The output layer's copy of the tied embedding (spec.copy) and TP ranks' copies of replicated
    parameters are left out: the gradient norm counts each global parameter once."""
    trainer = make_trainer(cfg)
    opt, tp_rank, grads = trainer.optimizer, trainer.mesh.tp_rank, {}
    norms = opt.global_norms

    def pieces(key):
        return {(r.buffer.names[p], a - r.buffer.offsets[p], b - r.buffer.offsets[p]):
                (p, getattr(r, key)[a - r.lo:b - r.lo].clone()) for r in opt.ranges
                for p, _, a, b in r.buffer.segments(r.lo, r.hi)
                if not p.spec.copy and (p.spec.tp_dim is not None or tp_rank == 0)}

    def seen(weights=False):          # (Optimizer.step calls it once the gradients are final)
        grads.update(pieces("grad"))
        return norms(weights)
    opt.global_norms = seen
    out = trainer.train_step()
    return [(name, tp_rank, p.spec, tuple(p.shape), a, b, g, pieces("exp_avg")[name, a, b][1])
            for (name, a, b), (p, g) in grads.items()], out["grad_norm"]


def _whole(ranks_pieces) -> dict:
    """{global name: (full gradient, full exp_avg)} (fp64) from every rank's _clipped_step pieces: each TP slice
    filled from its ZeRO-1 shards (every element exactly once per DP replica), the slices joined (unshard)."""
    from megatron_mini.tensor_parallel import unshard
    local = {}
    for pieces, _ in ranks_pieces:
        for name, tp_rank, spec, shape, a, b, g, m in pieces:
            slices = local.setdefault(name, (spec, shape, {}))[2]
            flat = slices.setdefault(tp_rank, torch.full((2, math.prod(shape)), math.nan, dtype=torch.float64))
            flat[0, a:b], flat[1, a:b] = g, m
    whole = {}
    for name, (spec, shape, slices) in local.items():
        assert not any(flat.isnan().any() for flat in slices.values()), name       # every element held somewhere
        joined = [unshard([slices[r][k].view(shape) for r in sorted(slices)], spec) for k in (0, 1)]
        whole[name] = tuple(joined)
    return whole


# (world size, layout) of one step, the model cut to 2 blocks: one device, TP with sp (the replicated LayerNorms
# summed over TP), the tied embedding on two stages, ZeRO-1's shards, and all of them at once
NORM_LAYOUTS = {"one-device": (1, {}), "tp2-sp": (2, dict(tp=2, sp=True)), "pp2": (2, dict(pp=2)),
                "dp2-zero1": (2, dict(zero=1)), "tp2-pp2-dp2-sp-zero1": (8, dict(tp=2, pp=2, sp=True, zero=1))}


def _norm_config(small_data, run_dir, **layout):
    return small_config(small_data, run_dir, steps=1, gbs=8, **{"model.num_layers": 2, "optimizer.grad_clip": 0.1},
                        **layout)


@pytest.fixture(scope="module")
def one_device_step(small_data, tmp_path_factory):
    return _whole(spawn(1, _clipped_step, _norm_config(small_data, tmp_path_factory.mktemp("norm-ref"))))


@pytest.mark.parametrize("layout", list(NORM_LAYOUTS))
def test_the_clipped_gradient_norm_is_the_whole_models(layout, one_device_step, small_data, tmp_path):
    """The gradient norm each rank of a layout clips with (and rank 0 logs) is torch.nn.utils.clip_grad_norm_'s
    in fp64 over the whole model's gradients of that step, gathered from its ranks by global name (each parameter
    once: the tied word embedding once, TP-replicated parameters once, every ZeRO-1 shard), to two fp32 ulps (2^-22
    relative): each rank's sum of squares is of fp32 norms of NORM_PIECE-element pieces, and is all-reduced in fp32
    (measured: 8e-8 at most; counting the replicated parameters tp times, the tied embedding twice, or leaving out
    the other DP rank's ZeRO-1 shard is 7% to 31% off). The step scaled every gradient by grad_clip / (norm +
    1e-6), as clip_grad_norm_ scales the fp64 copy: Adam's first moment after the first update is (1 - beta1) times
    it, to a few fp32 roundings (the divisor's, the kernel's scaling, Adam's (1 - beta1) product: 4e-7; measured
    2.2e-7). The gathered
    gradients are the one-device model's, all of it, to the rounding of other sums (measured 4.6e-7)."""
    world, overrides = NORM_LAYOUTS[layout]
    cfg = _norm_config(small_data, tmp_path, **overrides)
    ranks = spawn(world, _clipped_step, cfg)
    whole = _whole(ranks)
    assert {n: g.shape for n, (g, _) in whole.items()} == {n: g.shape for n, (g, _) in one_device_step.items()}
    for name, (g, _) in whole.items():
        reference = one_device_step[name][0]
        assert (g - reference).norm() <= 1e-5 * reference.norm() + 1e-9, name
    params = {n: torch.nn.Parameter(torch.empty_like(g)) for n, (g, _) in whole.items()}
    for name, p in params.items():
        p.grad = whole[name][0].clone()
    torch_norm = torch.nn.utils.clip_grad_norm_(list(params.values()), cfg.optimizer.grad_clip).item()
    assert torch_norm > 10 * cfg.optimizer.grad_clip                    # (clipped)
    for rank, (_, norm) in enumerate(ranks):          # (each rank clips with its own; rank 0's is logged)
        assert norm == pytest.approx(torch_norm, rel=2.0 ** -22), (rank, norm, torch_norm)
    beta1 = cfg.optimizer.beta1
    for name, (_, exp_avg) in whole.items():
        clipped = (1 - beta1) * params[name].grad
        assert torch.allclose(exp_avg, clipped, rtol=4e-7, atol=1e-12), (name, (exp_avg - clipped).abs().max())


def _stop_of_an_fp16_overflow(cfg, where):
    """train(cfg) on this rank, with an inf in every step's `where`: "forward" (the embedding's output on the first
    stage, so the loss is not finite), "gradient" (an element of the last rank's reduced gradient, the loss finite):
    the RunError's message."""
    from megatron_mini import model
    from megatron_mini.config import RunError
    from megatron_mini.training import train

    embed = model.Embedding.forward

    def overflowing(self, *args, **kwargs):
        out = embed(self, *args, **kwargs)
        out.view(-1)[0] = float("inf")
        return out
    try:
        if where == "forward":
            model.Embedding.forward = overflowing
            train(cfg)
        else:
            _train_with_an_inf_on_one_rank(cfg, -1, range(1, cfg.steps + 1))
    except RunError as e:
        return str(e)
    return None


@pytest.mark.parametrize("where, why", [
    ("forward", "the training loss itself is nan: the forward overflows fp16, whatever the loss scale"),
    ("gradient", "the gradients are not finite at any scale")])
def test_an_fp16_run_that_overflows_at_every_scale_says_where(where, why, small_data, tmp_path):
    """fp16 at pp=2 whose every step overflows (scale 4, halved at each overflow down to 1; stop after 2 overflows
    at 1: at step 4): every rank stops with the same one line, which says whether the loss itself was not finite
    (an inf in the forward: no loss scale can help) or the gradients only were."""
    cfg = small_config(small_data, tmp_path, steps=6, gbs=8, pp=2, **{
        "precision.dtype": "fp16", "precision.initial_loss_scale": 4.0, "precision.loss_scale_hysteresis": 1,
        "precision.max_skips_at_min_scale": 2})
    messages = spawn(2, _stop_of_an_fp16_overflow, cfg, where, init_group=False)
    assert messages[0] == messages[1] == (
        f"Training stopped (fp16): 2 steps in a row overflowed at the minimum loss scale 1 (step 4): {why}. Nothing "
        f"was saved over the last good checkpoint (none); use precision=bf16 (fp32's exponent range, no loss scale) "
        f"or lower optimizer.lr.")


def test_a_resume_says_its_loss_scaler_settings_meet_the_checkpoints_scale():
    """A resumed fp16 run continues the checkpoint's loss scaler (scale and counters: Megatron's too), so a
    precision.initial_loss_scale other than the saved run's is not applied, and other scaler settings act on the
    saved scale and counters: one note says so, naming each setting that differs, old -> new; none where they are
    the same, where either run is not fp16, or where the checkpoint holds no scaler state."""
    import dataclasses
    from megatron_mini.checkpoint import loss_scaler_changes

    def changes(saved: dict, now: dict, scaler=True) -> list:
        """The notes of a resume under PrecisionConfig(**now) of a checkpoint saved under PrecisionConfig(**saved)
        (as meta.json holds it), its scaler's state at scale 256 (None without `scaler`)."""
        state = {"scale": 256.0, "clean_steps": 3, "hysteresis_left": 1, "skips_at_min": 0, "skipped_steps": 4}
        meta = {"config": {"precision": json.loads(json.dumps(dataclasses.asdict(PrecisionConfig(**saved))))},
                "optimizer": {"step_count": 7, "scaler": state if scaler else None}}
        return loss_scaler_changes(meta, TrainConfig(precision=PrecisionConfig(**now)))
    fp16 = {"dtype": "fp16"}
    note = "the fp16 loss scale continues from the checkpoint's 256 (its scaler's state is resumed, as Megatron's is): "
    assert changes(fp16, fp16) == []
    assert changes({**fp16, "initial_loss_scale": 2.0 ** 16}, {**fp16, "initial_loss_scale": 1024.0}) == [
        note + "precision.initial_loss_scale=1024 is not applied (65536 when saved)"]
    assert changes({**fp16, "loss_scale_hysteresis": 2, "min_loss_scale": 1.0},
                   {**fp16, "loss_scale_hysteresis": 4, "min_loss_scale": 512.0, "loss_scale_growth_interval": 100}) \
        == [note + "precision.loss_scale_growth_interval: 1000 -> 100, precision.loss_scale_hysteresis: 2 -> 4, "
                   "precision.min_loss_scale: 1 -> 512 act from here on, on its counters (clean_steps 3, "
                   "hysteresis_left 1); the scale starts below the new min_loss_scale (a back-off raises it to it)"]
    assert changes({**fp16, "initial_loss_scale": 8.0, "loss_scale_growth_factor": 4.0}, fp16) == [
        note + "precision.initial_loss_scale=65536 is not applied (8 when saved); "
               "precision.loss_scale_growth_factor: 4 -> 2 acts from here on, on its counters (clean_steps 3, "
               "hysteresis_left 1)"]
    assert changes(fp16, {"dtype": "bf16", "initial_loss_scale": 1.0}) == []        # (no scaler now)
    assert changes({"dtype": "bf16", "initial_loss_scale": 1.0}, fp16, scaler=False) == []   # (a new scaler)


def test_the_resumed_fp16_run_logs_the_loss_scaler_note_once(small_data, tmp_path):
    """The note is among the resume's start lines, once, and the scale is the checkpoint's (what the note says)."""
    cfg = small_config(small_data, tmp_path / "run", steps=2, resume="auto", log_interval=1, **{
        "precision.dtype": "fp16", "precision.initial_loss_scale": 2.0 ** 16})
    train_on_ranks(1, cfg)
    cfg.steps, cfg.precision.initial_loss_scale = 3, 1024.0
    train_on_ranks(1, cfg)
    log = (tmp_path / "run" / "logs" / "rank0000.log").read_text()
    assert log.count("resume: the fp16 loss scale continues from the checkpoint's 65536 (its scaler's state is "
                     "resumed, as Megatron's is): precision.initial_loss_scale=1024 is not applied (65536 when "
                     "saved)\n") == 1
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["loss_scale"] for r in records] == [2.0 ** 16] * 3


def _scaler_note(saved: dict, now: dict, state: dict) -> tuple[list, DynamicLossScaler]:
    """(loss_scaler_changes' notes, the scaler a resume builds: DynamicLossScaler(now) given `state`) of a checkpoint
    saved under PrecisionConfig(**saved) with scaler state `state`, resumed under PrecisionConfig(**now)."""
    import dataclasses
    from megatron_mini.checkpoint import loss_scaler_changes
    meta = {"config": {"precision": json.loads(json.dumps(dataclasses.asdict(PrecisionConfig(**saved))))},
            "optimizer": {"step_count": 7, "scaler": state}}
    resumed = DynamicLossScaler(PrecisionConfig(**now))
    resumed.load_state_dict(json.loads(json.dumps(state)))
    return loss_scaler_changes(meta, TrainConfig(precision=PrecisionConfig(**now))), resumed


def test_the_loss_scaler_note_gives_the_counters_the_resumed_scaler_has():
    """A lower loss_scale_hysteresis caps the saved hysteresis_left (DynamicLossScaler.load_state_dict): the note's
    counters are the resumed scaler's, not the checkpoint's raw ones."""
    state = {"scale": 256.0, "clean_steps": 5, "hysteresis_left": 3, "skips_at_min": 0, "skipped_steps": 1}
    (note,), resumed = _scaler_note({"dtype": "fp16", "loss_scale_hysteresis": 4},
                                    {"dtype": "fp16", "loss_scale_hysteresis": 2}, state)
    assert resumed.hysteresis_left == 2
    assert note.endswith(f"precision.loss_scale_hysteresis: 4 -> 2 acts from here on, on its counters (clean_steps "
                         f"{resumed.clean_steps}, hysteresis_left {resumed.hysteresis_left})"), note


def test_the_loss_scaler_note_gives_values_as_typed():
    """The note's numbers are exact, as a command line gives them (:g's 6 digits wrote a scale of 2^20 as 1.04858e+06,
    and a growth_interval of 1000000 -> 1000001 as 1e+06 -> 1e+06: no change)."""
    state = {"scale": 2.0 ** 20, "clean_steps": 5, "hysteresis_left": 2, "skips_at_min": 0, "skipped_steps": 1}
    (note,), resumed = _scaler_note({"dtype": "fp16", "loss_scale_growth_interval": 1000000},
                                    {"dtype": "fp16", "loss_scale_growth_interval": 1000001,
                                     "initial_loss_scale": 2.0 ** 24}, state)
    assert resumed.scale == 1048576
    assert note == ("the fp16 loss scale continues from the checkpoint's 1048576 (its scaler's state is resumed, as "
                    "Megatron's is): precision.initial_loss_scale=16777216 is not applied (65536 when saved); "
                    "precision.loss_scale_growth_interval: 1000000 -> 1000001 acts from here on, on its counters "
                    "(clean_steps 5, hysteresis_left 2)"), note
