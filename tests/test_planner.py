"""The layout planner against the real thing: on a grid of small layouts of the test model, what the
planner predicts from meta-device models equals what one training step of the real ranks shows.

- weights, fp32 main grads and optimizer state: equal to Optimizer.memory_bytes() of the real rank, which is
  the analytic count of its buffers' elements (bytes per element by dtype, Adam's state / dp with ZeRO-1);
- communication: equal to the real rank's ledger of one step, call for call and byte for byte, and so
  are the collectives run beside a GEMM, with that GEMM's FLOPs;
- activations: within 10% of the saved-tensor meter over the real step (the same meter, run on real
  tensors, holding every microbatch the schedule keeps in flight);
- pipeline time: equal to the schedule simulator's for any microbatch count, with equal or uneven stages.
"""

import contextlib
import csv
import dataclasses
import itertools
import multiprocessing
import os
import random
import sys
import threading
import warnings
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from harness import make_trainer, needs_triton, small_config, train_on_ranks
from megatron_mini.comm import Ledger
from megatron_mini.config import ConfigError, ModelConfig, TrainConfig, validate
from megatron_mini.mesh import ParallelMesh
from megatron_mini.meter import SavedTensorMeter
from megatron_mini.model import ParallelContext, build_chunks
from megatron_mini.pipeline import partition_for
from megatron_mini import plan_meta
from megatron_mini.plan_meta import META, Planner, _fused_on_meta
from megatron_mini.rank import DTYPES
from megatron_mini.planner import (GiB, ClusterConfig, Estimate, _link_gbps, estimate, layouts, model_bytes, plan,
                                   start_method, step_breakdown)
from megatron_mini.rng import RNGTracker
from megatron_mini.schedules import simulate
from megatron_mini.tensor_parallel import GEMM_INTO_FP32, gemm_into_fp32
from ranks import spawn

NODE = "tp not dividing the GPUs of a node (TP across nodes)"

GRID = {                                   # name: (world size, layout)
    "tp2": (2, dict(tp=2)),
    "tp2-sp-full": (2, dict(tp=2, sp=True, recompute="full")),
    "pp2": (2, dict(pp=2)),
    "pp2-vpp2-own": (4, dict(pp=2, vpp=2, embedding_stage="own")),
    "dp2-zero-selective": (2, dict(zero=1, recompute="selective")),
    "dp3-zero-small-buckets": (3, dict(zero=1, ddp_bucket_numel=3000, gbs=12)),   # many buckets, padded to 3
    "tp2-pp2-sp-bf16": (4, dict(tp=2, pp=2, sp=True, **{"precision.dtype": "bf16"})),
    "pp2-dropout": (2, dict(pp=2, **{"model.dropout": 0.1})),      # on the CPU: SDPA's math path
    # the replicated gradients averaged over TP; 2 microbatches, not 8 (the interpreted kernels: 16 s -> 7 s here)
    "tp2-layer_norm": (2, dict(tp=2, kernels="layer_norm", gbs=4)),
}


def _one_real_step(cfg):
    """This rank's memory report, the ledger of one training step and its activation peak."""
    trainer = make_trainer(cfg)
    meter = SavedTensorMeter(exclude=[p for chunk in trainer.chunks for p in chunk.parameters()])
    trainer.mesh.ledger.reset()
    with meter.hooks():
        trainer.train_step()
    held = dict(numel=sum(p.numel() for buf in trainer.buffers for p in buf.names),
                padded=sum(buf.params_flat.numel() for buf in trainer.buffers),
                buckets=sum(len(buf.buckets) for buf in trainer.buffers))
    mesh = trainer.mesh
    return mesh.pp_rank, mesh.tp_rank, mesh.dp_rank, trainer.optimizer.memory_bytes(), mesh.ledger.summary(), \
        mesh.ledger.overlaps(), meter.peak, held


