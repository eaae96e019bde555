"""Checkpoints: a resumed run continues exactly, and checkpoints load into other layouts."""
import errno
import math
import os
import re

import pytest

from harness import small_config, train_on_ranks
from ranks import spawn

# A resume into another layout sums the same fp32 gradients in another order: its losses after the resume differ
# from the uninterrupted run's by rounding alone, at most 2.0e-8 (relative) measured over these tests; 1e-6 is 50x
# that (about 8 fp32 ulps). A checkpoint that kept Adam's moments to bf16's 8 bits moved them by 1.4e-6, inside
# the 1e-5 these tests allowed. In the same layout a resume repeats the same sums: its losses are equal.
RESUME_RTOL = 1e-6


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
    if (world, layout) == (2, {}):
        assert resumed["loss"] == history["loss"][5:]
    for a, b in zip(history["loss"][5:], resumed["loss"], strict=True):
        assert abs(a - b) <= RESUME_RTOL * abs(a), (history["loss"][5:], resumed["loss"])


def test_resume_from_another_runs_directory_takes_its_newest_intact_checkpoint(uninterrupted, small_data, tmp_path):
    """resume=PATH of a run directory (as init_from takes): its newest checkpoint that verifies, step 5 when step
    10's weights are damaged, continued exactly into this run's directory; the other run's files stay as they were
    (its damaged checkpoint is not renamed: only the run's own directory is tidied, as resume=auto does there).
    The done line names the start's one evaluation by its step, not as a comparison with itself."""
    import shutil
    cfg, history = uninterrupted
    other = tmp_path / "other"
    shutil.copytree(cfg.run_dir, other)
    step10 = other / "checkpoints" / "step_000010"
    shard = next(p for p in sorted(step10.iterdir()) if p.suffix != ".json")
    shard.write_bytes(shard.read_bytes()[:-1] + bytes([shard.read_bytes()[-1] ^ 1]))
    listing = sorted(os.listdir(other / "checkpoints"))
    resumed = train_on_ranks(1, small_config(small_data, tmp_path / "fork", steps=10, resume=str(other),
                                             eval_interval=10))
    assert len(resumed["loss"]) == 5 and len(resumed["val_loss"]) == 1
    for a, b in zip(history["loss"][5:], resumed["loss"], strict=True):
        assert abs(a - b) <= RESUME_RTOL * abs(a), (history["loss"][5:], resumed["loss"])
    assert sorted(os.listdir(other / "checkpoints")) == listing
    log = (tmp_path / "fork" / "logs" / "rank0000.log").read_text()
    assert "skipped " + str(step10) in log
    assert f"| val loss {resumed['val_loss'][0][1]:.4f} (step 10) |" in log     # (its one evaluation: no "from")
    again = train_on_ranks(1, small_config(small_data, other, steps=10, resume=str(other)))   # (its own: resume=auto)
    assert again["loss"] == resumed["loss"]
    assert sorted(os.listdir(other / "checkpoints")) == ["latest", "step_000005", "step_000010", "step_000010.corrupt"]


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
        assert abs(a - b) <= RESUME_RTOL * abs(a), (history["loss"][3:], other["loss"])


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
    from megatron_mini.checkpoint import read_meta
    saved = [read_meta(os.path.join(d, "checkpoints", "step_000006"))["optimizer"]["scaler"]
             for d in (tmp_path / "full", tmp_path / "resumed")]
    assert saved[0] == saved[1] and saved[0]["skips_at_min"] == 3 and saved[0]["scale"] == 2.0 ** 37


def test_fp16_resumes_bitwise_right_after_a_skipped_step(small_data, tmp_path):
    """An fp16 run resumed from any step of its loss scaler's life continues bitwise as the run never stopped: losses,
    skipped steps, the scaler's state and the final weights. Scale 2^40 overflows; with hysteresis 2 the first
    overflow only counts down (step 1: saved mid-hysteresis), the second backs off by 2^-24 to 2^16 (step 2: saved
    right after a skipped step), then the steps are clean and the scale doubles after every 2 of them (step 3: saved
    one clean step into the growth interval). Resumed from steps 1 and 3 (step 2's scale: the test above): one that
    lost hysteresis_left or clean_steps would back off or grow at another step."""
    from megatron_mini.checkpoint import load_model_tensors, read_meta
    fp16 = dict(steps=4, save_interval=1, keep_checkpoints=4, gbs=4,
                **{"precision.dtype": "fp16", "precision.initial_loss_scale": 2.0 ** 40,
                   "precision.loss_scale_backoff_factor": 2.0 ** -24, "precision.loss_scale_growth_interval": 2})
    full = train_on_ranks(1, small_config(small_data, tmp_path / "full", **fp16))
    scalers = [read_meta(str(tmp_path / "full" / "checkpoints" / f"step_{k:06d}"))["optimizer"]["scaler"]
               for k in (1, 2, 3, 4)]
    assert [(s["scale"], s["hysteresis_left"], s["clean_steps"], s["skipped_steps"]) for s in scalers] == [
        (2.0 ** 40, 1, 0, 1), (2.0 ** 16, 0, 0, 2), (2.0 ** 16, 0, 1, 2), (2.0 ** 17, 2, 0, 2)]
    end = load_model_tensors(str(tmp_path / "full" / "checkpoints" / "step_000004"))
    for k in (1, 3):
        step = str(tmp_path / "full" / "checkpoints" / f"step_{k:06d}")
        resumed = train_on_ranks(1, small_config(small_data, tmp_path / f"from{k}", resume=step, **fp16))
        assert resumed["loss"] == full["loss"][k:], k
        assert resumed["summary"]["skipped_steps"] == full["summary"]["skipped_steps"] == 2, k
        last = str(tmp_path / f"from{k}" / "checkpoints" / "step_000004")
        assert read_meta(last)["optimizer"] == read_meta(str(tmp_path / "full" / "checkpoints" / "step_000004"))[
            "optimizer"], k
        weights = load_model_tensors(last)
        assert all(weights[name].equal(end[name]) for name in end), k


def test_a_branch_from_an_older_checkpoint_sets_the_newer_ones_aside(uninterrupted, small_data, tmp_path):
    """resume=PATH to step 5 of a run that reached step 10 (a rollback, as after a loss spike): step 10 is
    renamed step_000010.superseded (kept whole; no resume=auto or pruning counts it), the new branch's saves
    are kept and named by `latest` (keep_checkpoints=1 pruned the one just written before), resume=auto
    continues the branch, and metrics.jsonl holds the branch's lines only (the others moved aside). wandb logs
    the branch, and its continuation, to a new wandb run (wandb keeps the first value logged at a step)."""
    import json
    import shutil
    cfg, _ = uninterrupted
    run = tmp_path / "run"
    shutil.copytree(cfg.run_dir, run)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0}) + "\n" for s in (5, 10))
                                       + '{"step": 10, "lo')                     # a line a kill cut short
    files = sorted(os.listdir(run / "checkpoints" / "step_000010"))
    offline = {"wandb.mode": "offline"}
    branch = train_on_ranks(1, small_config(small_data, run, steps=7, keep_checkpoints=1,
                                            resume=str(run / "checkpoints" / "step_000005"), **offline))
    assert branch["checkpoint"] == str(run / "checkpoints" / "step_000007")
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_000007", "step_000010.superseded"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_000007"
    assert sorted(os.listdir(run / "checkpoints" / "step_000010.superseded")) == files
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == 5 and max(steps) == 7
    assert (run / "metrics.superseded.jsonl").read_text() == (json.dumps({"step": 10, "loss": 9.0})
                                                              + '\n{"step": 10, "lo\n')
    again = train_on_ranks(1, small_config(small_data, run, steps=8, keep_checkpoints=1, resume="auto", **offline))
    assert len(again["loss"]) == 1 and again["checkpoint"] == str(run / "checkpoints" / "step_000008")
    from compare_runs import iter_wandb_records, wandb_files

    from megatron_mini.logger import run_id
    assert json.loads((run / "branches.json").read_text()) == [5]
    assert run_id(str(run), "run").endswith("-b1")                       # (wandb's name: the run directory's)
    assert {r.run.run_id for f in wandb_files(str(run)) for r in iter_wandb_records(f)
            if r.WhichOneof("record_type") == "run"} == {run_id(str(run), "run")}


def _train_failing_to_start(cfg, failing, what):
    """train(cfg) on this rank, rank `failing`'s start failing: its model does not fit (its GPU's memory is full),
    or its log file cannot be opened (a directory stands at its path), or a bug; the error's type, message and
    reporter (the rank that prints a RunError's message)."""
    from megatron_mini import training
    if os.environ["RANK"] == str(failing) and what in ("model", "bug"):
        training.Trainer.__init__ = _raising(MemoryError("out of memory building the model") if what == "model" else
                                             TypeError("a bug"))
    with pytest.raises(Exception) as caught:
        training.train(cfg)
    return type(caught.value).__name__, str(caught.value), getattr(caught.value, "reporter", None)


@pytest.mark.parametrize("what", ["model", "log", "bug"])
@pytest.mark.parametrize("world", [1, 2])
def test_a_branch_that_fails_to_start_a_rank_leaves_the_run_as_it_was(world, what, uninterrupted, small_data,
                                                                       tmp_path):
    """resume=PATH to step 5 of a run that reached step 10, whose model does not fit on the last rank, or whose
    last rank cannot open its log: the run directory is untouched (step 10 not set aside, no branch recorded,
    metrics.jsonl whole), so resume=auto still continues from step 10: rank 0's writes wait until every rank has
    opened its log and built its model. Every rank raises the same RunError, which the failing rank reports
    (before, a rank that could not open its log ended alone, and the others waited in the next collective; then
    it raised its own error, a traceback). A bug is raised as it is on its rank, and the others name it."""
    import shutil
    cfg, _ = uninterrupted
    run = tmp_path / "run"
    shutil.copytree(cfg.run_dir, run)
    log = run / "logs" / f"rank{world - 1:04d}.log"
    if what == "log":
        log.unlink(missing_ok=True)
        log.mkdir(parents=True)
    metrics = (run / "metrics.jsonl").read_text()
    before = sorted(os.listdir(run / "checkpoints"))
    branch = small_config(small_data, run, steps=7, timeout_s=20, resume=str(run / "checkpoints" / "step_000005"))
    errors = spawn(world, _train_failing_to_start, branch, world - 1, what, init_group=False, timeout=120)
    own, told = {"model": (("MemoryError", "out of memory building the model"), "build its model"),
                 "bug": (("TypeError", "a bug"), "build its model"),
                 "log": (("IsADirectoryError", f"[Errno 21] Is a directory: '{log}'"), f"open its log {log}")}[what]
    shared = ("RunError", f"rank {world - 1} could not {told}: {own[0]}: {own[1]}", world - 1)
    assert errors == [shared] * (world - 1) + [(*own, None) if what == "bug" else shared], errors
    assert sorted(os.listdir(run / "checkpoints")) == before and "step_000010" in before
    assert not (run / "branches.json").exists() and (run / "metrics.jsonl").read_text() == metrics


