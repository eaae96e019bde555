"""Batch-size rampup (rampup_batch_size = [start, increment, samples]): the global batch of each step, the run it
trains (the same as a chain of fixed-batch runs, and on every layout), its resume, and its refusals."""
import json
import re
from fractions import Fraction

import pytest
import torch

from harness import assert_same_training, final_weights, small_config, train_on_a_fake_clock, train_on_ranks
from megatron_mini.config import ConfigError, TrainConfig, check_rampup_layout, validate


def _by_definition(consumed: int, gbs: int, start: int, increment: int, samples: int) -> int:
    """Megatron's ramp as it states it: n = (gbs - start) / increment increments, the size start + k increment for
    the samples [k samples / n, (k + 1) samples / n), gbs from `samples` on (exact fractions, not floats)."""
    n = (gbs - start) // increment
    for k in range(n):
        if consumed < Fraction((k + 1) * samples, n):
            return start + k * increment
    return gbs


@pytest.mark.parametrize("gbs, ramp", [(32, [8, 8, 100]), (96, [16, 16, 999]), (24, [4, 20, 7]), (64, [64, 8, 50]),
                                       (40, [8, 8, 0]), (30, [3, 3, 1001])])
def test_the_ramp_is_megatrons(gbs, ramp):
    cfg = TrainConfig(gbs=gbs, rampup_batch_size=ramp)
    assert [cfg.global_batch_size(c) for c in range(2 * ramp[2] + 3)] == \
        [_by_definition(c, gbs, *ramp) for c in range(2 * ramp[2] + 3)]
    for first in range(0, ramp[2] + 2, 7):      # the steps from any sample on (a resume may start anywhere)
        sizes, consumed = [], first
        while (size := _by_definition(consumed, gbs, *ramp)) < gbs:
            sizes.append(size)
            consumed += size
        assert [size for size, steps in cfg.ramp(first) for _ in range(steps)] == sizes
        assert [cfg.consumed_after(first, k) for k in range(len(sizes) + 3)] == \
            [first + sum(sizes[:k]) + max(k - len(sizes), 0) * gbs for k in range(len(sizes) + 3)]


def test_a_ramp_by_hand():
    """gbs 32 from 8 by 8 over 100 samples: 3 increments of 100/3 samples each; step 6 starts at sample 40 (past
    33.3: 16), step 8 at 72 (past 66.7: 24), step 10 at 120 (past 100: 32)."""
    cfg = TrainConfig(gbs=32, rampup_batch_size=[8, 8, 100])
    assert cfg.ramp(0) == [(8, 5), (16, 2), (24, 2)]
    assert cfg.ramp(48) == [(16, 2), (24, 1)]     # from sample 48: steps at 48 and 64 (< 66.7), at 80 (< 100)
    assert TrainConfig(gbs=32).ramp(0) == [] and TrainConfig(gbs=32).global_batch_size(0) == 32


RAMP = dict(gbs=24, rampup_batch_size=[8, 8, 40], steps=8)    # 16 from sample 20, 24 from 40
RAMP_SIZES = [8, 8, 8, 16, 24, 24, 24, 24]


def _ramped(small_data, run_dir, **overrides):
    # the lr schedule counts steps: decay_steps pins it, so that runs of fewer steps take the same lrs
    return small_config(small_data, run_dir, **{**RAMP, "optimizer.decay_steps": RAMP["steps"], **overrides})


@pytest.fixture(scope="module")
def ramped(small_data, tmp_path_factory):
    """The ramped run on one process, eval and metrics on."""
    cfg = _ramped(small_data, tmp_path_factory.mktemp("ramped"), eval_interval=4, eval_iters=1, log_interval=1)
    return cfg, train_on_ranks(1, cfg)


