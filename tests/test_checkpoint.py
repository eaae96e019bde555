"""Checkpoints: a resumed run continues exactly, and checkpoints load into other layouts."""
import math
import os

import pytest

from harness import small_config, train_on_ranks
from ranks import spawn


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


def test_resume_with_dropout_continues_exactly(small_data, tmp_path):
    """With dropout the resumed run draws the masks the uninterrupted one drew: they are keyed by sample and
    layer (rng.py), so nothing of the RNG is in the checkpoint, and a resume into another layout (pp=2 from
    dp=2) continues the same run too. Had the masks followed how far each rank's stream had run, the losses
    after the resume would differ (by ~2e-3 here)."""
    dropout = {"model.dropout": 0.1}
    cfg = small_config(small_data, tmp_path / "full", steps=6, save_interval=3, **dropout)
    history = train_on_ranks(2, cfg)
    step3 = os.path.join(cfg.run_dir, "checkpoints", "step_000003")
    resumed = train_on_ranks(2, small_config(small_data, tmp_path / "resumed", steps=6, resume=step3, **dropout))
    assert resumed["loss"] == history["loss"][3:]
    other = train_on_ranks(2, small_config(small_data, tmp_path / "pp2", steps=6, resume=step3, pp=2, **dropout))
    for a, b in zip(history["loss"][3:], other["loss"], strict=True):
        assert abs(a - b) <= 1e-5 * abs(a), (history["loss"][3:], other["loss"])


def test_latest_pointer_and_auto_resume(uninterrupted, small_data):
    cfg, history = uninterrupted
    with open(os.path.join(cfg.run_dir, "checkpoints", "latest")) as f:
        assert f.read().strip() == "step_000010"
    assert not [d for d in os.listdir(os.path.join(cfg.run_dir, "checkpoints")) if d.endswith(".tmp")]
    again = train_on_ranks(1, small_config(small_data, cfg.run_dir, steps=10, resume="auto"))
    assert again["loss"] == []     # already at step 10: nothing left to train


def test_fp16_resume_keeps_the_loss_scalers_counts(small_data, tmp_path):
    """A resumed fp16 run reports the run's skipped steps, not the segment's, and keeps counting overflows at
    the minimum scale where it stopped (the give-up rule spans a resume). Scale 2^40 overflows every step
    at every scale down to the minimum here, 2^37: the scale falls to it in 3 steps, then 3 overflow at it."""
    fp16 = dict(steps=6, save_interval=3, **{"precision.dtype": "fp16", "precision.initial_loss_scale": 2.0 ** 40,
                                             "precision.loss_scale_hysteresis": 1,
                                             "precision.min_loss_scale": 2.0 ** 37})
    full = train_on_ranks(1, small_config(small_data, tmp_path / "full", **fp16))
    step3 = os.path.join(tmp_path / "full", "checkpoints", "step_000003")
    resumed = train_on_ranks(1, small_config(small_data, tmp_path / "resumed", resume=step3, **fp16))
    assert full["summary"]["skipped_steps"] == resumed["summary"]["skipped_steps"] == 6
    import torch
    saved = [torch.load(os.path.join(d, "checkpoints", "step_000006", "optim_pp00.pt"), weights_only=True)["scaler"]
             for d in (tmp_path / "full", tmp_path / "resumed")]
    assert saved[0] == saved[1] and saved[0]["skips_at_min"] == 3 and saved[0]["scale"] == 2.0 ** 37