def test_a_fresh_start_moves_an_earlier_attempts_metrics_aside(small_data, tmp_path):
    """A run directory whose first attempt died before its first checkpoint (in its first save), its metrics.jsonl
    ending in a line a kill cut short: the new run starts at step 0, metrics.jsonl holds its own lines alone (the torn
    one not glued to its first), the earlier attempt's are in metrics.superseded.jsonl, and its half-written save is
    removed, with a line in the log."""
    import json
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000002.tmp").mkdir(parents=True)
    (run / "checkpoints" / "step_000002.tmp" / "model_pp00_tp00.pt").write_bytes(b"PK\3\4")
    earlier = json.dumps({"step": 1, "loss": 9.0}) + "\n" + '{"step": 2, "lo'
    (run / "metrics.jsonl").write_text(earlier)
    history = train_on_ranks(1, small_config(small_data, run, steps=3, log_interval=1, resume="auto"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in rows] == list(zip((1, 2, 3), history["loss"]))
    assert (run / "metrics.superseded.jsonl").read_text() == earlier + "\n"
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_000003"]
    assert f" removed {run}/checkpoints/step_000002.tmp, the partial files of a save that a crash interrupted\n" in \
        (run / "logs" / "rank0000.log").read_text()


def _train_beside_a_busy_leftover(cfg, busy: str) -> dict:
    """train(cfg) on this spawned rank, where removing the directory `busy` fails as on NFS while a process of the
    killed job still holds one of its files open (EBUSY, its .nfs file): shutil.rmtree raises, or with
    ignore_errors leaves it (and its file) where it is."""
    import errno
    import shutil

    from harness import _train
    rmtree = shutil.rmtree

    def busy_rmtree(path, ignore_errors=False, *args, **kwargs):
        if str(path) == busy:
            if ignore_errors:
                return None
            raise OSError(errno.EBUSY, "Device or resource busy", os.path.join(busy, ".nfs0000000000000001"))
        return rmtree(path, ignore_errors, *args, **kwargs)
    shutil.rmtree = busy_rmtree
    return _train(cfg)


def test_a_leftover_save_that_cannot_be_removed_is_noted_not_a_failed_start(small_data, tmp_path):
    """A start removes what interrupted saves left (checkpoint.remove_interrupted); one that it cannot remove (here
    EBUSY) is a line in the log and stays, the others are removed and the run trains: it is no part of any
    checkpoint (resume=auto passes over it), so it never stopped a start before a start removed them. Nor does it
    stop the save of its own step (the step a crash in its save resumes to redo), hours later: the ranks write that
    one into step_N.tmp-2, rank 0's choice, published as step_N all the same (pp=2: each rank writes files of its
    own there). A start removes such a step_N.tmp-2 as it removes a step_N.tmp."""
    run = tmp_path / "run"
    for leftover in ("step_000001.tmp", "step_000001.tmp-2", "step_000002.tmp"):
        (run / "checkpoints" / leftover).mkdir(parents=True)
    busy = str(run / "checkpoints" / "step_000002.tmp")
    (run / "checkpoints" / "step_000002.tmp" / "model_pp00_tp00.pt").write_bytes(b"PK\3\4")
    cfg = small_config(small_data, run, steps=2, resume="auto", pp=2)
    history = spawn(2, _train_beside_a_busy_leftover, cfg, busy, init_group=False)[0]
    assert len(history["loss"]) == 2
    assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_000002", "step_000002.tmp"]
    assert os.listdir(busy) == ["model_pp00_tp00.pt"]
    assert sorted(os.listdir(run / "checkpoints" / "step_000002")) == [
        "meta.json", "model_pp00_tp00.pt", "model_pp01_tp00.pt", "optim_pp00_tp00_dp00.pt", "optim_pp01_tp00_dp00.pt",
        "tokenizer.model"]
    from megatron_mini.checkpoint import verify
    verify(str(run / "checkpoints" / "step_000002"))
    log = (run / "logs" / "rank0000.log").read_text()
    assert f" could not remove {busy}, the partial files of a save that a crash interrupted (OSError: [Errno 16] " \
           f"Device or resource busy: '{busy}/.nfs0000000000000001'): remove it by hand\n" in log, log
    for removed in ("step_000001.tmp", "step_000001.tmp-2"):
        assert f" removed {run}/checkpoints/{removed}, the partial files of a save that a crash interrupted\n" in log


def test_a_second_branch_past_the_same_step_sets_its_newer_checkpoint_aside_too(uninterrupted, small_data, tmp_path):
    """Two rollbacks to step 5, each past a step 10: the second step_000010 goes aside as
    step_000010.superseded-2, beside the first branch's step_000010.superseded, and branches.json records both
    (with wandb disabled: a later run with wandb on logs to <id>-b2)."""
    import json
    import shutil

    from megatron_mini.logger import run_id
    run = tmp_path / "run"
    shutil.copytree(uninterrupted[0].run_dir, run)
    ckpt = run / "checkpoints"
    files = sorted(os.listdir(ckpt / "step_000010"))
    for steps in (10, 6):
        train_on_ranks(1, small_config(small_data, run, steps=steps, resume=str(ckpt / "step_000005")))
    assert sorted(os.listdir(ckpt)) == ["latest", "step_000005", "step_000006", "step_000010.superseded",
                                        "step_000010.superseded-2"]
    assert sorted(os.listdir(ckpt / "step_000010.superseded")) == files
    assert json.loads((ckpt / "step_000010.superseded-2" / "meta.json").read_text())["step"] == 10
    assert json.loads((run / "branches.json").read_text()) == [5, 5] and run_id(str(run), "run").endswith("-b2")


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
    with pytest.raises(checkpoint.CheckpointError, match=r"model_pp00_tp00\.pt cannot be read \(Permission denied\)"):
        checkpoint.verify(path)


MACHINE_FAILURES = [(OSError(5, "Input/output error"), "OSError: [Errno 5] Input/output error"),
                    (PermissionError(13, "Permission denied"), "PermissionError: [Errno 13] Permission denied"),
                    (MemoryError(), "MemoryError"),
                    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
                                  "memory: you tried to allocate 1125899906842624 bytes."), "RuntimeError: [enforce"),
                    (RuntimeError("unable to mmap 1024 bytes from file <m.pt>: Cannot allocate memory (12)"),
                     "RuntimeError: unable to mmap 1024 bytes")]
NOT_THE_TENSORS = [(__import__("pickle").UnpicklingError("Weights only load failed."), "UnpicklingError: Weights"),
                   (RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory"),
                    "RuntimeError: PytorchStreamReader failed")]


def _load_errors(cfg, path, errors) -> list:
    """The CheckpointError of a Trainer of `cfg` loading checkpoint `path` while its files' torch.load raises each of
    `errors`, in turn."""
    from harness import make_trainer

    from megatron_mini import checkpoint
    trainer, said = make_trainer(cfg), []
    for error in errors:
        checkpoint._load_mapped = _raising(error)        # (this spawned rank's module)
        with pytest.raises(checkpoint.CheckpointError) as err:
            trainer.load(path)
        said.append(str(err.value))
    return said


def test_a_checkpoint_that_the_machine_cannot_read_is_not_called_damaged(uninterrupted, monkeypatch, small_data,
                                                                         tmp_path):
    """A file of a verified checkpoint that cannot be read, for the disk (EIO, a permission) or the memory (Python's
    MemoryError, torch's allocator, its mmap), is said as what it is by the tools (inference.read_checkpoint) and by
    a resume (checkpoint.load, on every rank), not as a damaged checkpoint or one of another model; a file that holds
    other objects keeps that message, and a failure of neither kind (a bug) is not taken for one."""
    from megatron_mini import checkpoint, inference
    path = os.path.join(uninterrupted[0].run_dir, "checkpoints", "step_000005")
    for error, said in MACHINE_FAILURES + NOT_THE_TENSORS:
        monkeypatch.setattr(checkpoint, "_load_mapped", _raising(error))
        with pytest.raises(checkpoint.CheckpointError) as err:
            inference.read_checkpoint(path)
        damaged = f"{path}: its files do not hold the tensors its meta.json lists (model_pp00_tp00.pt: {said}"
        read = f"{path}: its files could not be read ({said}"
        assert str(err.value).startswith(read if (error, said) in MACHINE_FAILURES else damaged), str(err.value)
    monkeypatch.setattr(checkpoint, "_load_mapped", _raising(ZeroDivisionError("a bug")))
    with pytest.raises(ZeroDivisionError):
        inference.read_checkpoint(path)
    monkeypatch.undo()
    cases = MACHINE_FAILURES + NOT_THE_TENSORS
    messages = spawn(1, _load_errors, small_config(small_data, tmp_path), path, [e for e, _ in cases])[0]
    for (error, said), message in zip(cases, messages, strict=True):
        read = f"{path} could not be read ({said}"
        fits = f"{path} does not fit this run's model (model_pp00_tp00.pt: {said}"
        assert message.startswith(read if (error, said) in MACHINE_FAILURES else fits), message


def _load_with_a_bug(cfg, path, buggy: int) -> tuple:
    """A Trainer of `cfg` loading checkpoint `path`, where rank `buggy`'s torch.load of its files raises what no
    checkpoint makes it raise (a bug of ours): the error's type, message and reporter on this rank."""
    from harness import make_trainer

    from megatron_mini import checkpoint
    trainer = make_trainer(cfg)
    if trainer.mesh.rank == buggy:
        checkpoint._load_mapped = _raising(ZeroDivisionError("a bug"))
    with pytest.raises(Exception) as caught:
        trainer.load(path)
    return type(caught.value).__name__, str(caught.value), getattr(caught.value, "reporter", None)