def test_a_ramped_run_is_the_chain_of_fixed_batch_runs(small_data, ramped, tmp_path):
    """The ramped run equals, bitwise, runs of a fixed gbs each resuming the last: 3 steps of 8, 1 of 16, 4 of 24
    (the data order is one global sample order, so each step reads the samples after the last's). Its metrics
    carry each step's gbs and the samples consumed, its evaluations read gbs = 24 samples throughout, and its
    tokens/s counts the tokens the steps held."""
    cfg, history = ramped
    chain, losses = None, []
    for gbs, steps in ((8, 3), (16, 4), (24, 8)):
        chain = train_on_ranks(1, small_config(small_data, tmp_path, gbs=gbs, steps=steps, resume="auto",
                                               eval_interval=4, eval_iters=1, **{"optimizer.decay_steps": 8}))
        losses += chain["loss"]
    assert history["loss"] == losses
    assert history["val_loss"][-1] == chain["val_loss"][-1]          # step 8's, on 24 validation samples
    fresh = train_on_ranks(1, small_config(small_data, tmp_path / "fresh", gbs=24, steps=1, eval_interval=4,
                                           eval_iters=1))
    assert history["val_loss"][0] == fresh["val_loss"][0]            # step 0's too (the ramp's batch is then 8)
    a, b = final_weights(history), final_weights(chain)
    assert all(torch.equal(a[k], b[k]) for k in a)
    lines = [json.loads(x) for x in open(f"{cfg.run_dir}/metrics.jsonl")]
    steps = [x for x in lines if "loss" in x]
    assert [x["gbs"] for x in steps] == RAMP_SIZES
    assert [x["consumed_samples"] for x in steps] == [sum(RAMP_SIZES[:k + 1]) for k in range(8)]
    s = history["summary"]
    assert s["tokens_per_s"] == pytest.approx(sum(RAMP_SIZES) * cfg.model.seq_len / s["elapsed_s"], rel=1e-9)
    log = open(f"{cfg.run_dir}/logs/rank0000.log").read()
    assert "rampup_batch_size=[8, 8, 40]: step 1 takes a global batch of 8, growing by 8 up to gbs 24 from " \
           "step 5 on (sample 40)" in log
    assert "| lr 4.00e-04 | gbs 8 |" in log      # (step 1 of the 5-step warmup to 2e-3)


def test_a_ramped_run_resumes_in_another_layout(small_data, ramped, tmp_path):
    """Checkpoints of steps 3 (mid-ramp: 24 samples consumed, the next batch 16) and 4 (past it: 40, then 24). From
    step 3 at dp = 2 the ramp goes on from the samples consumed, and the run ends with the weights of the one never
    stopped; at dp = 3 (mbs x dp = 6) its batch of 16 would not split, refused before training; from step 4 at dp = 3
    only gbs is left, which does."""
    ref = ramped[1]
    first = train_on_ranks(1, _ramped(small_data, tmp_path / "first", steps=4, save_interval=1, keep_checkpoints=4))
    assert first["loss"] == ref["loss"][:4]
    ckpt = tmp_path / "first" / "checkpoints"
    for step, world in ((3, 2), (4, 3)):
        resume = str(ckpt / f"step_{step:06d}")
        rest = train_on_ranks(world, _ramped(small_data, tmp_path / f"from{step}", resume=resume))
        assert torch.tensor(rest["loss"]).allclose(torch.tensor(ref["loss"][step:]), rtol=1e-5, atol=0)
        a, b = final_weights(ref), final_weights(rest)
        assert all((a[k] - b[k]).abs().max() <= 1e-5 for k in a)
    assert "rampup_batch_size=[8, 8, 40]: step 4 takes a global batch of 16, growing by 8 up to gbs 24 from step 5 " \
           "on (sample 40)" in (tmp_path / "from3" / "logs" / "rank0000.log").read_text()
    with pytest.raises(RuntimeError, match=r"rampup_batch_size=\[8, 8, 40\]: its global batch of 16 \(from sample 24, "
                                           r"where the run resumes\) is not divisible by mbs x dp = 2 x 3 = 6"):
        train_on_ranks(3, _ramped(small_data, tmp_path / "refused", resume=str(ckpt / "step_000003")))
    # with no step left to train, the start at dp = 3 finds nothing to do, and is not refused over the ramp
    done = train_on_ranks(3, _ramped(small_data, tmp_path / "done", steps=3, resume=str(ckpt / "step_000003")))
    assert done["checkpoint"] == str(ckpt / "step_000003") and done["loss"] == []


def test_step_lines_count_each_steps_tokens(small_data, tmp_path):
    """On a clock where a step takes 1 s but the first 60 s (a GPU's compilation): each step's tokens/s is its own
    batch's tokens, and the ETA after step k > 1 is the time per sample since the first step times the samples still
    to train (after the first step alone, that step's)."""
    from megatron_mini.logger import format_duration
    from ranks import spawn

    cfg = _ramped(small_data, tmp_path, log_interval=1)
    spawn(1, train_on_a_fake_clock, cfg, 60.0, init_group=False)
    rates = [r["tokens_per_s"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())]
    assert rates == [size * cfg.model.seq_len / (60.0 if k == 0 else 1.0) for k, size in enumerate(RAMP_SIZES)]
    etas = re.findall(r"\| ETA (\S+)", (tmp_path / "logs" / "rank0000.log").read_text())
    done, total = [sum(RAMP_SIZES[:k]) for k in range(1, 9)], sum(RAMP_SIZES)
    first = done[0]
    assert etas == [format_duration(60.0 / first * (total - first))] + [
        format_duration((k - 1) / (d - first) * (total - d)) for k, d in enumerate(done[1:], 2)]