def _state_bytes(cfg, dp: int, held: dict) -> dict:
    """The analytic count of a rank's state, not Optimizer.memory_bytes (which the plan runs too): every element of
    its buffers (its parameters, each bucket padded to a multiple of dp) a weight in the model's dtype and an fp32
    main grad; Adam's two fp32 moments and, with 16-bit weights, an fp32 master, 1/dp of them with ZeRO-1."""
    assert held["numel"] <= held["padded"] <= held["numel"] + (dp - 1) * held["buckets"], held
    weight, n = DTYPES[cfg.precision.dtype].itemsize, held["padded"]
    return {"weights": n * weight, "grads": n * 4, "optimizer": n * (8 + 4 * (weight < 4)) // (dp if cfg.zero else 1)}


@pytest.fixture(scope="module")
def planner():
    return Planner()


@pytest.mark.parametrize("name", [pytest.param(name, marks=needs_triton if "kernels" in layout else ())
                                  for name, (_, layout) in GRID.items()])
def test_prediction_matches_a_real_step(name, small_data, tmp_path, planner):
    world, layout = GRID[name]
    cfg = small_config(small_data, tmp_path, **layout)
    dp = world // (cfg.tp * cfg.pp)
    beside_gemms = False
    for pp_rank, tp_rank, dp_rank, memory, ledger, overlaps, activations, held in spawn(world, _one_real_step, cfg):
        assert memory == _state_bytes(cfg, dp, held), (pp_rank, tp_rank, dp_rank, memory, held)
        if tp_rank or dp_rank:
            continue                                # the planner speaks for TP rank 0, DP rank 0 of a stage
        plan = planner.measure_rank(cfg, dp, pp_rank)
        assert {k: plan.memory[k] for k in memory} == memory, (pp_rank, plan.memory, memory)
        assert plan.ledger == ledger, (pp_rank, plan.ledger, ledger)
        assert plan.overlaps == overlaps, (pp_rank, plan.overlaps, overlaps)
        beside_gemms |= bool(overlaps)
        assert abs(plan.memory["activations"] - activations) <= 0.1 * activations, \
            (pp_rank, plan.memory["activations"], activations)
    assert beside_gemms == (cfg.tp > 1)               # a column-parallel linear's backward overlaps its collectives


def test_a_planner_lays_out_each_configs_buckets(small_data, tmp_path):
    """A Planner that measured a rank in the default buckets measures it in another ddp_bucket_numel as a new
    Planner does (its cache of ranks tells them apart): the DP reduction and ZeRO-1 gather, once per bucket."""
    one = small_config(small_data, tmp_path, zero=1)
    small = dataclasses.replace(one, ddp_bucket_numel=3000)
    planner = Planner()
    _, in_one, _ = planner.rank_state(one, 2, 0)
    state = planner.rank_state(small, 2, 0)
    assert state == Planner().rank_state(small, 2, 0)
    assert in_one[("dp", "reduce_scatter")][0] == 1 and state[1][("dp", "reduce_scatter")][0] > 10


def test_a_planner_builds_each_ranks_chunks_once_with_and_without_zero(small_data, tmp_path):
    """The ranks of a layout measured without ZeRO-1, then with it (layouts() enumerates them so; estimates measures
    each layout's ranks in turn) build each rank's chunks once, and measure what new Planners, building every rank
    anew, do."""
    cfg = small_config(small_data, tmp_path, pp=2)
    ranks = [(dataclasses.replace(cfg, zero=zero), r) for zero in (0, 1) for r in range(cfg.pp)]
    planner = Planner()
    with mock.patch("megatron_mini.rank.build_chunks", wraps=build_chunks) as built:
        states = [planner.rank_state(layout, 2, r) for layout, r in ranks]
    assert built.call_count == cfg.pp
    assert states == [Planner().rank_state(layout, 2, r) for layout, r in ranks]
    assert states[0][0]["optimizer"] == 2 * states[2][0]["optimizer"]        # (ZeRO-1 over dp = 2 laid out anew)


def _equal_stages(pp, vpp, scale):
    """[pp][vpp] forward and backward costs of every chunk alike: a microbatch through a rank costs `scale`."""
    return [[scale / 3 / vpp] * vpp] * pp, [[2 * scale / 3 / vpp] * vpp] * pp


@pytest.mark.parametrize("kind, pp, vpp", [("1f1b", 2, 1), ("1f1b", 4, 1), ("gpipe", 3, 1), ("1f1b", 4, 2),
                                           ("1f1b", 2, 3), ("gpipe", 2, 2)])
@pytest.mark.parametrize("factor", [1, 2, 5, 8])
def test_pipeline_of_equal_stages_is_the_simulators(kind, pp, vpp, factor, planner):
    """With equal stages the planner's pipeline time is the simulator's at m, and so the bubble is the schedule's
    idle/busy ratio: busy x (1 + ratio)."""
    m = pp * factor
    busy = 0.37
    pipeline = max(planner.pipeline_ends(TrainConfig(schedule=kind, pp=pp, vpp=vpp), m,
                                         *_equal_stages(pp, vpp, busy / m)))
    assert pipeline == pytest.approx(busy * (1 + simulate(kind, pp, vpp, m).bubble), rel=1e-12)


@pytest.mark.parametrize("kind, pp, vpp", [("1f1b", 2, 1), ("1f1b", 4, 1), ("gpipe", 3, 1), ("1f1b", 4, 2),
                                           ("1f1b", 2, 3), ("gpipe", 2, 2)])
@pytest.mark.parametrize("factor", [1, 2, 5, 8])
def test_breakdown_of_equal_stages_is_the_analytic_bubble(kind, pp, vpp, factor, planner):
    """Equal stages (each rank the same compute, TP and pipeline sends, DP reduction and embedding-group sums): the
    breakdown's bubble is Megatron's (p - 1) / (m v) of the busy time, compute + tp + pp, exactly, beside the
    rank's own terms, and they add up to the step, the last rank's end + its dp + emb."""
    m = pp * factor
    own = {"compute": 0.30, "tp": 0.05, "pp": 0.02, "dp": 0.04, "emb": 0.01}
    busy = own["compute"] + own["tp"] + own["pp"]
    ends = planner.pipeline_ends(TrainConfig(schedule=kind, pp=pp, vpp=vpp), m, *_equal_stages(pp, vpp, busy / m))
    heaviest, times = step_breakdown(ends, [own] * pp)
    assert times["bubble"] == pytest.approx(busy * (pp - 1) / (m * vpp), rel=1e-12)
    assert {k: times[k] for k in own} == own
    assert sum(times.values()) == pytest.approx(max(ends) + own["dp"] + own["emb"], rel=1e-12)


@pytest.mark.parametrize("kind, pp, vpp, m", [("1f1b", 4, 1, 16), ("gpipe", 3, 2, 7), ("1f1b", 4, 2, 64),
                                              ("1f1b", 6, 3, 30), ("1f1b", 8, 2, 44)])
def test_breakdown_adds_up_at_random_costs(kind, pp, vpp, m):
    """Random [pp][vpp] costs (half of the draws with two heavy ranks of close paces), each rank's busy time m x its
    chunk costs split at random into compute, tp and pp (as estimate builds the costs), random dp and emb: the
    breakdown is the rank with the most work, its terms add up to the step, max over ranks of end + dp + emb, and
    its bubble, step - that work, is no rounding-clamped negative (every rank ends after its busy time)."""
    rng = random.Random(pp * vpp * m)
    cfg = TrainConfig(schedule=kind, pp=pp, vpp=vpp)
    for draw in range(8):
        work = [[rng.uniform(0.2, 1.0) for _ in range(vpp)] for _ in range(pp)]
        if draw % 2:
            work = [[0.5] * vpp for _ in range(pp)]
            i, j = rng.sample(range(pp), 2)
            work[i], work[j] = [1.0] * vpp, [rng.uniform(1.01, 1.1)] * vpp
        ends = Planner().pipeline_ends(cfg, m, [[w / 3 for w in row] for row in work],
                                       [[2 * w / 3 for w in row] for row in work])
        terms = []
        for row in work:
            busy = m * sum(row)
            compute = busy * rng.uniform(0.6, 1.0)
            tp = (busy - compute) * rng.random()
            terms.append({"compute": compute, "tp": tp, "pp": busy - compute - tp, "dp": busy * rng.uniform(0, 0.05),
                          "emb": busy * rng.uniform(0, 0.01)})
        heaviest, times = step_breakdown(ends, terms)
        step = max(end + t["dp"] + t["emb"] for end, t in zip(ends, terms))
        work_h = sum(terms[heaviest].values())
        assert work_h == max(sum(t.values()) for t in terms)
        assert {k: times[k] for k in terms[heaviest]} == terms[heaviest]
        assert sum(times.values()) == pytest.approx(step, rel=1e-12), (draw, work)
        assert step - work_h >= -1e-12 * step and times["bubble"] == pytest.approx(step - work_h, abs=1e-12 * step)


def test_breakdown_of_own_stages_is_the_heaviest_ranks():
    """pp=4 under 1F1B with an embedding stage and a head stage of their own: works per microbatch W = 0.02, 1, 1,
    0.3 (a third forward, two thirds backward), m = 8; every rank a DP reduction of 0.1, the first and the last an
    embedding-group sum of 0.05. By hand: the second block stage starts after the fill, the embedding stage's and
    the first block stage's first forwards (f0 + f1), and runs its 8 microbatches back to back (the head stage's
    round trip, 0.3, fits in its forward, 1/3: it never waits for a gradient); then the drain, the first block
    stage's and the embedding stage's last backwards (b1 + b0): rank 0 ends last, at W0 + W1 + m W2 = 9.02, and
    the step is 9.02 + 0.1 + 0.05. The breakdown is the first block stage's, the heaviest (8 + 0.1 of its own):
    a bubble of 9.17 - 8.1 = 1.07, 13% of its busy time, where equal stages idle (p - 1) / m = 37.5%; the rank
    that ends the step, the embedding stage, is busy for 0.16 only."""
    works, m = [0.02, 1.0, 1.0, 0.3], 8
    ends = Planner().pipeline_ends(TrainConfig(pp=4), m, [[w / 3] for w in works], [[2 * w / 3] for w in works])
    assert max(ends) == ends[0] == pytest.approx(0.02 + 1.0 + 8 * 1.0, rel=1e-12)
    terms = [{"compute": m * w, "tp": 0.0, "pp": 0.0, "dp": 0.1, "emb": 0.05 * (r in (0, 3))}
             for r, w in enumerate(works)]
    heaviest, times = step_breakdown(ends, terms)
    assert heaviest == 1 and {k: times[k] for k in terms[1]} == terms[1]
    assert times["bubble"] == pytest.approx(9.02 + 0.15 - 8.1, rel=1e-12)
    assert sum(times.values()) == pytest.approx(9.17, rel=1e-12)
    assert times["bubble"] / times["compute"] < (4 - 1) / m


@pytest.mark.parametrize("kind,m", [(kind, m) for kind in ("gpipe", "1f1b") for m in (2, 3, 5, 9, 10, 11, 13, 17, 23)
                                    if kind == "gpipe" or m >= 4])
def test_pipeline_with_vpp_at_any_remainder(kind, m, planner):
    """With vpp > 1 both schedules take m that are not multiples of pp (interleaving from m = pp): the planner's
    pipeline time is the simulator's at every remainder, and below pp."""
    pipeline = max(planner.pipeline_ends(TrainConfig(schedule=kind, pp=4, vpp=2), m, *_equal_stages(4, 2, 1.0)))
    assert pipeline == pytest.approx(m * (1 + simulate(kind, 4, 2, m).bubble), rel=1e-12)


UNEVEN = {                   # per microbatch, [pp][vpp] work of each chunk (a third forward, two thirds backward)
    "own": [[0.02], [1.0], [1.0], [0.3]],                       # embedding and head stages of their own
    "heavy head": [[1.0], [1.0], [1.0], [1.4]],
    "first blocks": [[0.6], [1.0], [1.0], [1.0]],               # pipeline_first_blocks: fewer blocks first
    "heavy first and head": [[1.4], [1.0], [1.0], [1.3]],       # (two paces: the heavier takes over late)
    "own vpp=2": [[0.02, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 0.3]],
    "heavy head vpp=2": [[1.0, 1.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.4]],
    "two paces vpp=2": [[1.05, 1.05], [0.5, 0.5], [1.0, 1.0], [0.5, 0.5]],   # (test_two_close_paces...)
}


@pytest.mark.parametrize("name", UNEVEN)
@pytest.mark.parametrize("kind, m", [("1f1b", 4), ("1f1b", 16), ("1f1b", 22), ("gpipe", 16), ("1f1b", 40)])
def test_pipeline_of_uneven_stages_is_the_simulators_at_m(name, kind, m):
    """Uneven stages: each rank's end is the simulator's at m itself, every microbatch simulated, and no earlier than
    the rank's own busy time (it computes one thing at a time)."""
    work = UNEVEN[name]
    forward, backward = [[w / 3 for w in row] for row in work], [[2 * w / 3 for w in row] for row in work]
    cfg = TrainConfig(schedule=kind, pp=4, vpp=len(work[0]))
    ends = Planner().pipeline_ends(cfg, m, forward, backward)
    assert ends == pytest.approx(simulate(kind, 4, cfg.vpp, m, forward, backward).ends, rel=1e-12)
    assert all(end >= m * sum(row) * (1 - 1e-12) for end, row in zip(ends, work))


def test_two_close_paces_are_simulated_to_the_end():
    """pp=4, vpp=2 with two heavy ranks of close paces, rank 0 (2.1 per microbatch) and rank 2 (2.0), the others
    light: rank 2, which starts later, sets the pace of the first groups of microbatches (8 to 12: + 2.0 each), rank 0
    from 16 on (+ 2.1 each, its idle time then fixed). The planner's ends at m = 64 are the simulator's, 48 x 2.1
    after those at 16, and no earlier than rank 0's busy time, 64 x 2.1 (a line through 8 and 12 microbatches was
    3.7% short, 4 below it)."""
    work = UNEVEN["two paces vpp=2"]
    forward, backward = [[w / 3 for w in row] for row in work], [[2 * w / 3 for w in row] for row in work]
    ends = {m: Planner().pipeline_ends(TrainConfig(pp=4, vpp=2), m, forward, backward) for m in (16, 64)}
    assert ends[64] == pytest.approx(simulate("1f1b", 4, 2, 64, forward, backward).ends, rel=1e-12)
    assert [b - a for a, b in zip(ends[16], ends[64])] == pytest.approx([48 * 2.1] * 4, rel=1e-12)
    assert max(ends[64]) > 64 * 2.1


def test_pipelines_timed_together_are_each_timed_alone():
    """Planner.time_pipelines (planner.estimates: a run of layouts of one schedule) times the pipelines of a schedule
    at all their costs in one pass over its graph, several schedules in one call: each pipeline's ends are the
    simulator's at its costs alone, to the bit, whichever table came first (a repeated one timed once)."""
    rng = random.Random(0)
    pipelines = []
    for kind, pp, vpp, m in [("1f1b", 4, 2, 16), ("gpipe", 3, 1, 7), ("1f1b", 4, 2, 16), ("1f1b", 4, 1, 9)]:
        for _ in range(3):
            work = [[rng.uniform(0.1, 1.0) for _ in range(vpp)] for _ in range(pp)]
            pipelines.append((TrainConfig(schedule=kind, pp=pp, vpp=vpp), m, [[w / 3 for w in row] for row in work],
                              [[2 * w / 3 for w in row] for row in work]))
    pipelines.append(pipelines[1])
    planner = Planner()
    planner.time_pipelines(pipelines)
    for cfg, m, forward, backward in pipelines:
        assert planner.pipeline_ends(cfg, m, forward, backward) == \
            simulate(cfg.schedule, cfg.pp, cfg.vpp, m, forward, backward).ends


def test_own_stages_bubble_is_their_fill_and_drain(small_data, tmp_path, planner):
    """pp=4 with the embedding and the head as stages of their own: the two block stages, equal and the heaviest,
    set the pace; the second runs its m microbatches back to back after the fill (the first forwards of the
    embedding stage and of the first block stage) and before the drain (their last backwards), the head stage's
    round trip fitting in a block stage's forward: the first rank ends last, at W0 + W1 + m W2 for stage works W
    per microbatch (each rank's compute + pipeline sends, at tp = 1, over m), by hand, then its embedding-group
    sums. The breakdown is the first block stage's (m W1 of work and its own sums): a bubble of about (pp - 3) / m,
    not the (pp - 1) / m of equal stages."""
    from megatron_mini.hardware import GPUS, math_dtype
    from megatron_mini.planner import _comm_s
    cfg = small_config(small_data, tmp_path, pp=4, embedding_stage="own", gbs=16, mbs=2)
    cluster = ClusterConfig(gpus=4, gpu="h100-80gb", intra_node_gbps=3000.0)      # (sends well below compute)
    e = estimate(planner, cfg, cluster)
    m = cfg.num_microbatches(1)
    peak = GPUS["h100-80gb"].tflops[math_dtype(cfg.precision.dtype, cfg.precision.tf32)] * 1e12 * 0.5
    sends = {r.pp_rank: sum(b for (group, _), (_, b) in r.ledger.items() if group == "pp") for r in e.ranks}
    work = {r.pp_rank: (r.flops / peak + sends[r.pp_rank] / (cluster.intra_node_gbps * 1e9) / 2) / m for r in e.ranks}
    W = [work[r] for r in planner.stage_speakers(cfg, 1)]
    assert W[1] == W[2] == max(W) and 3 * W[3] < W[2] and W[0] < 0.2 * W[2], W
    sums = {r.pp_rank: sum(_comm_s(cfg, cluster, 1, r, peak)[g] for g in ("emb", "mp", "world")) for r in e.ranks}
    assert sums[0] > sums[1] > 0 and e.times["dp"] == 0                # (the first's embedding-group sum; dp = 1)
    assert e.heaviest == 1 and e.times["emb"] == sums[1]
    assert e.times["compute"] + e.times["tp"] + e.times["pp"] == pytest.approx(m * W[1], rel=1e-12)
    assert e.step_s == pytest.approx(W[0] + W[1] + m * W[2] + sums[0], rel=1e-12)
    assert e.bubble == pytest.approx((W[0] + W[1] + sums[0] - sums[1]) / (m * W[1]), rel=1e-12)
    assert e.bubble < 0.5 * (cfg.pp - 1) / m


def test_meter_counts_meta_like_real_tensors():
    """The meter counts a storage once however many views autograd saves, on real and meta tensors."""
    for device in ("cpu", "meta"):
        x = torch.ones(64, 32, device=device, requires_grad=True)
        meter = SavedTensorMeter()
        with meter.hooks():
            y = (x * 2).view(32, 64)
            z = (y * y).sum()                         # saves y twice (one storage) and nothing else
        assert meter.live == 64 * 32 * 4, device
        del z
        y = None
        assert meter.live == 0, device


def test_allocation_meter_counts_a_product_once():
    """A matmul of a 3-D input allocates its product once (the meter counted it again where aten._unsafe_view, which
    declares no alias, reshaped it: the logits and every linear's output twice), on real and meta tensors."""
    from megatron_mini.meter import AllocationMeter
    for device in ("cpu", "meta"):
        x, w = torch.ones(4, 8, 16, device=device), torch.ones(16, 32, device=device)
        meter = AllocationMeter()
        with meter:
            y = x @ w
        assert meter.peak == meter.live == 4 * 8 * 32 * 4 == y.untyped_storage().nbytes(), device


# ----------------------------------------------------------------------------- the enumeration
def _cluster_config(small_data, tmp_path, gpus: int, **cluster):
    from megatron_mini.planner import PlanConfig

    cfg = small_config(small_data, tmp_path, gbs=64, mbs=1)
    return PlanConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(TrainConfig)},
                      cluster=ClusterConfig(gpus=gpus, **cluster))