def test_a_bug_while_loading_a_checkpoint_is_not_called_another_model(uninterrupted, small_data, tmp_path):
    """A failure that is neither the machine's nor a checkpoint that does not fit (a bug in our code, here a
    ZeroDivisionError on rank 1) is raised as it is on its rank, with its traceback, and the other ranks raise a
    RunError naming it, reported by that rank: none waits in a collective, and none says "does not fit this run's
    model", which sent a user to look for another checkpoint (it was every rank's CheckpointError)."""
    from megatron_mini.checkpoint import BUG
    path = os.path.join(uninterrupted[0].run_dir, "checkpoints", "step_000005")
    errors = spawn(2, _load_with_a_bug, small_config(small_data, tmp_path), path, 1)
    assert errors == [("RunError", f"rank 1 could not load {path}: ZeroDivisionError: a bug {BUG}", 1),
                      ("ZeroDivisionError", "a bug", None)], errors


def _load_error(cfg, path) -> str:
    """The CheckpointError of a Trainer of `cfg` loading checkpoint `path` (its resume)."""
    from harness import make_trainer

    from megatron_mini.checkpoint import CheckpointError
    with pytest.raises(CheckpointError) as err:
        make_trainer(cfg).load(path)
    return str(err.value)


def test_a_resume_refuses_optimizer_state_of_another_dtype(uninterrupted, small_data, tmp_path):
    """An optimizer file that verifies but holds a moment as int64 (a checkpoint converted by other code: its
    exp_avg_sq of ~1e-8 all 0, whose update is then lr * exp_avg / eps, 1e6 times too large) is one CheckpointError
    naming the file, the tensor, its dtype and the float32 a save writes; it was cast into the fp32 state silently."""
    import json
    import shutil

    import torch

    from megatron_mini.checkpoint import sha256_file
    path = tmp_path / "step_000005"
    shutil.copytree(os.path.join(uninterrupted[0].run_dir, "checkpoints", "step_000005"), path)
    optim = path / "optim_pp00_tp00_dp00.pt"
    saved = torch.load(optim, weights_only=True)
    saved["head.ln_f.bias"]["exp_avg_sq"] = saved["head.ln_f.bias"]["exp_avg_sq"].long()
    torch.save(saved, optim)
    meta = json.loads((path / "meta.json").read_text())
    meta["files"][optim.name] = sha256_file(str(optim))
    (path / "meta.json").write_text(json.dumps(meta))
    message = spawn(1, _load_error, small_config(small_data, tmp_path / "run"), str(path))[0]
    assert message == (f"{path}: its files do not hold the tensors its meta.json lists ({optim.name}: head.ln_f.bias's "
                       f"exp_avg_sq is int64 [64], not float32 [64]): a damaged checkpoint, or one of other code"), \
        message


class _OtherCode:
    """An object of a class no checkpoint holds (a weights_only torch.load refuses it)."""


def _copy_with(src, dst, name=None, edit=None, meta_edit=None) -> str:
    """A copy of checkpoint `src` at `dst`: its file `name` holds `edit` (bytes, as they are) or what `edit` makes of
    its objects (torch.save), with its sha256 in meta.json (it verifies, and fails only where it is read); meta.json
    edited by `meta_edit`."""
    import json
    import shutil

    import torch

    from megatron_mini.checkpoint import sha256_file
    shutil.copytree(src, dst)
    meta = json.loads((dst / "meta.json").read_text())
    if name:
        f = dst / name
        f.write_bytes(edit) if isinstance(edit, bytes) else torch.save(edit(torch.load(f, weights_only=True)), f)
        meta["files"][name] = sha256_file(str(f))
    if meta_edit:
        meta_edit(meta)
    (dst / "meta.json").write_text(json.dumps(meta))
    return str(dst)


def _load_outcomes(cases, how: str = "load") -> list:
    """(type, message) of what a Trainer of each (cfg, path) of `cases` raises loading checkpoint `path` by its method
    `how` (load: a resume; init_weights: init_from)."""
    from harness import make_trainer
    said = []
    for cfg, path in cases:
        with pytest.raises(Exception) as caught:
            getattr(make_trainer(cfg), how)(path)
        said.append((type(caught.value).__name__, str(caught.value)))
    return said


def test_each_kind_of_foreign_checkpoint_file_is_said_where_it_is_found(uninterrupted, small_data, tmp_path):
    """Files that verify but are not what meta.json lists (not a torch file, a pickle of another class, a tensor
    renamed, a mapping that is a list) and a checkpoint whose tensors are not this model's (another split, another
    shape, a block it lacks) are each one CheckpointError naming what was found, by a resume (checkpoint.load) and,
    for the files, by the tools (inference.read_checkpoint)."""
    from megatron_mini import checkpoint, inference
    src = os.path.join(uninterrupted[0].run_dir, "checkpoints", "step_000005")
    weights, optim = "model_pp00_tp00.pt", "optim_pp00_tp00_dp00.pt"
    files = {   # name: (the copy, what both readers say of it)
        "text": (_copy_with(src, tmp_path / "text", weights, b"not a torch file\n"),
                 f"{weights}: RuntimeError: mmap can only be used with files saved with"),
        "other-class": (_copy_with(src, tmp_path / "other-class", weights,
                                   lambda saved: {**saved, "head.ln_f.bias": _OtherCode()}),
                        f"{weights}: UnpicklingError: Weights only load failed."),
        "renamed": (_copy_with(src, tmp_path / "renamed", weights,
                               lambda saved: {("head.ln_f.b" if k == "head.ln_f.bias" else k): v
                                              for k, v in saved.items()}),
                    f"{weights} holds no head.ln_f.bias)"),
        "a-list": (_copy_with(src, tmp_path / "a-list", weights, lambda saved: list(saved.values())),
                   f"{weights} holds a list, not a mapping of names to tensors)"),
    }
    for name, (path, said) in files.items():
        with pytest.raises(checkpoint.CheckpointError) as err:
            inference.read_checkpoint(path)
        assert str(err.value).startswith(f"{path}: its files do not hold the tensors its meta.json lists ({said}"), \
            (name, str(err.value))
    split = _copy_with(src, tmp_path / "split", meta_edit=lambda meta: meta["tensors"]["head.ln_f.bias"].__setitem__(
        1, 0))                                      # (a replicated LayerNorm bias, as if split over TP on dim 0)
    garbled = _copy_with(src, tmp_path / "garbled", optim, lambda saved: {**saved, "head.ln_f.bias": []})
    cfg = small_config(small_data, tmp_path / "run")
    resumes = {**{name: (cfg, path, said) for name, (path, said) in files.items()},
               "split": (cfg, split, "its head.ln_f.bias is [64] split over TP as (dim, blocks) (0, 1), this run's "
                                     "model's [64] split as (None, 1))"),
               "garbled": (cfg, garbled, f"{optim} holds head.ln_f.bias's optimizer state as a list, not a "
                                         f"mapping)"),
               "other-shape": (small_config(small_data, tmp_path / "run", **{"model.hidden_size": 32}), src,
                               "its head.ln_f.bias is [64] split over TP as (dim, blocks) (None, 1), this run's "
                               "model's [32] split as (None, 1))"),
               "more-blocks": (small_config(small_data, tmp_path / "run", **{"model.num_layers": 9}), src,
                               "it has no blocks.8.")}
    outcomes = spawn(1, _load_outcomes, [(c, p) for c, p, _ in resumes.values()])[0]
    for (name, (_, path, said)), (kind, message) in zip(resumes.items(), outcomes, strict=True):
        assert kind == "CheckpointError" and message.startswith(f"{path} does not fit this run's model ({said}"), \
            (name, kind, message)


def test_a_16_bit_checkpoint_without_its_fp32_master_is_refused(small_data, tmp_path):
    """A bf16 checkpoint whose optimizer file lacks a parameter's fp32 master is one line naming it, resumed in bf16
    or in fp32, and as init_from: its bf16 weight, which an fp32 checkpoint's own weights stand for, was taken for the
    master silently (its low 16 bits lost). The same checkpoint with its masters loads (they are what an fp32 run
    resumes from: test_a_bf16_checkpoint_resumes_exactly_and_in_fp32_from_its_master)."""
    import torch

    from megatron_mini.checkpoint import NotTheTensors, ShardReader, read_meta
    bf16 = {"precision.dtype": "bf16"}
    src = train_on_ranks(1, small_config(small_data, tmp_path / "src", steps=1, gbs=2, **bf16))["checkpoint"]
    optim, name = "optim_pp00_tp00_dp00.pt", "head.ln_f.bias"
    lacking = _copy_with(src, tmp_path / "no-master", optim,
                         lambda saved: {**saved, name: {k: v for k, v in saved[name].items() if k != "master"}})
    assert ShardReader(src, read_meta(src)).full(name, "master").dtype == torch.float32
    with pytest.raises(NotTheTensors, match=f"^{optim} holds no master of {name}$"):
        ShardReader(lacking, read_meta(lacking)).full(name, "master")
    runs = [small_config(small_data, tmp_path / "run", gbs=2, **dtype) for dtype in (bf16, {})]    # (bf16, fp32)
    said = spawn(1, _load_outcomes, [(cfg, lacking) for cfg in runs])[0]
    said += spawn(1, _load_outcomes, [(runs[1], lacking)], "init_weights")[0]
    assert said == [("CheckpointError", f"{lacking} does not fit this run's model ({optim} holds no master of {name}): "
                     f"a checkpoint of another model or of older code; resume from another checkpoint, or start a "
                     f"new run under another run_name.")] * 3, said


def _load_with_bugs(cfg, path, bugs) -> list:
    """(type, message) of what a Trainer of `cfg` raises loading checkpoint `path` while method `name` of class
    `owner` raises `error` (a bug of ours), for each (owner, name, error) of `bugs` in turn."""
    from harness import make_trainer
    trainer, said = make_trainer(cfg), []
    for owner, name, error in bugs:
        real = getattr(owner, name)
        setattr(owner, name, _raising(error))
        with pytest.raises(Exception) as caught:
            trainer.load(path)
        setattr(owner, name, real)
        said.append((type(caught.value).__name__, str(caught.value)))
    return said