def test_a_ramp_trains_the_same_model_on_every_layout(small_data, tmp_path):
    """Interleaved 1F1B at pp = 2 x vpp = 2, dp = 2, ZeRO-1: 2, 4 then 6 microbatches a rank as the global batch
    grows from 8 to 24 (each count its own schedule and DP buckets' last backward), the same model as one process,
    with dropout too (a mask is keyed by its microbatch's first sample, of the step's own batch on each DP rank)."""
    dropout = {"model.dropout": 0.1}
    one = train_on_ranks(1, _ramped(small_data, tmp_path / "one", **dropout))
    assert_same_training(one, train_on_ranks(4, _ramped(small_data, tmp_path / "four", pp=2, vpp=2, zero=1,
                                                        **dropout)))


@pytest.mark.parametrize("ramp, world, overrides, error", [
    ([8, 8], 1, {}, r"rampup_batch_size=\[8, 8\] must be \[start, increment, samples\]"),
    ([0, 8, 100], 1, {}, r"start and increment must be >= 1, samples >= 0"),
    ([8, 0, 100], 1, {}, r"start and increment must be >= 1, samples >= 0"),
    ([8, 8, -1], 1, {}, r"start and increment must be >= 1, samples >= 0"),
    ([40, 8, 100], 1, {}, r"starts at 40 samples, above gbs=32: .* start it at 32 or less"),
    ([8, 10, 100], 1, {}, r"from start=8 the increments of 10 miss gbs=32 \(gbs - start = 24 is no multiple of 10\); "
                          r"use an increment that divides it, e.g. 8\."),      # (whole microbatches of mbs 4)
    ([8, 5, 100], 1, {}, r"the increments of 5 miss gbs=32 .* e.g. 4\."),                 # (not 1: mbs 4)
    ([8, 5, 100], 1, {"mbs": 8}, r"the increments of 5 miss gbs=32 .* e.g. 8\."),         # (mbs, above 5)
    ([6, 5, 100], 1, {}, r"the increments of 5 miss gbs=32 .* e.g. 1\."),       # (the start is not whole: the gcd)
    ([8, 10**10, 100], 1, {}, r"the increments of 10000000000 miss gbs=32 .* e.g. 24\."),  # (at once)
    ([4, 4, 100], 2, {}, r"its global batch of 4 is not divisible by mbs x dp = 4 x 2 = 8, .* use a start and an "
                         r"increment that are multiples of 8\.$"),
    ([8, 4, 100], 2, {}, r"its global batch of 12 is not divisible by mbs x dp = 4 x 2 = 8"),
    ([8, 8, 100], 4, dict(pp=2, vpp=2), r"its first step has 1 microbatch: Interleaved 1F1B .* For the ramp, "
                                         r"start it at 16 or more\.$"),
])
def test_a_ramp_that_cannot_run_is_refused(ramp, world, overrides, error):
    cfg = TrainConfig(gbs=32, rampup_batch_size=ramp, **overrides)
    with pytest.raises(ConfigError, match=error):
        validate(cfg, world)


def test_the_increment_a_ramp_refusal_gives_runs():
    """The increment the refusal of one that misses gbs gives as its example is accepted at dp = 1 (with mbs 4, the
    example was the gcd of the increment and gbs - start, 1, whose global batches are no whole microbatches)."""
    for start, increment, gbs in ((8, 5, 32), (8, 10, 32), (4, 7, 64), (12, 3, 32), (8, 10**10, 32)):
        with pytest.raises(ConfigError) as caught:
            validate(TrainConfig(gbs=gbs, rampup_batch_size=[start, increment, 100]), 1)
        example = int(re.search(r"e\.g\. (\d+)\.$", str(caught.value)).group(1))
        assert validate(TrainConfig(gbs=gbs, rampup_batch_size=[start, example, 100]), 1) == 1, (start, example)