def test_a_branch_from_an_older_checkpoint_sets_the_newer_ones_aside(uninterrupted, small_data, tmp_path):
    """resume=PATH to step 5 of a run that reached step 10 (a rollback, as after a loss spike): step 10 is
    renamed step_000010.superseded (kept whole; no resume=auto or pruning counts it), the new branch's saves
    are kept and named by `latest` (keep_checkpoints=1 pruned the one just written before), resume=auto
    continues the branch, and metrics.jsonl holds the branch's lines only (the others moved aside)."""
    import json
    import shutil
    cfg, _ = uninterrupted
    run = tmp_path / "run"
    shutil.copytree(cfg.run_dir, run)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (5, 10))
                                       + '{"step": 10, "lo')                     # a line a kill cut short
    files = sorted(os.listdir(run / "checkpoints" / "step_000010"))
    branch = train_on_ranks(1, small_config(small_data, run, steps=7, keep_checkpoints=1,
                                            resume=str(run / "checkpoints" / "step_000005")))
    assert branch["checkpoint"] == str(run / "checkpoints" / "step_000007")
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_000007", "step_000010.superseded"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000007"
    assert sorted(os.listdir(run / "checkpoints" / "step_000010.superseded")) == files
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == 5 and max(steps) == 7
    assert (run / "metrics.superseded.jsonl").read_text() == (json.dumps({"step": 10, "loss": 9.0})
                                                              + '\n{"step": 10, "lo\n')
    again = train_on_ranks(1, small_config(small_data, run, steps=8, keep_checkpoints=1, resume="auto"))
    assert len(again["loss"]) == 1 and again["checkpoint"] == str(run / "checkpoints" / "step_000008")


@pytest.mark.parametrize("ranks", [1, 2, 3, 8])
def test_verify_shares_hash_every_file_once(uninterrupted, monkeypatch, ranks):
    """A job of n ranks hashes each file of a checkpoint once: rank r's share (verify(share=(r, n))) and
    the others' are disjoint and together every file meta.json lists (8 ranks: some hash none)."""
    from megatron_mini import checkpoint

    cfg, _ = uninterrupted
    path = os.path.join(cfg.run_dir, "checkpoints", "step_000005")
    hashed = []
    real = checkpoint.sha256_file
    monkeypatch.setattr(checkpoint, "sha256_file", lambda f: hashed.append(os.path.basename(f)) or real(f))
    for rank in range(ranks):
        checkpoint.verify(path, share=(rank, ranks))
    assert sorted(hashed) == sorted(checkpoint.read_meta(path)["files"])
    hashed.clear()
    checkpoint.present(path)
    assert hashed == []


def test_an_unreadable_file_is_a_checkpoint_error(uninterrupted, monkeypatch):
    """An OSError while hashing (EIO, a permission) is a CheckpointError like a wrong sha256, which
    agree_verify shares with every rank (any other exception would leave the others waiting in the gather)."""
    from megatron_mini import checkpoint

    def unreadable(path):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(checkpoint, "sha256_file", unreadable)
    path = os.path.join(uninterrupted[0].run_dir, "checkpoints", "step_000005")
    with pytest.raises(checkpoint.CheckpointError, match=r"model_pp00\.pt cannot be read \(Permission denied\)"):
        checkpoint.verify(path)


def _saved_tensors(cfg):
    from harness import make_trainer
    trainer = make_trainer(cfg)
    trainer.train_step()
    weights = {k: v for buf in trainer.buffers for k, v in buf.full_weights().items()}
    state = trainer.optimizer.state_dict()["state"]
    mesh = trainer.mesh                       # (plain values: tensors do not cross the process boundary)
    return (mesh.rank, mesh.stage_writer, {n: tuple(w.shape) for n, w in weights.items()},
            {n: {k: tuple(v.shape) for k, v in s.items()} for n, s in state.items()})


def test_only_the_stage_writer_holds_full_tensors(small_data, tmp_path):
    """tp=2 dp=2 ZeRO-1: the stage's writer (rank 0) gets every parameter's full weight and Adam state,
    the other ranks, which take part in the gathers, hold none (at scale each would otherwise keep the
    stage's 16 bytes per parameter in host memory during a save)."""
    cfg = small_config(small_data, tmp_path, tp=2, zero=1, gbs=4)
    results = sorted(spawn(4, _saved_tensors, cfg))
    for rank, writer, weights, state in results:
        assert writer == (rank == 0)
        if writer:
            assert set(weights) == set(state)
            assert all(state[n] == dict.fromkeys(("master", "exp_avg", "exp_avg_sq"), weights[n]) for n in weights)
            assert sum(math.prod(shape) for shape in weights.values()) == cfg.model.num_params()
        else:
            assert weights == {} and state == {}
