"""The layout planner against the real thing: on a grid of small layouts of the test model, what the
planner predicts from meta-device models equals what one training step of the real ranks shows.

- weights, fp32 main grads and optimizer state: equal to Optimizer.memory_bytes() of the real rank;
- communication: equal to the real rank's ledger of one step, call for call and byte for byte, and so
  are the collectives run beside a GEMM, with that GEMM's FLOPs;
- activations: within 10% of the saved-tensor meter over the real step (the same meter, run on real
  tensors, holding every microbatch the schedule keeps in flight);
- bubble: equal to the schedule simulator's for any microbatch count.
"""

import csv
import dataclasses
import itertools

import pytest
import torch

from harness import make_trainer, small_config, train_on_ranks
from megatron_mini.config import ConfigError, TrainConfig, validate
from megatron_mini.meter import SavedTensorMeter
from megatron_mini.pipeline import partition_for
from megatron_mini.plan_meta import Planner
from megatron_mini.planner import estimate, layouts, model_bytes, plan
from megatron_mini.schedules import simulate
from ranks import spawn

GRID = {                                   # name: (world size, layout)
    "tp2": (2, dict(tp=2)),
    "tp2-sp-full": (2, dict(tp=2, sp=True, recompute="full")),
    "pp2": (2, dict(pp=2)),
    "pp2-vpp2-own": (4, dict(pp=2, vpp=2, embedding_stage="own")),
    "dp2-zero-selective": (2, dict(zero=1, recompute="selective")),
    "tp2-pp2-sp-bf16": (4, dict(tp=2, pp=2, sp=True, **{"precision.dtype": "bf16"})),
}


def _one_real_step(cfg):
    """This rank's memory report, the ledger of one training step and its activation peak."""
    trainer = make_trainer(cfg)
    meter = SavedTensorMeter(exclude=[p for chunk in trainer.chunks for p in chunk.parameters()])
    trainer.mesh.ledger.reset()
    with meter.hooks():
        trainer.train_step()
    return trainer.mesh.pp_rank, trainer.mesh.tp_rank, trainer.mesh.dp_rank, \
        trainer.optimizer.memory_bytes(), trainer.mesh.ledger.summary(), trainer.mesh.ledger.overlaps(), meter.peak


@pytest.fixture(scope="module")
def planner():
    return Planner()


@pytest.mark.parametrize("name", list(GRID))
def test_prediction_matches_a_real_step(name, small_data, tmp_path, planner):
    world, layout = GRID[name]
    cfg = small_config(small_data, tmp_path, **layout)
    dp = world // (cfg.tp * cfg.pp)
    beside_gemms = False
    for pp_rank, tp_rank, dp_rank, memory, ledger, overlaps, activations in spawn(world, _one_real_step, cfg):
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


@pytest.mark.parametrize("kind, pp, vpp", [("1f1b", 2, 1), ("1f1b", 4, 1), ("gpipe", 3, 1), ("1f1b", 4, 2),
                                           ("1f1b", 2, 3), ("gpipe", 2, 2)])
@pytest.mark.parametrize("factor", [1, 2, 5])
def test_bubble_is_the_simulators(kind, pp, vpp, factor, planner):
    """The planner simulates at m = 2 pp and scales; the idle time does not depend on m there."""
    m = pp * factor
    bubble = planner.bubble(TrainConfig(schedule=kind, pp=pp, vpp=vpp), m)
    assert bubble == pytest.approx(simulate(kind, pp, vpp, m).bubble, rel=1e-12)


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


# ----------------------------------------------------------------------------- the enumeration
def _cluster_config(small_data, tmp_path, gpus: int, **cluster):
    from megatron_mini.planner import ClusterConfig, PlanConfig

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
    assert refused["tp larger than a node"] == 2 and sum(refused.values()) > 2      # tp = 8, 16