def test_a_ramp_that_can_run_is_accepted():
    """A ramp already at gbs needs no fitting increment; one of no samples is gbs from the first step."""
    assert validate(TrainConfig(gbs=32, rampup_batch_size=[32, 5, 100]), 1) == 1
    assert validate(TrainConfig(gbs=32, rampup_batch_size=[8, 8, 100], pp=2, vpp=2), 2) == 1
    assert TrainConfig(gbs=32, rampup_batch_size=[8, 8, 0]).ramp(0) == []
    assert validate(TrainConfig(gbs=32, rampup_batch_size=[8, 8, 0]), 1) == 1
    # batches of 8 and 16 do not split over mbs 2 x dp 3, gbs 24 does: a run that resumes past the ramp may use it
    cfg = TrainConfig(gbs=24, mbs=2, rampup_batch_size=[8, 8, 40])
    assert validate(cfg, 3, consumed_samples=40) == validate(cfg, 3, consumed_samples=None) == 3
    with pytest.raises(ConfigError, match="its global batch of 8 is not divisible by mbs x dp = 2 x 3 = 6"):
        validate(cfg, 3)
    # only the batches of the steps to run: from sample 24 the next is 16, then 24 from sample 40
    check_rampup_layout(cfg, 3, 24, 0)
    with pytest.raises(ConfigError, match="its global batch of 16 .* mbs x dp = 2 x 3 = 6"):
        check_rampup_layout(cfg, 3, 24, 1)


def test_the_memory_report_plans_the_ramps_first_step(small_data, tmp_path):
    """The start-up memory report measures the first step: at pp = 2 under 1F1B the first stage holds
    min(pp, microbatches) microbatches' activations, 1 at the ramp's first step (gbs 2), 2 at gbs 8. The plan is
    of the step measured, within 10% on both ranks, where the full batch's is near twice the first rank's."""
    from megatron_mini.plan_meta import planned_memory

    cfg = small_config(small_data, tmp_path, pp=2, gbs=8, steps=1, memory_plan=True, rampup_batch_size=[2, 2, 100])
    history = train_on_ranks(2, cfg)
    for r in history["memory"]:
        assert r["planned"]["activations"] == pytest.approx(r["measured"]["activations"], rel=0.1), r
    full = planned_memory(small_config(small_data, tmp_path, pp=2, gbs=8), 1)[0]["activations"]
    assert full > 1.8 * history["memory"][0]["measured"]["activations"]
    assert "(planned | measured) (a rampup_batch_size step of 2 samples: the activations of gbs 8 may be more; " \
        "tools/plan.py plans them):" in (tmp_path / "logs" / "rank0000.log").read_text()


def test_bloom_ramp_is_one_pair_per_size():
    """BLOOM-176B's ramp (192 by 16 to 2048 over 9,765,625 samples): 116 sizes, 12,658 steps walked one by one
    here; ramp() gives a pair per size, so a ramp of 10^12 samples from 1 by 1 costs 1023 pairs, not ~10^10 steps."""
    cfg = TrainConfig(gbs=2048, rampup_batch_size=[192, 16, 9_765_625])
    consumed, walked = 0, []
    while (size := cfg.global_batch_size(consumed)) < cfg.gbs:
        walked.append(size)
        consumed += size
    assert [size for size, steps in cfg.ramp(0) for _ in range(steps)] == walked and len(walked) == 12_658
    assert len(cfg.ramp(0)) == 116
    assert len(TrainConfig(gbs=1024, rampup_batch_size=[1, 1, 10**12]).ramp(0)) == 1023


def test_the_memory_report_of_a_resume_plans_the_step_it_measures():
    """A resume mid-ramp measures its first step, of the ramp's batch at the samples consumed: that is planned."""
    import logging
    import types
    from unittest import mock

    from megatron_mini.memory_report import MemoryReport

    cfg = TrainConfig(gbs=32, rampup_batch_size=[8, 8, 100])
    trainer = types.SimpleNamespace(mesh=types.SimpleNamespace(rank=0, dp=1), cfg=cfg, chunks=[], consumed_samples=40,
                                    device=torch.device("cpu"))
    with mock.patch("megatron_mini.plan_meta.planned_memory", return_value=None) as plan:
        MemoryReport(trainer, logging.getLogger("memory-test"), plan=True)
    planned = plan.call_args.args[0]
    assert (planned.gbs, planned.rampup_batch_size) == (16, None)


def test_the_ramps_note_says_when_it_outlasts_the_run():
    from megatron_mini.training import rampup_note

    cfg = TrainConfig(gbs=32, rampup_batch_size=[8, 8, 100], steps=4)
    assert rampup_note(cfg, 0, 0).endswith("from step 10 on (sample 120), past steps=4")
    assert rampup_note(TrainConfig(gbs=32), 0, 0) is None and rampup_note(cfg, 9, 120) is None