def test_a_type_or_runtime_error_of_ours_while_loading_is_a_bug_not_another_model(uninterrupted, small_data,
                                                                                  tmp_path, monkeypatch):
    """A TypeError or RuntimeError raised by our code inside checkpoint.load (past torch.load of a file, which raises
    those for a foreign file) is a bug: raised as it is, with its traceback, not said as "does not fit this run's
    model" (a whole list of exception types was read as that); inference.read_checkpoint raises it too."""
    from megatron_mini import checkpoint, inference
    from megatron_mini.data_parallel import GradBuffer
    from megatron_mini.optimizer import Optimizer
    path = os.path.join(uninterrupted[0].run_dir, "checkpoints", "step_000005")
    bugs = [(checkpoint.ShardReader, "_tensor", TypeError("a bug")),
            (checkpoint.ShardReader, "local", RuntimeError("a bug")),
            (GradBuffer, "load_weights", AttributeError("a bug")),
            (Optimizer, "load_state_dict", KeyError("a bug"))]
    said = spawn(1, _load_with_bugs, small_config(small_data, tmp_path), path, bugs)[0]
    assert said == [(type(error).__name__, str(error)) for _, _, error in bugs], said
    for error in (TypeError("a bug"), RuntimeError("a bug"), KeyError("a bug")):
        monkeypatch.setattr(checkpoint.ShardReader, "_tensor", _raising(error))
        with pytest.raises(type(error)):
            inference.read_checkpoint(path)


def _save_once(cfg, path):
    """One step, then a save with the ledger reset: (rank, the save's collectives)."""
    from harness import make_trainer
    trainer = make_trainer(cfg)
    trainer.train_step()
    trainer.mesh.ledger.reset()
    trainer.save(path, {})
    from megatron_mini.replicas import shared
    groups = shared(trainer.buffers, trainer.optimizer, trainer.mesh)
    hashes = {g.name: 8 * g.size * len(tensors) for g, tensors in groups}
    return trainer.mesh.rank, trainer.mesh.ledger.summary(), hashes


@pytest.mark.parametrize("layout", [{"tp": 2, "zero": 1}, {"pp": 2, "zero": 1}, {"tp": 2}, {"tp": 2, "pp": 2},
                                    {"tp": 2, "zero": 1, "precision.dtype": "bf16"}],
                         ids=["tp2-dp2-zero1", "pp2-dp2-zero1", "tp2-dp2", "tp2-pp2", "tp2-dp2-zero1-bf16"])
def test_a_save_writes_every_value_once_and_moves_no_tensor(layout, small_data, tmp_path):
    """4 ranks: each writes its own slices only. The weight files hold every parameter once (a TP-replicated
    one on TP rank 0, the tied embedding on the first stage: the count is the model's), each parameter's
    optimizer state is tiled by its TP slices' flat ranges with no gap or overlap (with ZeRO-1 every DP rank
    writes its shard), and the files' tensors are 12 bytes per parameter in fp32 (the weight is its own master)
    and 14 in bf16 (2 + an fp32 master and two moments). The save's only collectives carry text: the failures'
    all-gathers (empty), the name of its directory (rank 0's broadcast), the index's gather onto rank 0 (10 to 20
    KB here), and the replica check's hashes (one all-gather of 8 bytes per tensor a group shares: replicas.py): no
    tensor is gathered onto a writer (gathering the weights alone would be 4 bytes per parameter)."""
    import json

    import torch
    cfg = small_config(small_data, tmp_path / "run", gbs=4, **layout)
    bf16 = cfg.precision.dtype == "bf16"
    results = spawn(4, _save_once, cfg, str(tmp_path))
    ckpt = tmp_path / "checkpoints" / "step_000001"
    meta = json.loads((ckpt / "meta.json").read_text())
    tp, dp = layout.get("tp", 1), 4 // (layout.get("tp", 1) * layout.get("pp", 1))
    weights = [f for f in meta["files"] if f.startswith("model_")]
    optim = [f for f in meta["files"] if f.startswith("optim_")]
    assert len(weights) == 4 // dp and len(optim) == (4 if cfg.zero else 4 // dp)
    numel, nbytes = {}, 0
    for f in weights:
        for name, t in torch.load(ckpt / f, weights_only=True).items():
            numel[name] = numel.get(name, 0) + t.numel()
            nbytes += t.nbytes
            assert t.dtype == (torch.bfloat16 if bf16 else torch.float32), (name, t.dtype)
    assert sum(numel.values()) == cfg.model.num_params()
    for name, total in numel.items():
        assert total == math.prod(meta["tensors"][name][0]), name
    tiles = {}
    for f in optim:
        saved, shard = torch.load(ckpt / f, weights_only=True), meta["shards"][f]
        for name, (lo, hi) in shard["ranges"].items():
            assert sorted(saved[name]) == ["exp_avg", "exp_avg_sq"] + (["master"] if bf16 else []), name
            assert all(t.numel() == hi - lo and t.dtype == torch.float32 for t in saved[name].values()), name
            nbytes += sum(t.nbytes for t in saved[name].values())
            tiles.setdefault((name, shard["tp"]), []).append((lo, hi))
    assert nbytes == (14 if bf16 else 12) * cfg.model.num_params()
    for (name, rank), ranges in tiles.items():
        shape, tp_dim, _ = meta["tensors"][name]
        ranges.sort()
        assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), (name, ranges)
        assert ranges[-1][1] == math.prod(shape) // (tp if tp_dim is not None else 1), (name, ranges)
    assert sorted(tiles) == sorted((name, r) for name, (_, tp_dim, _) in meta["tensors"].items()
                                   for r in range(tp if tp_dim is not None else 1))
    for rank, ledger, hashes in results:
        assert {g: ledger.pop((g, "all_gather")) for g in hashes} == {g: (1, n) for g, n in hashes.items()}, rank
        assert set(ledger) == {("world", op) for op in ("all_reduce", "all_gather", "gather", "broadcast")}, \
            (rank, ledger)
        # three failure checks, all empty: of the run's own writes (Trainer.save), then the save's two; before them
        # rank 0 names the directory it made (two broadcasts: its length, then the text)
        assert ledger[("world", "all_gather")] == (3, 3 * 4), (rank, ledger)
        assert ledger[("world", "broadcast")][0] == 2, (rank, ledger)
        assert ledger[("world", "gather")][0] == 1, (rank, ledger)             # the index, once, onto rank 0
        assert sum(n for _, n in ledger.values()) < cfg.model.num_params(), (rank, ledger)   # < 1/4 of fp32 weights


def _raising(error):
    """A stand-in for any function or method (checkpoint._load_mapped, os.fsync, ...): it raises `error`."""
    def raise_(*args, **kwargs):
        raise error
    return raise_


def _save_failing(cfg, path, where):
    """One step, then a save in which one rank fails in a way that is neither a full disk nor torch's: rank 0 cannot
    make the save's directory (PermissionError), rank 1 cannot copy its optimizer state to the host (MemoryError), or
    rank 0 cannot write meta.json (ValueError), or rank 0 cannot write `latest` once the checkpoint is published
    (naming: a full disk).
    Returns the RunError's message on this rank."""
    from harness import make_trainer

    from megatron_mini import checkpoint
    from megatron_mini.config import RunError
    trainer = make_trainer(cfg)
    trainer.train_step()
    if where == "creating" and trainer.mesh.rank == 0:
        checkpoint.os.makedirs = _raising(PermissionError(13, "Permission denied"))
    if where == "writing" and trainer.mesh.rank == 1:
        trainer.optimizer.saved_state = _raising(MemoryError("cannot allocate 1.2 GiB"))
    if where == "publishing" and trainer.mesh.rank == 0:          # (meta.json alone: the tokenizer's file is written
        write, refuse = checkpoint.atomic_write, _raising(ValueError("not JSON"))    # with the others, before)
        checkpoint.atomic_write = lambda path, data: (refuse if path.endswith("meta.json") else write)(path, data)
    if where == "naming" and trainer.mesh.rank == 0:
        write, refuse = checkpoint.atomic_write, _raising(OSError(28, "No space left on device"))
        checkpoint.atomic_write = lambda path, data: (refuse if path.endswith("latest") else write)(path, data)
    with pytest.raises(RunError) as caught:
        trainer.save(path, {})
    return str(caught.value)


@pytest.mark.parametrize("where,rank,why", [("creating", 0, "its directory: PermissionError: [Errno 13] Permission "
                                                                "denied"),
                                            ("writing", 1, "its files: MemoryError: cannot allocate 1.2 GiB"),
                                            ("publishing", 0, "it: ValueError: not JSON")])
def test_any_failure_of_a_rank_during_a_save_stops_every_rank(where, rank, why, small_data, tmp_path):
    """Whatever one rank raises while saving, every rank raises the same RunError naming it (none waits in the next
    collective until timeout_s), and nothing of the save is left; where its directory could not be made, the message
    speaks of no partial files removed."""
    cfg = small_config(small_data, tmp_path / "run", gbs=4)
    messages = spawn(2, _save_failing, cfg, str(tmp_path), where)
    assert messages[0] == messages[1], messages
    removed = "Checkpoints/latest" if where == "creating" else "Its partial files were removed; checkpoints/latest"
    assert f"failed on rank {rank} while {where} {why}. {removed} still names the last good checkpoint (none)." in \
        messages[0], messages
    assert not list((tmp_path / "checkpoints").glob("*")), list((tmp_path / "checkpoints").glob("*"))


def _saves_in_order(cfg, path):
    """Two steps, each saved (keep_checkpoints=1: the second prunes the first); rank 0's directory syncs and removals
    of directories that exist, in order, as (what, path relative to `path`)."""
    from harness import make_trainer

    from megatron_mini import checkpoint
    events, sync, rmtree = [], checkpoint.sync_dir, checkpoint.shutil.rmtree

    def synced(d):
        events.append(("sync", os.path.relpath(d, path)))
        sync(d)

    def removed(d, **kwargs):
        if os.path.isdir(d):
            events.append(("remove", os.path.relpath(d, path)))
        rmtree(d, **kwargs)
    checkpoint.sync_dir, checkpoint.shutil.rmtree = synced, removed
    trainer = make_trainer(cfg)
    for _ in range(2):
        trainer.train_step()
        trainer.save(path, {})
    return events