def test_every_valid_layout_is_enumerated_once(small_data, tmp_path):
    """Against brute force: every (tp, pp, vpp, embedding_stage, zero, recompute, sp) that validate()
    accepts, with tp inside a node, is in the plan's list once up to embedding stages that split alike."""
    base = _cluster_config(small_data, tmp_path, 16, gpus_per_node=4)
    valid, refused = layouts(base)
    key = lambda c: (c.tp, c.pp, c.vpp, c.zero, c.recompute, c.sp, tuple(partition_for(c)))   # noqa: E731
    listed = [key(c) for c in valid]
    assert len(listed) == len(set(listed))
    accepted = set()
    for tp, pp, vpp, stage, zero, recompute, sp in itertools.product(
            (1, 2, 4, 8, 16), (1, 2, 4, 8, 16), range(1, 9), ("none", "layer", "own"), (0, 1),
            ("none", "selective", "full"), (False, True)):
        cfg = dataclasses.replace(base, tp=tp, pp=pp, vpp=vpp, embedding_stage=stage, zero=zero,
                                  recompute=recompute, sp=sp)
        try:
            dp = validate(cfg, 16)
        except ConfigError:
            continue
        if tp <= 4 and (vpp == 1 or pp > 1) and (zero == 0 or dp > 1) and (not sp or tp > 1):
            accepted.add(key(cfg))
    assert set(listed) == accepted
    assert refused[NODE] == 2 and sum(refused.values()) > 2      # tp = 8, 16


@pytest.fixture(scope="module")
def one_process_plan(small_data, tmp_path_factory):
    """(base, plan(base) in this process) for 32 GPUs: what the workers must plan (whether a GPU is visible only
    chooses how plan() starts its workers)."""
    base = _cluster_config(small_data, tmp_path_factory.mktemp("plan"), 32)
    return base, plan(base, workers=1)


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_workers_plan_what_one_process_plans(one_process_plan, monkeypatch, method):
    """Workers forked, forked by a server or spawned plan bit for bit what one process plans (spawned workers
    hash strings with another seed: no float sum may follow a set's order)."""
    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {method} here")
    if method == "fork" and torch.cuda.is_available():
        pytest.skip("plan() never forks where a GPU is visible (a backward here may have started autograd's threads)")
    monkeypatch.setattr("megatron_mini.planner.start_method", lambda: method)
    base, one = one_process_plan
    with warnings.catch_warnings():    # pytest-xdist's threads: Python 3.12+ warns of fork; plan() would not fork
        warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
        two = plan(base, workers=2)
    assert len(one.estimates) >= 32                       # enough for plan() to use the two workers
    assert [(e.layout_args(), e.dp, e.step_s, e.memory_gib) for e in one.estimates] == \
        [(e.layout_args(), e.dp, e.step_s, e.memory_gib) for e in two.estimates]