@pytest.mark.parametrize("gpu_visible", [False, True], ids=["fork", "spawn"])
def test_workers_plan_what_one_process_plans(small_data, tmp_path, monkeypatch, gpu_visible):
    """Workers forked (CPU-only machines) or spawned (a GPU visible: torch refuses autograd in a child forked
    after a backward there) plan bit for bit what one process plans (spawned workers hash strings with
    another seed: no float sum may follow a set's order)."""
    if not gpu_visible and torch.cuda.is_available():
        pytest.skip("plan() never forks where a GPU is visible (a backward here may have started autograd's threads)")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu_visible)
    base = _cluster_config(small_data, tmp_path, 32)
    one, two = plan(base, workers=1), plan(base, workers=2)
    assert len(one.estimates) >= 32                       # enough for plan() to use the two workers
    assert [(e.layout_args(), e.dp, e.step_s, e.memory_gib) for e in one.estimates] == \
        [(e.layout_args(), e.dp, e.step_s, e.memory_gib) for e in two.estimates]


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
    from plan import main

    args = ["model=tiny", "gbs=64", "mbs=1", "cluster.gpus=16", "cluster.gpus_per_node=8"]
    out_csv, out_png = tmp_path / "plan.csv", tmp_path / "plan.png"
    assert main(args + ["--layout", "tp=2,pp=2,zero=1", "--csv", str(out_csv), "--plot", str(out_png)]) == 0
    printed = capsys.readouterr().out
    assert "torchrun --nnodes=2 --nproc_per_node=8" in printed and "--layout tp=2,pp=2,zero=1:" in printed
    with open(out_csv) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == int(printed.split(" valid layouts")[0].split()[-1])
    assert out_png.stat().st_size > 10_000
    assert main(args + ["--layout", "tp=3"]) == 2
    assert "tp x pp = 3 x 1" in capsys.readouterr().err
    assert main(args + ["cluster.gpu=a100"]) == 2                  # not a GPU of hardware.GPUS
    assert main(args + ["cluster.gpus_per_nod=8"]) == 2
    assert "did you mean cluster.gpus_per_node" in capsys.readouterr().err


# ----------------------------------------------------------------------------- train.py's start-up report
def test_training_prints_the_plan_next_to_the_run(small_data, tmp_path):
    """Planned weights, grads and optimizer state equal what every rank holds; planned activations are
    within 10% of the first step's; and planning changes nothing in the run."""
    layout = dict(tp=2, pp=2, sp=True, steps=2)
    planned = train_on_ranks(4, small_config(small_data, tmp_path / "plan", memory_plan=True, **layout))
    plain = train_on_ranks(4, small_config(small_data, tmp_path / "plain", **layout))
    assert planned["loss"] == plain["loss"] and planned["grad_norm"] == plain["grad_norm"]
    assert [r["rank"] for r in planned["memory"]] == [0, 1, 2, 3]
    for r in planned["memory"]:
        assert {k: r["planned"][k] for k in ("weights", "grads", "optimizer")} == \
            {k: r["measured"][k] for k in ("weights", "grads", "optimizer")}, r
        assert r["planned"]["activations"] == pytest.approx(r["measured"]["activations"], rel=0.1), r
    assert "planned" not in plain["memory"][0] and "activations" not in plain["memory"][0]["measured"]


@pytest.mark.parametrize("tp", [1, 2])
def test_dp_reduction_inside_a_node_waits_for_the_tp_traffic_of_its_window(small_data, tmp_path, planner, tp):
    """The DP reduction hides behind the last microbatch's backward; inside a node that backward's link also
    carries the TP collectives its GEMMs hide, so the DP reduction gets that window less their time. The same
    layout (dp=2) on two clusters whose links run at the same speed, one node of 8 GPUs or nodes of tp GPUs
    (the DP group across nodes): only the DP time differs, by exactly that TP time per microbatch at tp=2
    (the link is slow enough that the reduction outlasts the window either way), and not at all at tp=1."""
    from megatron_mini.hardware import GPUS, math_dtype
    from megatron_mini.planner import ClusterConfig
    cfg = small_config(small_data, tmp_path, tp=tp, gbs=8, mbs=2)
    link = dict(gpus=2 * tp, intra_node_gbps=0.05, inter_node_gbps=0.05, gpu="h100-80gb")
    inside = estimate(planner, cfg, ClusterConfig(gpus_per_node=8, **link))
    across = estimate(planner, cfg, ClusterConfig(gpus_per_node=tp, **link))
    assert {k: v for k, v in inside.times.items() if k != "dp"} == {k: v for k, v in across.times.items() if k != "dp"}
    peak = GPUS["h100-80gb"].tflops[math_dtype(cfg.precision.dtype, cfg.precision.tf32)] * 1e12 * 0.5
    last_backward = 2 / 3 * inside.ranks[0].microbatch_flops / peak
    assert across.times["dp"] > last_backward                       # partly exposed: a window change shows
    tp_hidden = sum(calls * flops / peak for (group, *_, flops), calls in inside.ranks[0].overlaps.items() if group == "tp")
    assert (tp_hidden > 0) == (tp > 1)
    m = cfg.num_microbatches(2)
    assert inside.times["dp"] - across.times["dp"] == pytest.approx(tp_hidden / m, rel=1e-9)