def test_a_save_syncs_its_directories_before_it_prunes(small_data, tmp_path):
    """Rank 0 syncs step_N.tmp (its files' names) before the rename that publishes it, and checkpoints/ (the rename)
    after it, before any older checkpoint is removed: a power cut after the pruning cannot take the new one too."""
    cfg = small_config(small_data, tmp_path / "run", gbs=4, keep_checkpoints=1)
    events = spawn(2, _saves_in_order, cfg, str(tmp_path))[0]
    assert events == [("sync", "checkpoints/step_000001.tmp"), ("sync", "checkpoints"),
                      ("sync", "checkpoints/step_000002.tmp"), ("sync", "checkpoints"),
                      ("remove", "checkpoints/step_000001")], events


def test_sync_dir_lets_a_file_system_that_does_not_sync_directories_be(tmp_path, monkeypatch):
    """files.sync_dir: EINVAL or EOPNOTSUPP from fsync (a file system that does not sync directories) is no failure;
    an I/O error is (the save's failure)."""
    from megatron_mini import files
    for code in (errno.EINVAL, errno.EOPNOTSUPP, errno.EIO):
        monkeypatch.setattr(files.os, "fsync", _raising(OSError(code, os.strerror(code))))
        if code == errno.EIO:
            with pytest.raises(OSError, match="Input/output error"):
                files.sync_dir(tmp_path)
        else:
            files.sync_dir(tmp_path)


def test_a_failure_to_name_a_published_checkpoint_in_latest_says_it_is_whole(small_data, tmp_path):
    """A failure after the rename (rank 0 cannot write `latest`: a full disk) stops every rank with one message that
    says the checkpoint was saved whole, not that its files were removed; it is kept, and a resume takes it."""
    from megatron_mini import checkpoint
    cfg = small_config(small_data, tmp_path / "run", gbs=4)
    messages = spawn(2, _save_failing, cfg, str(tmp_path), "naming")
    saved = tmp_path / "checkpoints" / "step_000001"
    assert messages[0] == messages[1] == (
        f"Checkpoint {saved} was saved whole (resume=auto takes it: the newest that verifies, whatever "
        f"checkpoints/latest says), but rank 0 then failed while naming it in checkpoints/latest and removing older "
        f"checkpoints: OSError: [Errno 28] No space left on device."), messages
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_000001"]
    found = checkpoint.newest(str(tmp_path))
    assert found.path == str(saved) and found.notes == [
        f"checkpoints/latest is missing or unreadable; took the newest complete checkpoint, {saved}"]


def _train_with_a_full_disk_on_rank_0(cfg):
    """train(cfg) on this rank, rank 0 failing to cut metrics.jsonl at the start (its disk is full); returns the
    RunError's message."""
    from megatron_mini import training
    from megatron_mini.config import RunError
    training.cut_metrics = _raising(OSError(28, "No space left on device"))      # only rank 0 calls it
    with pytest.raises(RunError) as caught:
        training.train(cfg)
    return str(caught.value)


def test_a_failure_of_rank_0s_run_directory_writes_stops_every_rank(small_data, tmp_path):
    """Before the first step rank 0 alone writes to the run directory (the config, branches.json, the checkpoints
    set aside, metrics.jsonl cut at the start): when that fails, every rank stops with rank 0's message, at once,
    rather than rank 0 alone while the others wait for it in a collective until timeout_s."""
    cfg = small_config(small_data, tmp_path / "run", gbs=4, steps=2, timeout_s=30)
    messages = spawn(2, _train_with_a_full_disk_on_rank_0, cfg, timeout=120)
    assert messages[0] == messages[1], messages
    assert (f"rank 0 could not write to the run directory {cfg.run_dir}: OSError: [Errno 28] No space left on "
            f"device") in messages[0], messages


def _train_failing(cfg, name, fails):
    """train(cfg) on this rank, the callable `name` ("module:attribute", the attribute's name dotted) replaced on
    rank 0 alone by fails(real, *args); the RunError's message."""
    import functools
    import importlib

    from megatron_mini import training
    from megatron_mini.config import RunError
    module, path = name.split(":")
    *parents, attr = path.split(".")
    owner = functools.reduce(getattr, parents, importlib.import_module(module))
    real = getattr(owner, attr)
    if os.environ["RANK"] == "0":
        setattr(owner, attr, lambda *args, **kwargs: fails(real, *args, **kwargs))
    with pytest.raises(RunError) as caught:
        training.train(cfg)
    return str(caught.value)


def _full_disk_from(key, step, real, logger, at, metrics):
    """RunLogger.log on a disk that fills up at the line of `step` holding `key` (and stays full)."""
    if logger.enabled and (at, "val_loss" in metrics) >= (step, key == "val_loss"):
        raise OSError(28, "No space left on device")
    real(logger, at, metrics)


def _full_disk_for(name, real, path, data):
    """atomic_write failing for the files called `name` (a full disk)."""
    if os.path.basename(path) == name:
        raise OSError(28, "No space left on device")
    real(path, data)


def _unopenable(real, run_dir, *args, enabled):
    """RunLogger, whose metrics.jsonl rank 0 may not open (a file of another user's)."""
    if enabled:
        raise PermissionError(13, "Permission denied", os.path.join(run_dir, "metrics.jsonl"))
    return real(run_dir, *args, enabled=enabled)


def _logged(run_dir):
    """metrics.jsonl's lines, less the timing figures (which differ between any two runs)."""
    import json
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k in ("step", "loss", "lr", "grad_norm", "val_loss")}
                for line in f]


METRICS_RUN = dict(gbs=4, steps=6, save_interval=2, log_interval=1, eval_interval=3, eval_iters=1, timeout_s=20)


@pytest.fixture(scope="module")
def logged_run(small_data, tmp_path_factory):
    """METRICS_RUN on 2 ranks, uninterrupted: (its history, its metrics.jsonl's lines)."""
    cfg = small_config(small_data, tmp_path_factory.mktemp("logged"), **METRICS_RUN)
    return train_on_ranks(2, cfg), _logged(cfg.run_dir)


@pytest.mark.parametrize("key,step,stopped,last", [
    ("loss", 5, 5, 4),         # found in the next step's loss all-reduce
    ("loss", 3, 3, 2),         # in the evaluation after it
    ("loss", 4, 4, 2),         # before the save after it: no checkpoint past a line rank 0 could not write
    ("val_loss", 6, 6, 4),     # the last evaluation's line, before the last save
], ids=["step", "then-evaluation", "then-save", "last-evaluation"])
def test_a_failure_of_rank_0s_metrics_writes_stops_every_rank_and_loses_nothing(key, step, stopped, last,
                                                                                 logged_run, small_data, tmp_path):
    """Rank 0 alone writes metrics.jsonl: when a line cannot be written (a full disk), every rank stops with rank
    0's message within a step, rather than rank 0 alone while the others wait for it in a collective until
    timeout_s; no checkpoint is saved past the line, so resume=auto continues exactly and metrics.jsonl ends
    as the uninterrupted run's."""
    import functools
    history, lines = logged_run
    cfg = small_config(small_data, tmp_path / "run", **METRICS_RUN)
    messages = spawn(2, _train_failing, cfg, "megatron_mini.logger:RunLogger.log",
                     functools.partial(_full_disk_from, key, step), init_group=False, timeout=120)
    newest = os.path.join(cfg.run_dir, "checkpoints", f"step_{last:06d}")
    assert messages[0] == messages[1], messages
    assert messages[0] == (f"rank 0 could not write {cfg.run_dir}/metrics.jsonl: OSError: [Errno 28] No space left "
                           f"on device (stopped after step {stopped}; the last checkpoint: {newest})"), messages
    assert sorted(os.listdir(os.path.join(cfg.run_dir, "checkpoints"))) == \
        ["latest"] + [f"step_{s:06d}" for s in (2, 4) if s <= last]
    with open(os.path.join(cfg.run_dir, "checkpoints", "latest")) as f:
        assert f.read().strip() == os.path.basename(newest)
    resumed = train_on_ranks(2, small_config(small_data, cfg.run_dir, resume="auto", **METRICS_RUN))
    assert resumed["loss"] == history["loss"][last:]
    assert _logged(cfg.run_dir) == lines


@pytest.mark.parametrize("name,module", [("summary.json", "logger"), ("history.json", "training")])
def test_a_failure_of_rank_0s_writes_at_the_end_stops_every_rank(name, module, small_data, tmp_path):
    """After the last collective of the run rank 0 alone writes summary.json and history.json: when it cannot,
    every rank ends with rank 0's message (exit 1 everywhere: the run's record is incomplete), not rank 0 alone
    while the others report success; the last checkpoint, saved before, is whole."""
    import functools

    from megatron_mini.checkpoint import verify
    cfg = small_config(small_data, tmp_path / "run", gbs=4, steps=2, timeout_s=20)
    messages = spawn(2, _train_failing, cfg, f"megatron_mini.{module}:atomic_write",
                     functools.partial(_full_disk_for, name), init_group=False, timeout=120)
    last = os.path.join(cfg.run_dir, "checkpoints", "step_000002")
    assert messages[0] == messages[1], messages
    assert messages[0] == (f"rank 0 could not write {cfg.run_dir}/{name}: OSError: [Errno 28] No space left on "
                           f"device (stopped after step 2; the last checkpoint: {last})"), messages
    verify(last)


def test_rank_0_failing_to_open_metrics_jsonl_stops_every_rank(small_data, tmp_path):
    """Rank 0 alone opens metrics.jsonl (RunLogger), after the run directory is tidied: when it cannot (a file
    of another user's), every rank stops with its message before the first step."""
    cfg = small_config(small_data, tmp_path / "run", gbs=4, steps=2, timeout_s=20)
    messages = spawn(2, _train_failing, cfg, "megatron_mini.training:RunLogger", _unopenable, init_group=False,
                     timeout=120)
    assert messages[0] == messages[1], messages
    assert messages[0] == (f"rank 0 could not write to the run directory {cfg.run_dir}: PermissionError: [Errno 13] "
                           f"Permission denied: '{cfg.run_dir}/metrics.jsonl'"), messages
    assert not os.path.exists(os.path.join(cfg.run_dir, "checkpoints"))