@pytest.mark.skipif(sys.platform != "linux", reason="plan() forks on Linux only")
def test_plan_forks_only_a_process_of_one_thread(monkeypatch):
    """A child forked from a process of several threads may hang on a lock another thread held: plan() forks its
    workers only where the process has one thread (the OS's count) and no GPU is visible; else a fork server does."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    alone = mock.patch("os.listdir", lambda path: ["1"] if path == "/proc/self/task" else [])
    with alone:
        assert start_method() == "fork"
    threads = len(os.listdir("/proc/self/task"))
    release = threading.Event()
    waiter = threading.Thread(target=release.wait)
    waiter.start()
    try:
        assert len(os.listdir("/proc/self/task")) == threads + 1 >= 2
        assert start_method() == "forkserver"
    finally:
        release.set()
        waiter.join()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with alone:
        assert start_method() == "forkserver"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def no_proc(path):
        raise FileNotFoundError(2, "No such file or directory", path)
    with mock.patch("os.listdir", no_proc):  # a chroot without /proc: the threads cannot be counted
        assert start_method() == "forkserver"


# ----------------------------------------------------------------------------- BLOOM, the worked example
@pytest.fixture(scope="module")
def bloom():
    from plan import load_config, parse_layout

    base = load_config(["model=bloom-176b", "gbs=2048", "mbs=1", "precision=bf16", "cluster=jean-zay-a100"])
    return base, parse_layout("tp=4,pp=12,zero=1,embedding_stage=layer", base)


def test_bloom_checkpoint_sizes(bloom):
    """BLOOM's training notes: 329 GB of bf16 weights; 2.3 TB with the fp32 weights and optimizer state
    (binary units). The planner's byte counts of the same model, from the optimizer's own allocation."""
    base, _ = bloom
    sizes = model_bytes(base)
    assert sizes["weights"] == pytest.approx(329 * 2**30, rel=0.03)
    assert sizes["weights"] + sizes["optimizer"] == pytest.approx(2.3 * 2**40, rel=0.03)
    assert sizes["weights"] == 2 * base.model.num_params()            # bf16, nothing padded at tp=1


def test_bloom_layout_fits_its_cluster(bloom):
    """tp=4 pp=12 dp=8, ZeRO-1, bf16 on 384 A100-80GB: fits, its largest rank the first or the second stage."""
    base, chosen = bloom
    e = estimate(Planner(), chosen, base.cluster)
    assert e.dp == 8 and e.fits and 30 < e.memory_gib < 80
    assert e.worst.pp_rank in (0, 1)
    assert e.worst.memory["optimizer"] == pytest.approx(12 * e.worst.memory["weights"] / 2 / 8, rel=0.01)


# ----------------------------------------------------------------------------- the command line
def test_plan_command_line(small_data, tmp_path, capsys):
    from plan import TERMS, main

    args = ["model=tiny", "gbs=64", "mbs=1", "cluster.gpus=16", "cluster.gpus_per_node=8"]
    out_csv, out_png = tmp_path / "tables" / "plan.csv", tmp_path / "figures" / "new" / "plan.png"   # created
    assert main(args + ["--layout", "tp=2,pp=2,zero=1", "--csv", str(out_csv), "--plot", str(out_png)]) == 0
    printed = capsys.readouterr().out
    assert "torchrun --nnodes=2 --nproc_per_node=8" in printed and "--layout tp=2,pp=2,zero=1:" in printed
    with open(out_csv) as f:
        header = next(csv.reader(f))
        f.seek(0)
        rows = list(csv.DictReader(f))
    assert len(set(header)) == len(header), header                     # (dp and bubble were there twice)
    assert all(int(r["dp"]) >= 1 and 0 <= float(r["bubble_fraction"]) < 1 for r in rows)
    for r in rows:       # the breakdown is of the heaviest rank, its bubble over its busy time; the terms add up
        busy = sum(float(r[f"{t}_s"]) for t in ("compute", "tp", "pp"))
        assert float(r["bubble_fraction"]) == pytest.approx(float(r["bubble_s"]) / busy, rel=1e-5, abs=1e-9), r
        assert float(r["step_s"]) == pytest.approx(sum(float(r[f"{t}_s"]) for t in TERMS), rel=1e-5), r
    assert len(rows) == int(printed.split(" valid layouts")[0].split()[-1])
    assert out_png.stat().st_size > 10_000
    assert main(args + ["--top", "1"]) == 0
    printed = capsys.readouterr().out
    assert printed.count(": rank ") == 1                                  # the one layout listed, explained once
    # a small model's figures in its own units and digits (they were "0.00B parameters", a step of "0.00" s)
    from megatron_mini.config import ModelConfig
    assert printed.startswith(f"tiny: {ModelConfig().num_params() / 1e6:.2f}M parameters;")
    best = min((r for r in rows if r["fits"] == "True"), key=lambda r: float(r["step_s"]))
    row = printed.split("\n1 ")[1].split("\n")[0].split()
    step = row[[c.startswith("dp=") for c in row].index(True) + 2]       # (row 1's "step s", after dp and memory)
    assert 0 < float(best["step_s"]) < 0.01 and float(step) == float(f"{float(best['step_s']):.2g}")
    assert main(["model=tiny", "gbs=64", "mbs=1", "cluster.gpus=2", "++tp=2", "zero=1", "--top", "1"]) == 0
    assert capsys.readouterr().out.startswith("note: tp=2 zero=1: plan.py ranks every layout, whatever the command "
                                              "line gives its layout keys; --layout tp=2,zero=1 explains that one\n")
    assert main(args + ["--layout", "tp=3"]) == 2
    assert "model.num_heads=4 is not divisible by tp=3" in capsys.readouterr().err
    assert main(args + ["--layout", "tp=4,pp=8"]) == 2
    assert "The layout tp=4 x pp=8 needs at least 32 processes" in capsys.readouterr().err
    assert main(args + ["cluster.gpu=a100"]) == 2                  # not a GPU of hardware.GPUS
    assert main(args + ["cluster.gpus_per_nod=8"]) == 2
    assert "did you mean cluster.gpus_per_node" in capsys.readouterr().err
    assert main(["model=tiny", "gbs=64", "mbs=1", "cluster.gpus=8", "cluster.gpus_per_node=8", "--top", "1"]) == 0
    assert "torchrun --standalone --local-addr=127.0.0.1 --nproc_per_node=8 train.py " in capsys.readouterr().out
    assert main(args + ["cluster=b200"]) == 2                      # a name conf/cluster has no file for
    assert capsys.readouterr().err == ("error: cluster=b200: cluster has no option b200; its options are "
                                       "a100-80gb, h100-80gb, jean-zay-a100\n")
    assert main(args + ["model=true"]) == 2                        # (Hydra failed inside itself: a ValueError)
    assert capsys.readouterr().err.startswith("error: model=true: model is a config group, which takes one name (")
    assert main(args + ["cluster=[1,2]"]) == 2                     # (Hydra failed inside itself: a TypeError)
    assert capsys.readouterr().err == ("error: cluster=[1,2]: cluster is a config group, which takes one name "
                                       "(a100-80gb, h100-80gb, jean-zay-a100)\n")


# ----------------------------------------------------------------------------- train.py's start-up report
def test_training_prints_the_plan_next_to_the_run(small_data, tmp_path):
    """Planned weights, grads and optimizer state equal what every rank holds; planned activations are
    within 10% of the first step's (with dropout too, whose CPU attention saves its [s, s] weights); and
    planning changes nothing in the run."""
    layout = dict(tp=2, pp=2, sp=True, steps=2, **{"model.dropout": 0.1})
    planned = train_on_ranks(4, small_config(small_data, tmp_path / "plan", memory_plan=True, **layout))
    plain = train_on_ranks(4, small_config(small_data, tmp_path / "plain", **layout))
    assert planned["loss"] == plain["loss"] and planned["grad_norm"] == plain["grad_norm"]
    assert [r["rank"] for r in planned["memory"]] == [0, 1, 2, 3]
    for r in planned["memory"]:
        assert {k: r["planned"][k] for k in ("weights", "grads", "optimizer")} == \
            {k: r["measured"][k] for k in ("weights", "grads", "optimizer")}, r
        assert r["planned"]["activations"] == pytest.approx(r["measured"]["activations"], rel=0.1), r
    assert "planned" not in plain["memory"][0] and "activations" not in plain["memory"][0]["measured"]
    assert "memory at the first step's peak, MiB (planned | measured):\n" in \
        (tmp_path / "plan" / "logs" / "rank0000.log").read_text()          # (no rampup_batch_size: no note of it)


def _train_unplanned(cfg):
    """train(cfg) on this rank, rank 0's planner failing (a model it cannot lay out on the meta device)."""
    import os

    from megatron_mini import plan_meta, training

    def fails(*args):
        raise NotImplementedError("no meta kernel for aten::made_up")
    if os.environ["RANK"] == "0":
        plan_meta.planned_memory = fails
    return training.train(cfg)


