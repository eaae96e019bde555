"""ZeRO-1 and activation recomputation change memory, not the model being trained."""
import os

import pytest
import torch

from harness import assert_same_training, final_weights, small_config, train_on_ranks


@pytest.mark.parametrize("dp", [2, 4])
def test_zero1_matches_plain_dp(dp, small_data, tmp_path):
    plain = train_on_ranks(dp, small_config(small_data, tmp_path / "plain", steps=10))
    zero = train_on_ranks(dp, small_config(small_data, tmp_path / "zero", steps=10, zero=1))
    assert_same_training(plain, zero, rtol=1e-6, wtol=1e-6)


def test_zero1_composes_with_tp_pp(small_data, tmp_path):
    single = train_on_ranks(1, small_config(small_data, tmp_path / "single", steps=10))
    zero = train_on_ranks(8, small_config(small_data, tmp_path / "zero", steps=10, tp=2, pp=2, sp=True, zero=1))
    assert_same_training(single, zero)


def test_zero1_checkpoint_resumes_without_zero(small_data, tmp_path):
    full = train_on_ranks(2, small_config(small_data, tmp_path / "zero", steps=10, save_interval=5, zero=1))
    step5 = os.path.join(full["checkpoint"], "..", "step_000005")
    resumed = train_on_ranks(2, small_config(small_data, tmp_path / "plain", steps=10, resume=step5))
    assert torch.allclose(torch.tensor(full["loss"][5:]), torch.tensor(resumed["loss"]), rtol=1e-6, atol=0)
    for name, w in final_weights(full).items():
        assert torch.allclose(w, final_weights(resumed)[name], rtol=0, atol=1e-6), name


RECOMPUTE_RUN = dict(steps=6, **{"model.dropout": 0.1})
RECOMPUTE_LAYOUTS = {"tp1": {}, "tp2-sp": dict(tp=2, sp=True)}   # dropout on the default stream at tp=1


@pytest.fixture(scope="module")
def without_recompute(small_data, tmp_path_factory):
    """{layout: history} of the runs without recompute (each computed on first use)."""
    runs = {}

    def get(layout):
        if layout not in runs:
            kw = RECOMPUTE_LAYOUTS[layout]
            runs[layout] = train_on_ranks(kw.get("tp", 1), small_config(small_data, tmp_path_factory.mktemp(layout),
                                                                         **RECOMPUTE_RUN, **kw))
        return runs[layout]
    return get


@pytest.mark.parametrize("layout", RECOMPUTE_LAYOUTS)
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_gives_the_same_training(recompute, layout, small_data, tmp_path, without_recompute):
    """Bitwise the same, with dropout on: recomputation replays the same dropout masks."""
    kw = RECOMPUTE_LAYOUTS[layout]
    none = without_recompute(layout)
    again = train_on_ranks(kw.get("tp", 1), small_config(small_data, tmp_path / recompute, recompute=recompute,
                                                         **RECOMPUTE_RUN, **kw))
    assert none["loss"] == again["loss"] and none["grad_norm"] == again["grad_norm"]
    assert_same_training(none, again, rtol=0, wtol=0)


def _optimizer_bytes(cfg):
    from harness import make_trainer
    return make_trainer(cfg).optimizer.memory_bytes()


def test_zero1_divides_optimizer_state_by_dp(small_data, tmp_path):
    from ranks import spawn

    plain = spawn(1, _optimizer_bytes, small_config(small_data, tmp_path))[0]
    for dp in (2, 4):
        sharded = spawn(dp, _optimizer_bytes, small_config(small_data, tmp_path, zero=1))
        for rank in sharded:
            # Adam moments (fp32 master = the weights in fp32): 8 bytes/param / dp, up to bucket padding
            assert abs(rank["optimizer"] * dp - plain["optimizer"]) <= 8 * dp * 4, (dp, rank, plain)