def _train_with_a_slow_wandb_finish(cfg, seconds):
    """train(cfg) on this rank, rank 0's RunLogger.finish (wandb's finish: an upload) taking `seconds`; its
    summary."""
    import time

    from megatron_mini import training
    real = training.RunLogger.finish

    def slow(logger):
        if logger.enabled:
            time.sleep(seconds)
        real(logger)
    training.RunLogger.finish = slow
    return training.train(cfg)["summary"]["steps"]


def test_a_wandb_finish_slower_than_the_collective_timeout_ends_the_run_well(small_data, tmp_path):
    """wandb's finish (an upload, when online) runs on rank 0 alone after the run's last collective: slower than
    timeout_s, it is not a failure of the run (every rank's last agreement came first)."""
    cfg = small_config(small_data, tmp_path / "run", gbs=4, steps=2, timeout_s=10)
    assert spawn(2, _train_with_a_slow_wandb_finish, cfg, 12, init_group=False, timeout=120) == [2, 2]


def _train_with_slow_writes(cfg, delays):
    """train(cfg) on this rank, each checkpoint file written delays[rank] seconds late."""
    import time

    import torch.distributed as dist

    from megatron_mini import checkpoint
    from megatron_mini.training import train
    write = checkpoint._save_file

    def slow(obj, path):
        time.sleep(delays[dist.get_rank()])
        return write(obj, path)
    checkpoint._save_file = slow
    return train(cfg)


def test_async_saves_write_the_checkpoints_of_sync_saves_while_training(small_data, tmp_path):
    """async_save=true on 2 ranks with ZeRO-1, rank 1 writing each file 0.4 s late so that its saves span steps
    while rank 0's do not: the losses and every checkpoint's files are byte for byte those of sync saves (a
    snapshot of the step they name), each save is published once both ranks have written their files (rank 0
    alone finishing would be a collective rank 1 does not join), and the last one, at `steps`, before the run
    ends."""
    from megatron_mini.checkpoint import read_meta, verify
    runs = {}
    for kind in ("sync", "async"):
        cfg = small_config(small_data, tmp_path / kind, steps=8, save_interval=2, keep_checkpoints=4, gbs=8, zero=1,
                           async_save=kind == "async")
        runs[kind] = spawn(2, _train_with_slow_writes, cfg, (0.0, 0.4), init_group=False)[0]
    assert runs["async"]["loss"] == runs["sync"]["loss"]
    log = (tmp_path / "async" / "logs" / "rank0000.log").read_text()
    for step in (2, 4, 6, 8):
        paths = [str(tmp_path / kind / "checkpoints" / f"step_{step:06d}") for kind in ("sync", "async")]
        assert read_meta(paths[0])["files"] == verify(paths[1])["files"], step
        done = f"saved {paths[1]}" + (" (written while training)" if step < 8 else "")
        assert (f"saving {paths[1]} while training" in log) == (step < 8) and done in log, (step, log)
    assert runs["async"]["checkpoint"] == paths[1]


def _stopped_with_slow_writes(cfg, delays, step, cause):
    """_train_with_slow_writes, stopped on every rank at `step`: the global loss NaN there ("nan": a RunError), or
    that step's global batch holding an id outside the vocabulary, as a damaged tokens.bin would ("damaged batch":
    a DataError, which every rank raises, each reading the whole batch; eval_interval=0, so no validation sample
    is read then). The error's message."""
    from megatron_mini import dataset, training
    from megatron_mini.config import RunError
    from megatron_mini.data import DataError
    if cause == "nan":
        global_loss = training.Trainer._global_loss

        def diverging(self, sample_losses, dataset, first, stop=None):
            loss, parts, stops, writers = global_loss(self, sample_losses, dataset, first, stop)
            return (math.nan if self.step + 1 == step else loss), parts, stops, writers
        training.Trainer._global_loss = diverging
    else:
        read, bad = dataset.GPTDataset.__getitem__, (step - 1) * cfg.gbs          # the step's first sample

        def damaged(self, i):
            row = read(self, i)
            if i == bad:
                row = row.copy()
                row[5] = 10 ** 6
            return row
        dataset.GPTDataset.__getitem__ = damaged
    with pytest.raises(RunError if cause == "nan" else DataError) as caught:
        _train_with_slow_writes(cfg, delays)
    return str(caught.value)