def test_a_planner_that_fails_leaves_a_warning_and_training_goes_on(small_data, tmp_path):
    """Rank 0 alone plans, between collectives: a planner that fails must not end rank 0 alone while the others
    wait for it in the report's gather (until timeout_s). The report is not worth a run: training goes on, the
    same as without a plan, with one warning saying why there is none."""
    cfg = small_config(small_data, tmp_path / "run", gbs=4, steps=2, memory_plan=True, timeout_s=20)
    histories = spawn(2, _train_unplanned, cfg, init_group=False, timeout=120)
    plain = train_on_ranks(2, small_config(small_data, tmp_path / "plain", gbs=4, steps=2))
    assert histories[0]["loss"] == histories[1]["loss"] == plain["loss"]
    assert "planned" not in histories[0]["memory"][0]
    log = (tmp_path / "run" / "logs" / "rank0000.log").read_text()
    assert log.count("warning: no memory plan, the planner failed (NotImplementedError: no meta kernel for "
                     "aten::made_up); memory_plan=false leaves it out") == 1, log


@pytest.mark.parametrize("tp", [1, 2])
def test_dp_reduction_inside_a_node_waits_for_the_tp_traffic_of_its_window(small_data, tmp_path, planner, tp):
    """The DP reduction hides behind the last microbatch's backward; inside a node that backward's link also
    carries the TP collectives its GEMMs hide, so the DP reduction gets that window less their time. The same
    layout (dp=2) on two clusters whose links run at the same speed, one node of 8 GPUs or nodes of tp GPUs
    (the DP group across nodes): only the DP time differs, by exactly that TP time per microbatch at tp=2
    (the link is slow enough that the reduction outlasts the window either way), and not at all at tp=1."""
    from megatron_mini.hardware import GPUS, math_dtype
    cfg = small_config(small_data, tmp_path, tp=tp, gbs=8, mbs=2)
    link = dict(gpus=2 * tp, intra_node_gbps=0.05, inter_node_gbps=0.05, gpu="h100-80gb")
    inside = estimate(planner, cfg, ClusterConfig(gpus_per_node=8, **link))
    across = estimate(planner, cfg, ClusterConfig(gpus_per_node=tp, **link))
    assert {k: v for k, v in inside.times.items() if k != "dp"} == {k: v for k, v in across.times.items() if k != "dp"}
    peak = GPUS["h100-80gb"].tflops[math_dtype(cfg.precision.dtype, cfg.precision.tf32)] * 1e12 * 0.5
    last_backward = 2 / 3 * inside.ranks[0].microbatch_flops / peak
    assert across.times["dp"] > last_backward                       # partly exposed: a window change shows
    tp_hidden = sum(calls * flops / peak for (group, *_, flops), calls in inside.ranks[0].overlaps.items()
                    if group == "tp")
    assert (tp_hidden > 0) == (tp > 1)
    m = cfg.num_microbatches(2)
    assert inside.times["dp"] - across.times["dp"] == pytest.approx(tp_hidden / m, rel=1e-9)


def test_dp_groups_across_nodes_get_no_nvlink_window(small_data, tmp_path, planner):
    """tp=2 dp=3 on nodes of 8: tp x dp = 6 <= 8, yet the DP groups of ranks 6-11 straddle two nodes, so they
    run over the network and their window is the whole last backward: the same times as on nodes of 2."""
    cfg = small_config(small_data, tmp_path, tp=2, pp=4, gbs=12, mbs=2)
    link = dict(gpus=24, intra_node_gbps=0.05, inter_node_gbps=0.05, gpu="h100-80gb")
    eights = estimate(planner, cfg, ClusterConfig(gpus_per_node=8, **link))
    twos = estimate(planner, cfg, ClusterConfig(gpus_per_node=2, **link))
    one_node = estimate(planner, cfg, ClusterConfig(gpus_per_node=24, **link))
    assert eights.times == twos.times
    assert one_node.times["dp"] > twos.times["dp"]         # inside a node the window shrinks: more is exposed


