"""The layout planner against the real thing: on a grid of small layouts of the test model, what the
planner predicts from meta-device models equals what one training step of the real ranks shows.

- weights, fp32 main grads and optimizer state: equal to Optimizer.memory_bytes() of the real rank;
- communication: equal to the real rank's ledger of one step, call for call and byte for byte;
- activations: within 10% of the saved-tensor meter over the real step (the same meter, run on real
  tensors, holding every microbatch the schedule keeps in flight);
- bubble: equal to the schedule simulator's for any microbatch count.
"""

import pytest
import torch

from harness import make_trainer, small_config
from megatron_mini.config import TrainConfig
from megatron_mini.meter import SavedTensorMeter
from megatron_mini.plan_meta import Planner
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
        trainer.optimizer.memory_bytes(), trainer.mesh.ledger.summary(), meter.peak


@pytest.fixture(scope="module")
def planner():
    return Planner()


@pytest.mark.parametrize("name", list(GRID))
def test_prediction_matches_a_real_step(name, small_data, tmp_path, planner):
    world, layout = GRID[name]
    cfg = small_config(small_data, tmp_path, **layout)
    dp = world // (cfg.tp * cfg.pp)
    for pp_rank, tp_rank, dp_rank, memory, ledger, activations in spawn(world, _one_real_step, cfg):
        if tp_rank or dp_rank:
            continue                                # the planner speaks for TP rank 0, DP rank 0 of a stage
        plan = planner.measure_rank(cfg, dp, pp_rank)
        assert {k: plan.memory[k] for k in memory} == memory, (pp_rank, plan.memory, memory)
        assert plan.ledger == ledger, (pp_rank, plan.ledger, ledger)
        assert abs(plan.memory["activations"] - activations) <= 0.1 * activations, \
            (pp_rank, plan.memory["activations"], activations)


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