@pytest.mark.parametrize("cause", ["nan", "damaged batch"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_run_that_stops_while_an_async_save_is_written_publishes_it(kind, cause, small_data, tmp_path):
    """The loss turns NaN at step 3, or step 3's batch holds an id outside the vocabulary, while rank 1 still writes
    step 2's files (0.4 s late each): the run stops on every rank with one message and step 2 published, as with
    sync saves (the NaN's message names it as the last good checkpoint)."""
    cfg = small_config(small_data, tmp_path, steps=8, save_interval=2, gbs=8, zero=1, async_save=kind == "async")
    messages = spawn(2, _stopped_with_slow_writes, cfg, (0.0, 0.4), 3, cause, init_group=False)
    step2 = str(tmp_path / "checkpoints" / "step_000002")
    assert messages[0] == messages[1], messages
    assert (f"the last good checkpoint ({step2})" if cause == "nan" else
            "holds token id 1000000, outside the vocabulary of ") in messages[0], messages
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_000002"]
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000002"


def _async_save_failing(cfg, path):
    """A background save in which rank 1 cannot write its files, then a step: the RunError of finishing it."""
    from harness import make_trainer

    from megatron_mini import checkpoint
    from megatron_mini.config import RunError
    trainer = make_trainer(cfg)
    trainer.train_step()
    if trainer.mesh.rank == 1:
        checkpoint._save_file = _raising(OSError(28, "No space left on device"))
    trainer.save(path, {}, background=True)
    trainer.train_step()
    with pytest.raises(RunError) as caught:
        trainer.finish_save()
    return str(caught.value)


def test_an_async_save_that_fails_on_one_rank_stops_every_rank(small_data, tmp_path):
    """A background write that fails on rank 1 is every rank's RunError when the save is finished (the step
    after it, or the next save), naming the rank and the error; nothing of the save is left."""
    cfg = small_config(small_data, tmp_path / "run", gbs=4, zero=1)        # (rank 1 writes its ZeRO-1 shard)
    messages = spawn(2, _async_save_failing, cfg, str(tmp_path))
    assert messages[0] == messages[1], messages
    assert ("step_000001 failed on rank 1 while writing its files: OSError: [Errno 28] No space left on device. "
            "Its partial files were removed") in messages[0], messages
    assert os.listdir(tmp_path / "checkpoints") == [], os.listdir(tmp_path / "checkpoints")


@pytest.mark.parametrize("source,targets", [
    ((4, {"tp": 2, "zero": 1, "sp": True}), [(1, {}), (4, {"tp": 4}), (2, {"pp": 2, "vpp": 2, "zero": 1})]),
    ((4, {"pp": 2, "vpp": 2, "zero": 1, "embedding_stage": "own"}), [(2, {"tp": 2}), (1, {})]),
], ids=["from-tp2-sp-dp2-zero1", "from-pp2-vpp2-dp2-zero1"])
def test_sharded_checkpoints_resume_in_any_layout(source, targets, small_data, tmp_path):
    """A checkpoint of TP slices and ZeRO-1 shards (and of a pipeline whose last stage holds the tied
    embedding's copy) continues the run in other layouts: losses after the resume within RESUME_RTOL of the
    uninterrupted run's."""
    world, layout = source
    losses = train_on_ranks(world, small_config(small_data, tmp_path / "source", steps=6, save_interval=3, gbs=8,
                                                **layout))["loss"]
    step3 = os.path.join(tmp_path / "source", "checkpoints", "step_000003")
    for i, (w, target) in enumerate(targets):
        resumed = train_on_ranks(w, small_config(small_data, tmp_path / f"t{i}", steps=6, gbs=8, resume=step3,
                                                 **target))
        for a, b in zip(losses[3:], resumed["loss"], strict=True):
            assert abs(a - b) <= RESUME_RTOL * abs(a), (target, losses[3:], resumed["loss"])


def _loaded_weights(cfg, path):
    """This rank's weights after loading checkpoint `path` into a Trainer of `cfg`, by name, as lists."""
    from harness import make_trainer
    trainer = make_trainer(cfg)
    trainer.load(path)
    return {name: p.detach().float().tolist() for buf in trainer.buffers for p, name in buf.names.items()}


def test_a_bf16_checkpoint_resumes_exactly_and_in_fp32_from_its_master(small_data, tmp_path):
    """The weights are saved in the model's dtype beside the fp32 master: a bf16 run resumes bit for bit, and
    the same checkpoint resumed in fp32 starts from the master weights, not from their bf16 rounding, on one
    rank and with ZeRO-1 on two."""
    import torch

    from megatron_mini.checkpoint import ShardReader, read_meta
    bf16 = {"precision.dtype": "bf16"}
    full = train_on_ranks(1, small_config(small_data, tmp_path / "full", steps=4, save_interval=2, **bf16))
    step2 = str(tmp_path / "full" / "checkpoints" / "step_000002")
    resumed = train_on_ranks(1, small_config(small_data, tmp_path / "resumed", steps=4, resume=step2, **bf16))
    assert resumed["loss"] == full["loss"][2:]
    reader = ShardReader(step2, read_meta(step2))
    assert all(reader.full(name).dtype == torch.bfloat16 for name in reader.names())
    fp32 = spawn(1, _loaded_weights, small_config(small_data, tmp_path / "fp32"), step2)
    # ZeRO-1 over 2 ranks: each rank sets its own shard from the master, and must take the other's from its owner
    fp32 += spawn(2, _loaded_weights, small_config(small_data, tmp_path / "fp32-zero", zero=1, gbs=4), step2)
    rounded = 0
    for name in fp32[0]:
        master = reader.full(name, "master")
        for rank, weights in enumerate(fp32):
            assert torch.equal(torch.tensor(weights[name]), master), (rank, name)
        assert torch.equal(reader.full(name), master.bfloat16()), name
        rounded += not torch.equal(master, master.bfloat16().float())
    assert rounded > len(fp32[0]) // 2          # most masters are not bf16 values: the test tells the two apart


def test_a_checkpoint_of_the_older_format_is_refused_by_name(uninterrupted, tmp_path):
    """A checkpoint written before the sharded format (one file of full tensors per pipeline stage, no
    "format" in meta.json) is one line that says so, not a claim that it is damaged: resume=auto does not
    skip it as a corrupt one (nor advise resume=PATH, which refuses it too)."""
    import json
    import shutil

    from megatron_mini import checkpoint
    old = tmp_path / "run" / "checkpoints" / "step_000005"
    shutil.copytree(os.path.join(uninterrupted[0].run_dir, "checkpoints", "step_000005"), old)
    meta = json.loads((old / "meta.json").read_text())
    for key in ("format", "shards", "tensors", "optimizer"):
        meta.pop(key)
    meta["files"] = {"model_pp00.pt": "0" * 64, "optim_pp00.pt": "0" * 64}
    (old / "meta.json").write_text(json.dumps(meta))
    for check in (lambda: checkpoint.verify(str(old)), lambda: checkpoint.newest(str(tmp_path / "run"))):
        with pytest.raises(checkpoint.OlderFormatError, match=f"^{old} was written by an older megatron_mini .one.*"
                                                              "the last version that reads it is commit 290b29e"):
            check()


@pytest.mark.parametrize("damage", ["a shard dropped", "a range cut short", "a range that starts late", "no shapes",
                                    "a file without checksum", "no tp", "tp 0"])
def test_a_damaged_index_is_one_line(damage, uninterrupted, tmp_path):
    """meta.json's index must place every value of every tensor in a checksummed file: a damaged one is a
    CheckpointError at verify (before any rank reads a tensor, so resume=auto skips it), not a KeyError later."""
    import json
    import shutil

    from megatron_mini import checkpoint
    ckpt = tmp_path / "step_000005"
    shutil.copytree(os.path.join(uninterrupted[0].run_dir, "checkpoints", "step_000005"), ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    optim = next(f for f in meta["shards"] if f.startswith("optim_"))
    if damage == "a shard dropped":
        meta["shards"].pop(next(f for f in meta["shards"] if f.startswith("model_")))
    elif damage == "a range cut short":
        name, (lo, hi) = next(iter(meta["shards"][optim]["ranges"].items()))
        meta["shards"][optim]["ranges"][name] = [lo, hi - 1]
    elif damage == "a range that starts late":        # (it ends where the tensor does: a gap, not a short count)
        name, (lo, hi) = next(iter(meta["shards"][optim]["ranges"].items()))
        meta["shards"][optim]["ranges"][name] = [lo + 1, hi]
    elif damage == "no shapes":
        meta["tensors"] = {}
    elif damage in ("no tp", "tp 0"):   # (0: a split tensor's slices were never checked; the load's cat had none)
        meta["layout"]["tp"] = None if damage == "no tp" else 0
    else:
        meta["files"].pop(optim)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(checkpoint.CheckpointError, match=r"meta.json: its index of the tensors is damaged \("):
        checkpoint.verify(str(ckpt))


def test_the_data_entry_of_meta_json(uninterrupted, tmp_path):
    """meta.json's "data" (what the train/validation split and the token ids depend on) must be a mapping where
    present: else a CheckpointError at verify (one line; resume=auto skips it). A resume compares the keys this
    version knows: one it does not (a newer version's) is no refusal, and a differing one is, by name (and where
    prepare kept the build of another corpus sha256, that directory)."""
    import dataclasses
    import json
    import shutil

    from megatron_mini import checkpoint
    from megatron_mini.config import ConfigError
    cfg, _ = uninterrupted
    ckpt = tmp_path / "step_000005"
    shutil.copytree(os.path.join(cfg.run_dir, "checkpoints", "step_000005"), ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    current = dict(meta["data"])
    for damaged in (None, ["tokenizer_sha256"]):
        (ckpt / "meta.json").write_text(json.dumps({**meta, "data": damaged}))
        with pytest.raises(checkpoint.CheckpointError, match=r"meta.json has no data \(a mapping\)"):
            checkpoint.verify(str(ckpt))
    checkpoint.check_compatible(checkpoint.Resume(str(ckpt), {**meta, "data": {**current, "newer": 1}}, []), cfg,
                                current)
    with pytest.raises(ConfigError, match=r"with another model or data than this run asks for: data num_tokens: "
                                          r"7 -> "):
        checkpoint.check_compatible(checkpoint.Resume(str(ckpt), {**meta, "data": {**current, "num_tokens": 7}},
                                                      []), cfg, current)
    # data.dir built again for its corpus as it now reads: the refusal names where prepare kept the old build
    moved = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dir=str(tmp_path / "d")))
    trained = {**current, "corpus_sha256": "a" * 64}
    superseded = tmp_path / f"d.superseded-{'a' * 12}"
    superseded.mkdir()
    for meta_json, kept in ((None, False), ('{"corpus_sha', False), (json.dumps({"corpus_sha256": "b" * 64}), False),
                            (json.dumps({"corpus_sha256": "a" * 64}), True)):
        if meta_json is not None:       # (an empty directory, a meta.json cut short, one of another corpus: no note)
            (superseded / "meta.json").write_text(meta_json)
        with pytest.raises(ConfigError, match="data corpus_sha256: aaaa") as err:
            checkpoint.check_compatible(checkpoint.Resume(str(ckpt), {**meta, "data": trained}, []), moved, current)
        assert (f"(data.dir={tmp_path}/d.superseded-{'a' * 12} holds the build it was trained on)" in str(err.value)) \
            == kept


SCALER = {"scale": 65536.0, "clean_steps": 3, "hysteresis_left": -1, "skips_at_min": 0, "skipped_steps": 2}


@pytest.mark.parametrize("edit, lacks", [
    ({"scaler": {**SCALER, "scale": "65536"}}, "optimizer.scaler.scale (a number in (0, 2**64])"),
    ({"scaler": {**SCALER, "scale": float("nan")}}, "optimizer.scaler.scale (a number in (0, 2**64])"),
    ({"scaler": {**SCALER, "scale": float("inf")}}, "optimizer.scaler.scale (a number in (0, 2**64])"),
    ({"scaler": {**SCALER, "scale": -1.0}}, "optimizer.scaler.scale (a number in (0, 2**64])"),
    ({"scaler": {**SCALER, "scale": 0}}, "optimizer.scaler.scale (a number in (0, 2**64])"),
    ({"scaler": {**SCALER, "scale": True}}, "optimizer.scaler.scale (a number in (0, 2**64])"),
    ({"scaler": {**SCALER, "clean_steps": True}}, "optimizer.scaler.clean_steps (a count)"),
    ({"scaler": {**SCALER, "clean_steps": 1.5}}, "optimizer.scaler.clean_steps (a count)"),
    ({"scaler": {**SCALER, "hysteresis_left": "2"}}, "optimizer.scaler.hysteresis_left (an integer)"),
    ({"scaler": {**SCALER, "skipped_steps": -1}}, "optimizer.scaler.skipped_steps (a count)"),
    ({"scaler": [65536.0]}, "optimizer.scaler (null, or the fp16 loss scaler's state)"),
    ({"scaler": "drop"}, "optimizer.scaler (null, or the fp16 loss scaler's state)"),
    ({"model": {"num_heads": True}}, "config.model.num_heads (an integer)"),
    ({"model": {"num_layers": 8.0}}, "config.model.num_layers (an integer)"),
    ({"model": {"ln_eps": True}}, "config.model.ln_eps (a number)"),
    ({"model": {"ln_eps": float("nan")}}, "config.model.ln_eps (a number)"),
], ids=["scale-text", "scale-nan", "scale-inf", "scale-negative", "scale-0", "scale-true", "clean-steps-true",
        "clean-steps-float", "hysteresis-text", "skipped-negative", "scaler-list", "scaler-missing",
        "heads-true", "layers-float", "ln-eps-true", "ln-eps-nan"])
def test_a_wrongly_typed_counter_or_model_key_of_meta_json_is_one_line(edit, lacks, uninterrupted, tmp_path):
    """meta.json's optimizer counters (the fp16 loss scaler's state among them) and model keys, which no checksum
    covers, hold what the code that writes them writes, or the checkpoint is a CheckpointError at verify (one line;
    resume=auto skips it), as its other keys: JSON's true is an int to Python (a num_heads of true was one head), a
    scale of "65536" or NaN was taken as it was. A scaler's state in range, one of a checkpoint older than its
    skips_at_min and skipped_steps, and none (bf16, fp32) verify."""
    import json
    import shutil

    from megatron_mini import checkpoint
    ckpt = tmp_path / "step_000005"
    shutil.copytree(os.path.join(uninterrupted[0].run_dir, "checkpoints", "step_000005"), ckpt)
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["optimizer"]["scaler"] is None          # (fp32: no loss scale)
    older = {k: v for k, v in SCALER.items() if k not in ("skips_at_min", "skipped_steps")}
    for scaler in (None, SCALER, older, {**SCALER, "scale": 1}):
        (ckpt / "meta.json").write_text(json.dumps({**meta, "optimizer": {**meta["optimizer"], "scaler": scaler}}))
        assert checkpoint.verify(str(ckpt))["optimizer"]["scaler"] == scaler
    damaged = json.loads(json.dumps(meta))
    for key, value in edit.items():
        if key == "model":
            damaged["config"]["model"].update(value)
        elif value == "drop":
            damaged["optimizer"].pop(key)
        else:
            damaged["optimizer"][key] = value
    (ckpt / "meta.json").write_text(json.dumps(damaged))
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.verify(str(ckpt))
    assert str(err.value) == f"{ckpt}/meta.json has no {lacks} (not a megatron_mini checkpoint, or a damaged one)."


def test_a_resume_onto_token_files_of_other_content_is_refused(uninterrupted, tmp_path):
    """A data.dir whose tokens.bin was replaced by one of the same size and other content (here its tokens rotated
    by one: valid ids, the same meta.json and tokens.idx) is refused by a resume (check_compatible, by
    dataset.data_identity's tokens_fingerprint), and so is a tokens.idx that cuts the tokens into other documents (as
    many, and valid); the same build copied elsewhere is the same data. Before the fingerprint, both resumed onto
    other samples without a word. (A build whose meta.json records its tokens_fingerprint refuses such files when it
    is opened, test_data.py: here one prepared before meta.json recorded it, which opens as a valid build.)"""
    import dataclasses
    import json
    import shutil

    import numpy as np

    from megatron_mini import checkpoint
    from megatron_mini.config import ConfigError
    from megatron_mini.dataset import data_identity, load_datasets
    cfg, _ = uninterrupted
    path = os.path.join(cfg.run_dir, "checkpoints", "step_000005")
    resume = checkpoint.Resume(path, checkpoint.read_meta(path), [])
    copy = tmp_path / "data"
    shutil.copytree(cfg.data.dir, copy)
    meta = json.loads((copy / "meta.json").read_text())
    del meta["tokens_fingerprint"]
    (copy / "meta.json").write_text(json.dumps(meta))
    moved = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dir=str(copy)))

    def identity(data):
        return data_identity(data, load_datasets(data, cfg.model.seq_len, cfg.seed, cfg.model.vocab_size))
    checkpoint.check_compatible(resume, moved, identity(moved.data))
    for name, dtype in (("tokens.bin", np.uint16), ("tokens.idx", np.int64)):
        shutil.copy(os.path.join(cfg.data.dir, name), copy / name)
        values = np.memmap(copy / name, dtype=dtype, mode="r+", offset=0 if dtype == np.uint16 else 24)
        if dtype == np.uint16:
            values[:] = np.roll(np.array(values), 1)
        else:               # sizes [n], offsets [n]: the first document's last token the second's first
            n = len(values) // 2
            values[0], values[1], values[n + 1] = values[0] - 1, values[1] + 1, values[n + 1] - 1
        values.flush()
        del values
        with pytest.raises(ConfigError, match=r"another model or data than this run asks for: data "
                                              r"tokens_fingerprint: [0-9a-f]{16} -> [0-9a-f]{16}\."):
            checkpoint.check_compatible(resume, moved, identity(moved.data))     # (a valid build)
        shutil.copy(os.path.join(cfg.data.dir, name), copy / name)