@pytest.mark.parametrize("gpus, per_node", [(48, 8), (64, 8), (32, 4), (6, 8)])
def test_a_group_is_on_nvlink_only_when_every_one_of_it_lies_in_a_node(gpus, per_node):
    """Against the mesh's rank order (tp fastest, then dp, then pp): the TP, DP and whole-world groups (of
    more than one rank) of every tp x dp x pp of the cluster get NVLink exactly when none of them straddles
    two nodes (tp=6 on nodes of 8 does: ranks 6-11; so do tp=2 dp=3's DP groups)."""
    c = ClusterConfig(gpus=gpus, gpus_per_node=per_node, intra_node_gbps=300.0, inter_node_gbps=25.0)
    for tp, dp in itertools.product(range(1, gpus + 1), repeat=2):
        if gpus % (tp * dp):
            continue
        pp = gpus // (tp * dp)
        rank = lambda t, d, p: t + tp * (d + dp * p)                                        # noqa: E731
        groups = {"tp": [[rank(t, d, p) for t in range(tp)] for d in range(dp) for p in range(pp)],
                  "dp": [[rank(t, d, p) for d in range(dp)] for t in range(tp) for p in range(pp)],
                  "world": [list(range(gpus))]}
        for group, span in (("tp", tp), ("dp", tp * dp), ("world", gpus)):
            if len(groups[group][0]) == 1:
                continue                                       # a group of one rank moves nothing
            one_node = all(len({r // per_node for r in g}) == 1 for g in groups[group])
            assert (_link_gbps(c, span) == 300.0) == one_node, (tp, dp, pp, group)
    assert _link_gbps(c, 6) == (300.0 if gpus == 6 else 25.0)       # tp=6, or tp=2 dp=3: span 6


def test_tp_must_divide_the_gpus_of_a_node(small_data, tmp_path):
    """tp=3 and 6 on nodes of 8 would put TP groups across nodes: refused, with the larger tp, for that reason."""
    base = _cluster_config(small_data, tmp_path, 48, gpus_per_node=8)
    base.model = dataclasses.replace(base.model, num_heads=24, hidden_size=96, vocab_pad_multiple=384)
    valid, refused = layouts(base)
    assert {c.tp for c in valid} == {1, 2, 4, 8}
    assert refused[NODE] == 6                                      # tp = 3, 6, 12, 16, 24, 48
    one_node = dataclasses.replace(base, cluster=ClusterConfig(gpus=6, gpus_per_node=8))
    assert {c.tp for c in layouts(one_node)[0]} == {1, 2, 3, 6}    # a cluster inside one node: any tp


# ----------------------------------------------------------------------------- which ranks are measured
@pytest.mark.parametrize("layout", [dict(pp=4, embedding_stage="own", pipeline_last_blocks=6),
                                    dict(pp=4, embedding_stage="own", pipeline_first_blocks=1),
                                    dict(pp=4, vpp=2), dict(pp=4, schedule="gpipe"),
                                    dict(pp=4)], ids=["own-last6", "own-first1", "vpp2", "gpipe", "pp4"])
def test_plan_measures_the_largest_and_the_slowest_rank(small_data, tmp_path, planner, layout):
    """Whatever the split, the plan's memory is the largest of every pipeline rank's and its compute the
    slowest's (with own embedding and head stages and 6 of 8 blocks on the last block stage, both are
    rank pp - 2's: the first, second and last ranks are not enough)."""
    cfg = small_config(small_data, tmp_path, gbs=16, mbs=1, **layout)
    e = estimate(planner, cfg, ClusterConfig(gpus=cfg.pp))
    every = [planner.measure_rank(cfg, 1, r) for r in range(cfg.pp)]
    assert e.memory_gib * GiB == max(sum(r.memory.values()) for r in every)
    assert max(r.flops for r in e.ranks) == max(r.flops for r in every)
    if layout.get("pipeline_last_blocks"):
        assert e.worst.pp_rank == 2 and max(e.ranks, key=lambda r: r.flops).pp_rank == 2
    if layout == dict(pp=4):                                # ranks 1 and 2 alike: rank 1, more in flight
        assert [r.pp_rank for r in e.ranks] == [0, 1, 3]


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("tp, sp", [(1, False), (2, False), (2, True), (4, True)])
def test_a_gpu_plans_block_saves_what_korthikanti_counts(tp, sp, dropout):
    """What the plan of a GPU run saves per block is Korthikanti et al. 2022's count (Table 2), s b h (34 + 5 a s / h)
    bytes in 16 bits, less what a fused (flash) attention does not save, 5 a s^2 b (the [s, s] softmax, its dropout
    mask and output) and, without dropout, the two 1-byte masks on the residual stream (2 s b h), plus what the
    count leaves out, the log-sum-exp the fused kernel saves (fp32 [b, a, s]) and the LayerNorms' fp32 mean and
    rstd (2 x 2 x [s, b]); the whole of it over tp with sequence parallelism, without it all but 8 s b h (10 with
    dropout's masks: the LayerNorms' and the linears' inputs, whole on every rank) and the LayerNorms' statistics.
    A GPU's dropout saves a bool mask (ATen's fused native_dropout); the plan saved it in bf16, as the CPU's
    composite does (36 s b h, not 34)."""
    s, b, h, a = 128, 2, 256, 4
    model = ModelConfig(num_layers=2, hidden_size=h, num_heads=a, seq_len=s, vocab_size=512, dropout=dropout)
    cfg = TrainConfig(model=model, tp=tp, sp=sp, mbs=b, gbs=8, device="cuda")
    cfg.precision.dtype = "bf16"
    masks = 2 * s * b * h * (dropout > 0)                 # the residual stream's two, 1 byte an element
    whole = s * b * h * (8 + 24 / tp) + masks if tp > 1 and not sp else (32 * s * b * h + masks) / tp
    expected = whole + 4 * a * s * b / tp + 16 * s * b / (tp if sp else 1)
    saved = Planner().layer_facts(cfg)["block"].activation_bytes
    assert abs(saved - expected) <= 64, (saved, expected)          # (64 bytes: the kernel's scalars)


@pytest.mark.parametrize("tp, sp", [(1, False), (2, True)])
def test_a_fully_recomputed_block_saves_its_input_only(tp, sp):
    """With recompute=full a block keeps what Korthikanti et al. 2022 count for it, its input, 2 s b h bytes in 16
    bits (over tp with sequence parallelism), as Megatron's full recompute does: the residual a block leaves
    pending for the next one's fused add is added before the checkpoint (else it saved both, 4 s b h)."""
    s, b, h = 128, 2, 256
    model = ModelConfig(num_layers=2, hidden_size=h, num_heads=4, seq_len=s, vocab_size=512)
    cfg = TrainConfig(model=model, tp=tp, sp=sp, mbs=b, gbs=8, device="cuda", recompute="full")
    cfg.precision.dtype = "bf16"
    assert Planner().layer_facts(cfg)["block"].activation_bytes == 2 * s * b * h // tp


# ----------------------------------------------------------------------------- FLOPs with recomputation
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("tp, sp", [(1, False), (2, True)])
def test_flops_formula_counts_what_recomputation_runs(dropout, tp, sp):
    """ModelConfig.layer_flops_per_token(recompute) is what torch's FLOP counter counts over a forward +
    backward of the whole model on TP rank 0 (meta tensors, attention by the fused kernel a GPU runs, as the
    planner measures it), for recompute none, selective and full. Full recompute runs a block's fc2 again
    only when dropout follows it (torch's checkpoint stops once the tensors saved for backward are back).
    The fused kernel's backward computes q k^T again (2 h s per token and layer): torch counts it, the
    formula (model FLOPs, as Megatron counts them) does not."""
    model = ModelConfig(num_layers=2, hidden_size=64, num_heads=4, seq_len=32, vocab_size=300, dropout=dropout)
    b, s, h = 3, model.seq_len, model.hidden_size
    for recompute in ("none", "selective", "full"):
        mesh = ParallelMesh(tp, 1, 1, ledger=Ledger(), virtual_rank=0)
        ctx = ParallelContext(mesh.tp_group, RNGTracker(1, 0, META), sp, recompute)
        (chunk,) = build_chunks(model, ctx, [(0, model.num_layers + 2)], 1, META)
        ids = torch.zeros(b, s, dtype=torch.long, device=META)
        with mock.patch.object(F, "scaled_dot_product_attention", _fused_on_meta), \
                FlopCounterMode(display=False) as counter:
            chunk.train()(ids, ids).sum().backward()
        f = model.layer_flops_per_token(recompute)
        per_token = model.num_layers * (f["block"] + 2 * h * s) + f["head"]
        assert counter.get_total_flops() == per_token * b * s // tp, recompute
    assert model.flops_per_token() == sum(model.layer_flops_per_token("none")[k] * n for k, n in
                                          (("block", model.num_layers), ("head", 1)))   # MFU: recompute left out


# ----------------------------------------------------------------------------- the command line, its errors
def test_the_printed_command_launches_the_best_layout(small_data, tmp_path):
    """The torchrun line, composed by train.py's config, is the layout the plan recommends, whatever layout
    keys (or layout group) the command line gave."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from plan import CONF, load_config, parse_layout, torchrun

    from megatron_mini.config import register_configs
    given = ["model=tiny", "gbs=64", "mbs=1", "cluster.gpus=16", "tp=2", "recompute=full", "sp=true",
             "pipeline_last_blocks=3", "layout=tp4_pp12", "schedule=gpipe"]
    base = load_config(given)
    for layout in ("pp=2,zero=1", "tp=4,vpp=2,pp=2,embedding_stage=own"):
        best = parse_layout(layout, base)
        line = torchrun(Estimate(best, 1, [], 0, 0.0, {}, 1.0, 0.0, True, 0.0), given)
        register_configs()
        with initialize_config_dir(config_dir=CONF, version_base=None):
            launched = OmegaConf.to_object(compose(config_name="config", overrides=line.split(" train.py ")[1].split()))
        keys = [f.name for f in dataclasses.fields(TrainConfig) if f.name in
                ("tp pp vpp sp zero recompute embedding_stage schedule "
                 "pipeline_first_blocks pipeline_last_blocks").split()]
        assert {k: getattr(launched, k) for k in keys} == {k: getattr(best, k) for k in keys}, line
        assert launched.schedule == "gpipe" and launched.gbs == 64 and "cluster" not in line


@pytest.mark.parametrize("layout, error", [("sp=no", "sp=no must be true or false"), ("tp=x", "must be an integer"),
                                           ("tp=4.0", "must be an integer"), ("tp=-1", "tp=-1 must be >= 1"),
                                           ("model=gpt3", "not key=value of a layout key"),
                                           ("precision=bf16", "not key=value"), ("cluster=h100", "not key=value"),
                                           ("recompute=some", "choose one of"), ("pp", "not key=value")])
def test_layout_values_are_checked(layout, error):
    """--layout takes the layout keys only, each value as its field's type (sp true or false)."""
    from plan import load_config, parse_layout

    base = load_config(["cluster.gpus=16"])
    with pytest.raises(ConfigError, match=error):
        parse_layout(layout, base)
    assert parse_layout("tp=2,sp=false", base).sp is False and parse_layout("tp=2,sp=true", base).sp is True


def test_plan_says_why_nothing_can_run(capsys, tmp_path):
    """No valid layout (nothing to draw), or none that fits: one error line saying why, and exit status 2."""
    from plan import main

    assert main(["gbs=3", "mbs=2", "cluster.gpus=2", "--plot", str(tmp_path / "plan.png")]) == 2
    assert "error: no layout of tiny on 2 GPUs" in capsys.readouterr().err
    assert main(["gbs=8", "mbs=1", "cluster.gpus=2", "cluster.memory_gib=0.001", "cluster.reserve_gib=0"]) == 2
    err = capsys.readouterr().err
    assert "error: none of the" in err and "fits in 0.001 GiB per GPU: the smallest" in err
    assert main(["--layout", "sp=maybe"]) == 2 and capsys.readouterr().err.startswith("error: --layout sp=maybe")


@pytest.mark.parametrize("dp, layout", [
    (1, {}), (1, dict(pp=2)), (2, dict(tp=2, pp=2, zero=1)), (1, dict(pp=2, vpp=2)),
    (2, dict(zero=1, **{"precision.dtype": "bf16"})), (1, dict(pp=4, embedding_stage="own")),
    (1, dict(tp=4, **{"precision.dtype": "fp16", "model.vocab_pad_multiple": 16384}))])
def test_the_state_floor_is_at_most_what_each_rank_holds(dp, layout, small_data, tmp_path, planner):
    """rank.state_bytes_at_least (from the config alone, what training refuses a model too large for before
    building it) is at most the weights, main grads and optimizer state of every rank built on meta as training
    builds it, and within the biases and LayerNorms it leaves out (3% of the test model's blocks)."""
    from megatron_mini.rank import state_bytes_at_least
    cfg = small_config(small_data, tmp_path, **layout)
    for pp_rank in range(cfg.pp):
        held = sum(planner.rank_state(cfg, dp, pp_rank)[0].values())
        assert 0.97 * held <= state_bytes_at_least(cfg, dp, pp_rank) <= held, (pp_rank, held)


def test_a_model_is_refused_only_where_its_ranks_floors_cannot_fit_their_device(small_data, tmp_path, monkeypatch):
    """training._refuse_what_cannot_fit: the four ranks of pp = 4 with a wide vocabulary on one host (uneven: the
    embedding and head stages hold ~5x a block stage's) fit in the sum of their floors, which an even share of the
    host refused to the embedding's rank (the review's case); a host below the rank's floor and three times the
    smallest refuses it; a model that zero=1 would fit says so, one it would not does not."""
    import types

    from megatron_mini import training
    from megatron_mini.rank import state_bytes_at_least
    cfg = small_config(small_data, tmp_path, pp=4, embedding_stage="own", **{"model.vocab_pad_multiple": 16384})
    floors = [state_bytes_at_least(cfg, 1, r) for r in range(4)]
    assert max(floors) > 4 * min(floors)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("WORLD_SIZE", "4")

    def refusal(cfg, memory, pp_rank, dp=1):
        monkeypatch.setattr(training, "device_memory_bytes", lambda device: memory)
        monkeypatch.setenv("LOCAL_RANK", str(pp_rank))
        monkeypatch.setenv("RANK", str(pp_rank))
        try:
            training._refuse_what_cannot_fit(cfg, types.SimpleNamespace(dp=dp, pp_rank=pp_rank), torch.device("cpu"))
        except MemoryError as e:
            return str(e)
    assert [refusal(cfg, sum(floors), r) for r in range(4)] == [None] * 4
    alone = floors[0] + 3 * min(floors)
    assert refusal(cfg, alone, 0) is None
    assert refusal(cfg, alone - 1, 0).startswith(f"its weights, fp32 gradients and Adam state alone need at least "
                                                 f"{floors[0] / 2**30:.3g} GiB (and the 3 other ranks on it at least ")
    dp4 = small_config(small_data, tmp_path, gbs=32)
    full, sharded = (4 * state_bytes_at_least(c, 4, 0) for c in (dp4, dataclasses.replace(dp4, zero=1)))
    assert refusal(dp4, sharded, 0, dp=4).endswith("more tensor or pipeline parallelism, or zero=1")
    assert refusal(dp4, sharded - 1, 0, dp=4).endswith("more tensor or pipeline parallelism")
    assert refusal(dp4, full, 0, dp=4) is None


def test_a_layout_fits_in_the_gpu_memory_less_the_reserve(small_data, tmp_path, planner):
    """A GPU's nominal memory is not a layout's to fill (an "80 GB" A100 offers 79.3 GiB to CUDA, and the
    context and NCCL's buffers come out of that): a layout fits when its largest rank needs at most the
    memory less cluster.reserve_gib (3 GiB by default)."""
    from megatron_mini.planner import ClusterConfig
    assert ClusterConfig().capacity_gib == 80.0 - 3.0
    cfg = small_config(small_data, tmp_path, gbs=8, mbs=2)
    need = estimate(planner, cfg, ClusterConfig(gpus=2)).memory_gib
    assert estimate(planner, cfg, ClusterConfig(gpus=2, memory_gib=need + 1.0, reserve_gib=0.9)).fits
    assert not estimate(planner, cfg, ClusterConfig(gpus=2, memory_gib=need + 1.0, reserve_gib=1.1)).fits
    with pytest.raises(ConfigError, match="cluster.reserve_gib=90 must be >= 0 and below the GPU's memory"):
        ClusterConfig(reserve_gib=90).check()


@pytest.mark.parametrize("field, value, fact", [
    ("intra_node_gbps", float("nan"), "cluster.intra_node_gbps=nan must be a finite number."),
    ("efficiency", float("inf"), "cluster.efficiency=inf must be a finite number."),
    ("gpus", 0, "cluster.gpus=0 must be > 0."),
    ("inter_node_gbps", -1.0, "cluster.inter_node_gbps=-1.0 must be > 0."),
    ("efficiency", 1.5, "cluster.efficiency=1.5 must be in (0, 1]."),
    ("memory_gib", -1.0, "cluster.memory_gib=-1.0 must be >= 0 (0: the GPU's)."),
    ("gpus", 12, "cluster.gpus=12 is not a whole number of nodes of 8."),
])
def test_a_cluster_that_cannot_be_is_refused_naming_its_value(field, value, fact):
    """ClusterConfig.check: a value no cluster has is one ConfigError naming the key and the value given (a
    memory_gib below 0 was refused as if efficiency were wrong too); a cluster with the value changed back to its
    default passes."""
    from megatron_mini.planner import ClusterConfig
    with pytest.raises(ConfigError) as refused:
        ClusterConfig(**{field: value}).check()
    assert str(refused.value) == fact
    ClusterConfig(**{field: getattr(ClusterConfig(), field)}).check()


def test_precision_peak_tflops_overrides_the_table_as_for_mfu(small_data, tmp_path, planner):
    """precision.peak_tflops (the run's MFU denominator, for a GPU the table lacks or a clock it does not
    assume) is the planner's peak too: half the table's peak doubles the predicted compute."""
    from megatron_mini.hardware import GPUS, math_dtype
    from megatron_mini.planner import ClusterConfig
    cfg = small_config(small_data, tmp_path, gbs=8, mbs=2)
    table = estimate(planner, cfg, ClusterConfig(gpus=2))
    half = GPUS["a100-80gb"].tflops[math_dtype(cfg.precision.dtype, cfg.precision.tf32)] / 2
    slow = estimate(planner, dataclasses.replace(cfg, precision=dataclasses.replace(cfg.precision, peak_tflops=half)),
                    ClusterConfig(gpus=2))
    assert slow.times["compute"] == pytest.approx(2 * table.times["compute"], rel=1e-12)


@pytest.mark.parametrize("compile_", [False, True])
def test_memory_report_gives_the_allocator_peak_under_compile_too(compile_, caplog):
    """On a GPU the first step's allocator peak is reported and kept for history.json, with compile=true too
    (whose graphs keep their saved activations out of the meter's view: that figure alone is left out);
    the later steps measure nothing. (CUDA is stood in for: the report reads torch.cuda.max_memory_allocated.)"""
    import logging
    import types
    from unittest import mock

    from megatron_mini.memory_report import MemoryReport

    mesh = types.SimpleNamespace(rank=0, dp=1, coords=lambda r: (0, 0, 0))
    trainer = types.SimpleNamespace(mesh=mesh, cfg=TrainConfig(compile=compile_), chunks=[], consumed_samples=0,
                                    device=torch.device("cuda"))
    with mock.patch("megatron_mini.plan_meta.planned_memory", return_value=None):
        report = MemoryReport(trainer, logging.getLogger("memory-test"), plan=True)
    report.ranks = [{"rank": 0, "measured": {}}]
    gathered = []
    with mock.patch.object(report, "_gather", side_effect=lambda v: gathered.append(v) or [v]), \
            mock.patch("torch.cuda.max_memory_allocated", return_value=5 * 2 ** 30), caplog.at_level(logging.INFO):
        for _ in range(2):
            with report.first_step():
                pass
    measured = report.history()[0]["measured"]
    assert len(gathered) == 1 and measured["allocated_peak"] == 5 * 2 ** 30
    assert ("activations" in measured) != compile_
    assert "5120 (the allocator's peak)" in caplog.text


@pytest.mark.parametrize("device, dropout, kernels, math", [
    ("cpu", 0.1, "torch", True), ("cpu", 0.0, "torch", False), ("cuda", 0.1, "torch", False),
    ("auto", 0.1, "torch", False), ("cpu", 0.1, "triton", False), ("cpu", 0.1, "layer_norm", True)])
def test_plan_takes_the_math_attention_only_on_the_cpu_with_dropout(device, dropout, kernels, math):
    """The plan saves SDPA's [s, s] weights and mask where the run would take the math path: the CPU with
    dropout (its flash kernel takes none), unless the Triton flash attention runs; a GPU plan with dropout
    is a fused kernel's."""
    from megatron_mini.plan_meta import math_attention
    cfg = TrainConfig(device=device, kernels=kernels)
    cfg.model.dropout = dropout
    assert math_attention(cfg) is math


def test_a_valid_layout_is_explained_when_the_plan_enumerates_none(capsys):
    """--layout explains the layout it names when validate() accepts it, even where no layout the planner
    enumerates is valid (blocks placed unevenly: 7 blocks as 3 + 4 over pp=2, one head, gbs=1); the run still ends
    with the plan's error and status 2 (the layout was dropped, and the error said no layout was valid)."""
    from plan import load_config, main, parse_layout

    args = ["model.num_layers=7", "model.num_heads=1", "gbs=1", "mbs=1", "cluster.gpus=2"]
    layout = "pp=2,pipeline_first_blocks=3"
    assert parse_layout(layout, load_config(args)).pp == 2           # validate() accepts it: it can be launched
    assert main(args + ["--layout", layout]) == 2
    out, err = capsys.readouterr()
    assert f"--layout {layout}:" in out and "pp rank 1" in out, out
    assert "error: no layout of tiny on 2 GPUs" in err and "enumerates" in err


@pytest.mark.parametrize("layout", ["pp=2,schedule=gpipe", "pp=2,pipeline_first_blocks=3",
                                    "pp=4,embedding_stage=own,pipeline_last_blocks=2",
                                    "tp=2,pp=2,vpp=2,sp=true,zero=1"])
def test_a_layouts_label_is_the_layout(layout):
    """The label a layout gets in the table, the CSV, the plot and --layout's explanation names every layout key
    it sets: read back as a --layout, it is the same layout (a GPipe layout was labelled as the 1F1B one, whose
    memory differs, and blocks placed by hand were left out)."""
    from plan import load_config, parse_layout

    base = load_config(["gbs=64", "mbs=1", "cluster.gpus=8"])
    cfg = parse_layout(layout, base)
    label = Estimate(cfg, 1, [], 0, 0.0, {}, 1.0, 0.0, True, 0.0).layout_args()
    assert parse_layout(label.replace(" ", ","), base) == cfg, label


def test_the_readme_bloom_figures_are_the_planners(bloom):
    """The worked example's reasons are the planner's numbers: BLOOM's layout's pipeline time without and with
    sequence parallelism, and how much heavier its last stage is than a middle one, at pp=12 and at pp=6."""
    import pathlib
    import re
    from plan import parse_layout

    base, chosen = bloom
    text = " ".join((pathlib.Path(__file__).parents[1] / "README.md").read_text().split())
    planner = Planner()
    pp_s = [estimate(planner, cfg, base.cluster).times["pp"] for cfg in (chosen, dataclasses.replace(chosen, sp=True))]
    said = re.search(r"\(pp ([\d.]+) s against ([\d.]+) s with sp\)", text)
    assert [float(said.group(1)), float(said.group(2))] == [round(t, 2) for t in pp_s]

    def heavier(cfg):                     # the last stage's FLOPs over a middle one's, in percent
        dp = base.cluster.gpus // (cfg.tp * cfg.pp)
        last, middle = (planner.measure_rank(cfg, dp, r).flops for r in (cfg.pp - 1, 1))
        return 100 * (last / middle - 1)
    said = re.search(r"makes the last stage ([\d.]+)% heavier than the rest, where pp=6's 12 per stage dilute it to "
                     r"([\d.]+)%", text)
    pp6 = parse_layout("tp=8,pp=6,sp=true,zero=1,embedding_stage=layer", base)
    assert float(said.group(1)) == pytest.approx(heavier(chosen), abs=0.1)
    assert float(said.group(2)) == pytest.approx(heavier(pp6), abs=0.1)


def _step_allocations(cfg):
    """This rank's peak of what one training step's forwards and backwards allocate (the second step's: the
    first builds what persists)."""
    from megatron_mini.meter import AllocationMeter
    trainer = make_trainer(cfg)
    trainer.train_step()
    meter, run = AllocationMeter(), trainer.engine.train_step

    def metered(*args):
        with meter:
            return run(*args)
    trainer.engine.train_step = metered
    trainer.train_step()
    return trainer.mesh.pp_rank, trainer.mesh.tp_rank, trainer.mesh.dp_rank, meter.peak


WIDE = {"model.vocab_pad_multiple": 16384}


@pytest.mark.parametrize("world, layout", [(2, dict(pp=2)), (2, dict(tp=2, sp=True)), (1, dict(recompute="full")),
                                           (2, dict(pp=2, **WIDE)), (4, dict(tp=2, pp=2, **WIDE)),
                                           (1, dict(WIDE)), (1, dict(recompute="full", **WIDE)),
                                           (1, dict(WIDE, **{"precision.dtype": "bf16"})),
                                           (2, dict(tp=2, sp=True, **WIDE)), (1, dict(vpp=2, **WIDE)),
                                           (1, dict(WIDE, **{"model.num_layers": 16})),
                                           (1, dict(WIDE, schedule="gpipe", gbs=8)),
                                           (1, dict(recompute="full", **{"model.num_layers": 1})),
                                           (4, dict(pp=2, vpp=2, embedding_stage="own", gbs=8, **WIDE)),
                                           (2, dict(zero=1, **WIDE))],
                         ids=["pp2", "tp2-sp", "full", "pp2-wide-vocab", "tp2-pp2-wide-vocab", "pp1-wide-vocab",
                              "full-wide-vocab", "bf16-wide-vocab", "tp2-sp-wide-vocab", "pp1-vpp2-wide-vocab",
                              "pp1-16-blocks-wide-vocab", "pp1-gpipe-wide-vocab", "pp1-one-block-full",
                              "pp2-vpp2-own-wide-vocab", "dp2-zero-wide-vocab"])
def test_planned_memory_holds_what_a_real_step_allocates(world, layout, small_data, tmp_path, planner):
    """The plan's activations and backward working set of a rank are within [0.9, 1.15] of the peak of what a real
    step's forwards and backwards allocate (meter.AllocationMeter on real tensors): on the last stage of a wide
    vocabulary, the logits' fp32 gradients, on the first the fp32 rows the lookup adds into the word embedding's
    main grad; the plan once counted none of them (8x under on the last stage here; 6 GiB under for gpt2-small at
    mbs 16). The word embedding's gradients go into its main grad as they are formed (the head's and the lookup's
    were [V/tp, h] tensors in the weights' dtype, the head's held through the whole backward at pp = vpp = 1), so
    nothing waits from one layer's backward to another's: the blocks' backward runs once the head has freed what the
    microbatch saved for it (a plan that added the head's saved tensors was 1.21x over with full recomputation,
    1.23x with its one block). The embedding's backward comes after the chunk's blocks have freed what that
    microbatch saved, and with vpp > 1 after the later chunks' backwards: a plan that added it to the rank's
    activation peak was 1.2x over on pp=2's first stage, 1.5x with an own embedding stage and vpp=2. With ZeRO-1 the
    buckets' in-place reduce-scatters allocate nothing (the meter counted the gradient buffer again). The plan is a
    GPU's, whose GEMM adds each 16-bit weight gradient into its fp32 main grad; a CPU torch forms the 16-bit product
    first (tensor_parallel.gemm_into_fp32 "cast"), so in 16 bits the plan is measured here with the CPU's way on meta.
    (Adding the head's [V/tp, h] product to the GPU's plan instead was 1.4x over under torch 2.8, whose slice_backward
    of the padded logits' gradient already peaks as high: the product is not always the peak.)"""
    # 2 microbatches a step, as many in flight at pp <= 2 as 8 (the GPipe case keeps its gbs=8: all 8)
    cfg = small_config(small_data, tmp_path, **{"gbs": 4, **layout})
    dp = world // (cfg.tp * cfg.pp)
    dtype = DTYPES[cfg.precision.dtype]
    way = "addmm" if dtype == torch.float32 else gemm_into_fp32("cpu", dtype)     # (fp32: addmm_ on every torch)
    as_the_cpu = contextlib.nullcontext() if way == "addmm" else \
        mock.patch.object(plan_meta, "_gemm_into_fp32_on_meta", GEMM_INTO_FP32[way])
    for pp_rank, tp_rank, dp_rank, allocated in spawn(world, _step_allocations, cfg):
        if tp_rank or dp_rank:
            continue
        with as_the_cpu:          # (a Planner of its own: the module's caches the GPU's measurements)
            memory = (planner if way == "addmm" else Planner()).measure_rank(cfg, dp, pp_rank).memory
        planned = memory["activations"] + memory.get("backward", 0)
        assert 0.9 * allocated <= planned <= 1.15 * allocated, (pp_rank, memory, allocated)
