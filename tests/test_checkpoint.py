"""Checkpoints: a resumed run continues exactly, and checkpoints load into other layouts."""
import os

import pytest

from harness import small_config, train_on_ranks


@pytest.fixture(scope="module")
def uninterrupted(small_data, tmp_path_factory):
    """10 steps at dp=2, saving at step 5 (and at the end)."""
    cfg = small_config(small_data, tmp_path_factory.mktemp("full"), steps=10, save_interval=5)
    return cfg, train_on_ranks(2, cfg)


@pytest.mark.parametrize("world,layout", [(2, {}), (2, {"tp": 2}), (2, {"pp": 2}), (1, {})],
                         ids=["same-layout", "into-tp2", "into-pp2", "into-dp1"])
def test_resume_continues_exactly(world, layout, uninterrupted, small_data, tmp_path):
    cfg, history = uninterrupted
    step5 = os.path.join(cfg.run_dir, "checkpoints", "step_000005")
    resumed = train_on_ranks(world, small_config(small_data, tmp_path, steps=10, resume=step5, **layout))
    assert len(resumed["loss"]) == 5
    for a, b in zip(history["loss"][5:], resumed["loss"]):
        assert abs(a - b) <= 1e-5 * abs(a), (history["loss"][5:], resumed["loss"])


def test_latest_pointer_and_auto_resume(uninterrupted, small_data):
    cfg, history = uninterrupted
    with open(os.path.join(cfg.run_dir, "checkpoints", "latest")) as f:
        assert f.read().strip() == "step_000010"
    assert not [d for d in os.listdir(os.path.join(cfg.run_dir, "checkpoints")) if d.endswith(".tmp")]
    again = train_on_ranks(1, small_config(small_data, cfg.run_dir, steps=10, resume="auto"))
    assert again["loss"] == []     # already at step 10: nothing left to train