def test_a_write_that_fails_leaves_no_temporary_file(tmp_path, monkeypatch):
    """atomic_write on a full disk (fsync raising ENOSPC), or on one out of inodes (the temporary file not even
    created): that error is raised (not the removal's of a temporary file that never was, "No such file or
    directory"), the file keeps its old content, and nothing else is left beside it."""
    from megatron_mini import files
    path = tmp_path / "latest"
    files.atomic_write(path, "step_000002")
    with monkeypatch.context() as m:
        m.setattr(files.os, "fsync", _raising(OSError(28, "No space left on device")))
        with pytest.raises(OSError, match="No space left"):
            files.atomic_write(path, "step_000004")
    assert os.listdir(tmp_path) == ["latest"] and path.read_text() == "step_000002"
    monkeypatch.setattr(files, "open", _raising(OSError(28, "No space left on device")), raising=False)
    with pytest.raises(OSError, match="No space left"):
        files.atomic_write(path, "step_000004")
    assert os.listdir(tmp_path) == ["latest"] and path.read_text() == "step_000002"


def test_milestone_checkpoints_are_never_pruned(small_data, tmp_path):
    """keep_checkpoint_interval=3 beside keep_checkpoints=2 and save_interval=1: the newest two and every third
    step's are kept, through a resume too, and resume=auto takes the newest; a resume without the interval keeps the
    milestones saved before (meta.json says which); an interval that is no multiple of save_interval (none of its
    steps would be saved) is refused before anything starts."""
    from megatron_mini.config import ConfigError, TrainConfig, validate
    cfg = small_config(small_data, tmp_path, steps=7, save_interval=1, keep_checkpoints=2, keep_checkpoint_interval=3)
    train_on_ranks(1, cfg)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_000003", "step_000006", "step_000007"]
    cfg.steps, cfg.resume = 8, "auto"
    assert len(train_on_ranks(1, cfg)["loss"]) == 1                          # (from step 7)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_000003", "step_000006", "step_000007",
                                                            "step_000008"]
    cfg.steps, cfg.keep_checkpoint_interval = 10, 0
    train_on_ranks(1, cfg)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["latest", "step_000003", "step_000006", "step_000009",
                                                            "step_000010"]
    for save, fact in ((2, "the steps saved are the multiples of save_interval=2"),
                       (0, "the steps saved are the last only (save_interval=0)")):
        with pytest.raises(ConfigError, match=re.escape(f"keep_checkpoint_interval=3 keeps the checkpoints of its "
                                                        f"multiples, but {fact}: make it a multiple of save_interval")):
            validate(TrainConfig(save_interval=save, keep_checkpoint_interval=3), 1)
    with pytest.raises(ConfigError, match=re.escape("keep_checkpoint_interval=-1 must be >= 0")):
        validate(TrainConfig(keep_checkpoint_interval=-1), 1)


@pytest.mark.parametrize("latest", ["not UTF-8", "a directory"])
def test_an_unreadable_latest_is_advice_not_a_failure(latest, uninterrupted, tmp_path):
    """checkpoints/latest is advice (resume=auto takes the newest checkpoint that verifies): where it is damaged (not
    UTF-8) or not a file, the newest is taken with a note, as where `latest` is missing (a UnicodeDecodeError or an
    IsADirectoryError stopped resume and the tools)."""
    import shutil

    from megatron_mini import checkpoint, inference
    cfg, _ = uninterrupted
    run = tmp_path / "run"
    shutil.copytree(os.path.join(cfg.run_dir, "checkpoints"), run / "checkpoints")
    (run / "checkpoints" / "latest").unlink()
    if latest == "a directory":
        (run / "checkpoints" / "latest").mkdir()
    else:
        (run / "checkpoints" / "latest").write_bytes(b"\xffstep_000010")
    newest = str(run / "checkpoints" / "step_000010")
    found = checkpoint.newest(str(run))
    said = "is missing or unreadable" if latest == "a directory" else "names '\ufffdstep_000010'"
    assert found.path == newest and found.notes == [f"checkpoints/latest {said}; took the newest complete "
                                                    f"checkpoint, {newest}"], found.notes
    assert inference.read_checkpoint(str(run)).path == newest


def _a_live_run(uninterrupted, tmp_path):
    """A run directory holding one checkpoint, and what its live run's save with keep_checkpoints=1 does next
    (Save._publish): publish step 2, name it in latest, prune step 1."""
    import shutil
    cfg, _ = uninterrupted
    root = tmp_path / "run" / "checkpoints"
    old = str(root / "step_000001")
    shutil.copytree(os.path.join(cfg.run_dir, "checkpoints", "step_000005"), old)
    (root / "latest").write_text("step_000001")

    def save_and_prune():
        if os.path.isdir(old):
            shutil.copytree(old, str(root / "step_000002"))
            (root / "latest").write_text("step_000002")
            shutil.rmtree(old)
    return str(tmp_path / "run"), old, save_and_prune


@pytest.mark.parametrize("when", ["while hashed", "while loaded", "before its tokenizer is read"])
def test_a_tool_reading_a_run_whose_live_run_prunes_the_checkpoint_reads_the_newer_one(when, uninterrupted, tmp_path,
                                                                                        monkeypatch):
    """generate, evaluate and export_hf (inference.open_checkpoint) on a run directory whose live run publishes a
    newer checkpoint and prunes the one being read take the newer one: not "none is complete and intact", a
    missing tokenizer, or a traceback (each seen in a live run: 11 of 50 tool calls failed so)."""
    import torch

    from megatron_mini import checkpoint, inference
    run, old, save_and_prune = _a_live_run(uninterrupted, tmp_path)
    sha, load = checkpoint.sha256_file, checkpoint.load_model_tensors
    if when == "while hashed":           # the listing taken, then its only checkpoint goes while it is verified
        monkeypatch.setattr(checkpoint, "sha256_file", lambda p: (save_and_prune(), sha(p))[1])
    elif when == "while loaded":         # (torch.load's mmap raises a RuntimeError for the file gone)
        def gone(p):
            save_and_prune()
            raise RuntimeError(f"unable to open file <{p}/model.pt> in read-only mode: No such file or directory (2)")
        monkeypatch.setattr(checkpoint, "load_model_tensors", lambda p: gone(p) if p == old else load(p))
    else:
        monkeypatch.setattr(checkpoint, "load_model_tensors", lambda p: (load(p), save_and_prune())[0])
    ckpt, _, _ = inference.open_checkpoint(run, None, torch.device("cpu"))
    assert ckpt.path.endswith("step_000002")
    if when == "while loaded":           # export_hf reads as the others do
        from megatron_mini import hf
        run, old, save_and_prune = _a_live_run(uninterrupted, tmp_path / "export")
        assert hf.export(run, str(tmp_path / "hf")).path.endswith("step_000002")
    # (training's init_from/resume=<that run> say "pruned since", not "does not fit this run's model", for the mmap's)
    assert checkpoint.removed(RuntimeError("unable to open file <m.pt> in read-only mode: No such file or directory"))
    assert not checkpoint.removed(RuntimeError("size mismatch for weight")) and checkpoint.removed(FileNotFoundError())
    monkeypatch.undo()
    run, old, save_and_prune = _a_live_run(uninterrupted, tmp_path / "given")       # the checkpoint itself, given
    monkeypatch.setattr(checkpoint, "load_model_tensors", lambda p: (save_and_prune(), load(p))[1])
    with pytest.raises(checkpoint.CheckpointError, match=f"^{re.escape(old)} was removed while it was read .* give its "
                                                         "run directory to read the newest one$"):
        inference.open_checkpoint(old, None, torch.device("cpu"))
    monkeypatch.setattr(inference, "read_checkpoint", lambda p: (_ for _ in ()).throw(inference.Removed(p + "/x")))
    with pytest.raises(checkpoint.CheckpointError, match="removed while they were read, 20 times .* try again"):
        inference.open_checkpoint(run, None, torch.device("cpu"))         # a run that prunes faster than it is read
