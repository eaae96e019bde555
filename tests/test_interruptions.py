"""Failures mid-run, each made for real: a save that cannot be written, fp16 that cannot recover, SIGTERM (at a step's
end and during one; SIGINT, SIGHUP and SIGUSR1 ask the same), a killed launcher, a stopped rank, a `kill -9` under
`torchrun --max-restarts=1` and a kill during a save; the resumed runs must end with bitwise the weights of an
uninterrupted one (the test model, fp32 on CPU ranks). Refusals and resumes that need no failure:
tests/test_reliability.py.
"""
from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.multiprocessing.api import SubprocessContext

from commandline import assert_one_error, env, finish, model_args, running, start, torchrun_argv, torchrun_train
from harness import make_trainer, small_config
from megatron_mini.checkpoint import load_model_tensors
from ranks import spawn

# torchrun's report lists the ranks it stopped, with their exit codes, from torch 2.10 (pytorch#160908); before (2.9
# and 2.8) it names the first failure only, and a stopped rank's end shows nowhere
TORCHRUN_LISTS_STOPPED_RANKS = hasattr(SubprocessContext, "_capture_process_failures")


def test_a_failed_save_keeps_the_last_good_checkpoint(small_data, tmp_path, hooks):
    """A checkpoint that cannot be written (files capped at 1 MB, as a full disk would refuse them) stops every
    rank with one message naming the error and the last good checkpoint; nothing of the failed save remains."""
    run_dir = tmp_path / "run"
    assert torchrun_train(2, model_args(small_data, run_dir)).rc == 0          # step 2 saved
    r = torchrun_train(2, [*model_args(small_data, run_dir), "steps=4"], env(hooks, HOOK_FSIZE_LIMIT=1 << 20))
    assert_one_error(r, [f"Saving checkpoint {run_dir}/checkpoints/step_000004 failed on rank 0 while writing its "
                         f"files", "File too large", "last good checkpoint (step_000002)"], "torchrun", code=1,
                     quick=False)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_000002"]
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_000002"


def test_fp16_that_cannot_recover_stops(small_data, tmp_path):
    args = [*model_args(small_data, tmp_path / "run"), "precision=fp16", "precision.initial_loss_scale=4",
            "precision.max_skips_at_min_scale=3", "optimizer.lr=10000", "optimizer.warmup_steps=0",
            "optimizer.min_lr=0", "steps=40", "gbs=4", "mbs=2"]
    r = torchrun_train(1, args)
    assert_one_error(r, ["Training stopped (fp16): 3 steps in a row overflowed at the minimum loss scale 1",
                         "use precision=bf16"], "torchrun", code=1, quick=False)
    assert not (tmp_path / "run" / "checkpoints").exists()


def _workers(proc) -> list:
    """The pids of torchrun's worker processes (children of its agent)."""
    children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
    return [int(c) for c in children]


def _wait_for(proc, path: Path, text: str = "", limit: float = 90) -> None:
    """Until `path` shows `text`; a job that ends first fails the test with its output."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            pytest.fail(f"the job ended before {path} showed {text!r}: {finish(proc)}")
        time.sleep(0.2)
    pytest.fail(f"{path} did not show {text!r} within {limit} s")


def _wait_stopped(pid: int, what: str, limit: float = 90) -> None:
    """Until process `pid` is stopped (SIGSTOP: state T)."""
    deadline = time.monotonic() + limit
    while _state(pid) != "T" and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _state(pid) == "T", f"{what} did not stop within {limit} s (state {_state(pid)})"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def _state(pid: int) -> str:
    """The process's state letter in /proc (R, S, T, Z, ...), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


RESUMABLE = ["save_interval=2", "keep_checkpoints=10", "eval_interval=0", "log_interval=1"]


@pytest.fixture(scope="module")
def uninterrupted(small_data, tmp_path_factory):
    """10 steps on 2 ranks, a checkpoint every 2: the weights every interrupted run must end with."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    r = torchrun_train(2, [*model_args(small_data, run_dir), *RESUMABLE, "steps=10"])
    assert r.rc == 0, r
    return run_dir / "checkpoints"


def _same_weights(a: Path, b: Path) -> None:
    wa, wb = load_model_tensors(str(a)), load_model_tensors(str(b))
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def _stopped_mid_run(small_data, tmp_path, hooks, send):
    """A 10-step torchrun run of 2 ranks, `send(launcher, rank0, rank1)` signalling it once rank 0 has stopped
    itself in the step-4 save (its 10th fsync), so the signal lands mid-run however late it is sent: every rank
    has cast step 4's stop vote, and step 5's is the first to count it. Returns (its Result, run_dir, args)."""
    run_dir = tmp_path / "run"
    args = [*model_args(small_data, run_dir), *RESUMABLE, "steps=10"]
    with running(torchrun_argv(2, args), env(hooks, HOOK_CRASH_RANK=0, HOOK_CRASH_AT_FSYNC=10,
                                             HOOK_CRASH_SIGNAL="SIGSTOP")) as proc:
        _wait_for(proc, run_dir / "logs" / "rank0000.log", "step     3/")
        rank0, rank1 = _workers(proc)
        _wait_stopped(rank0, "rank 0 (at its 10th fsync)")
        send(proc.pid, rank0, rank1)
        os.kill(rank0, signal.SIGCONT)
        return finish(proc), run_dir, args


def test_sigterm_saves_and_resume_continues_exactly(small_data, tmp_path, hooks, uninterrupted):
    r, run_dir, args = _stopped_mid_run(small_data, tmp_path, hooks,     # to rank 1, as Slurm warns a job
                                        lambda launcher, rank0, rank1: os.kill(rank1, signal.SIGTERM))
    assert r.rc == 0, r
    assert "stopped by SIGTERM (to 1 of 2 ranks) after step" in r.out and "continue with resume=auto" in r.out, r
    assert re.search(r"^stopped: \d+ steps in ", r.out, re.M) and not re.search(r"^done: ", r.out, re.M), r
    stopped = int(json.loads((run_dir / "summary.json").read_text())["steps"])
    assert stopped == 5 and (run_dir / "checkpoints" / f"step_{stopped:06d}").is_dir()
    again = torchrun_train(2, args)
    assert again.rc == 0 and f"resumed from {run_dir}/checkpoints/step_{stopped:06d}" in again.out, again
    _same_weights(run_dir / "checkpoints" / "step_000010", uninterrupted / "step_000010")


def _on_rank_1_after(owner, where: str, call: int, then) -> list:
    """Wrap owner.<where> (a PipelineEngine's method, or its class's) so that rank 1 runs then() right after its
    `call`-th call from now; returns [how many calls this rank has made since]."""
    import torch.distributed as dist
    run, calls = getattr(owner, where), [0]

    def wrapped(*args, **kwargs):
        out = run(*args, **kwargs)
        calls[0] += 1
        if dist.get_rank() == 1 and calls[0] == call:
            then()
        return out
    setattr(owner, where, wrapped)
    return calls


def _request(flag, name: str) -> None:
    """What StopRequest's handler does on signal `name`."""
    flag.requested, flag.name = True, name


def _signalled_during_a_step(cfg, signame):
    """Rank 1's StopRequest goes up inside its second step's forward/backward (a step is long; a signal lands in
    one), by `signame`: (step 1's stop counts, step 2's) on this rank."""
    from megatron_mini.launch import StopRequest
    trainer, flag = make_trainer(cfg), StopRequest(take_signals=False)
    first = trainer.train_step(flag)["stop"]
    _on_rank_1_after(trainer.engine, "train_step", 1, lambda: _request(flag, signame))
    return first, trainer.train_step(flag)["stop"]


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGUSR1"])
def test_a_signal_during_a_step_stops_after_that_step(signame, small_data, tmp_path):
    """Every rank learns of a signal that arrived during a step at that step's end (not the next's: a step of a
    large model can outlast a scheduler's grace period), and which signal it was: rank 0 names it in the stop
    line though it came to rank 1 alone."""
    assert spawn(2, _signalled_during_a_step, small_config(small_data, tmp_path), signame) == \
        [({}, {signame: 1}), ({}, {signame: 1})]


def _signalled_during_an_evaluation(cfg, batch):
    """Rank 1's StopRequest goes up inside evaluation batch `batch` (of eval_iters=4): (the loss of an evaluation
    without it, then (loss, stop votes) of the one it cut, and how many batches this rank evaluated in it)."""
    from megatron_mini.launch import StopRequest
    trainer, flag = make_trainer(cfg), StopRequest(take_signals=False)
    whole, _, votes = trainer.evaluate(flag)
    assert votes == {}
    calls = _on_rank_1_after(trainer.engine, "eval_step", batch, lambda: _request(flag, "SIGTERM"))
    cut, parts, votes = trainer.evaluate(flag)
    return whole, (cut, votes), calls[0]


@pytest.mark.parametrize("batch", [2, 4])
def test_a_signal_during_an_evaluation_ends_it_on_every_rank_after_that_batch(batch, small_data, tmp_path):
    """An evaluation of eval_iters batches can outlast a scheduler's grace period: a signal to one rank ends it
    on every rank after the batch it came in (the vote rides each batch's loss all-reduce), without a loss; one
    that comes in the last batch leaves the evaluation whole, its loss that of an evaluation without it."""
    cfg = small_config(small_data, tmp_path, pp=2, eval_iters=4)
    results = spawn(2, _signalled_during_an_evaluation, cfg, batch)
    whole = results[0][0]
    expected = (None if batch < 4 else whole, {"SIGTERM": 1})
    assert results == [(whole, expected, batch)] * 2


def _stopped_at(cfg, where, call):
    """train(cfg) on this rank; rank 1 sends itself SIGTERM in its `call`-th engine `where` ("train_step" or
    "eval_step"; a real signal, taken by train's StopRequest)."""
    from megatron_mini.pipeline import PipelineEngine
    from megatron_mini.training import train
    _on_rank_1_after(PipelineEngine, where, call, lambda: os.kill(os.getpid(), signal.SIGTERM))
    return train(cfg)["summary"]


def _curve(run_dir: Path) -> list:
    """metrics.jsonl's (step, loss) and (step, val_loss) records, in order."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], key, r[key]) for r in lines for key in ("loss", "val_loss") if key in r]


@pytest.mark.parametrize("where,call,step", [("train_step", 4, 4), ("eval_step", 8, 4), ("eval_step", 11, 6),
                                             ("eval_step", 2, 0)],
                         ids=["during-step-4", "during-step-4s-evaluation", "during-the-last-evaluation",
                              "during-the-first-evaluation"])
def test_a_stop_saves_before_the_evaluation_and_the_resumed_run_evaluates_first(where, call, step, small_data,
                                                                                 tmp_path):
    """A stop that comes during a step whose evaluation is due, or during an evaluation (3 batches at steps 0,
    2, 4, 6: engine calls 1-3, 4-6, 7-9, 10-12), saves at once, the evaluation owed (in meta.json); the resumed
    run evaluates that step before its next (after the last step: then ends), so that its metrics.jsonl,
    summary and weights are those of a run never stopped, however often it starts from that checkpoint. Cut
    short before the first step, nothing is saved: the run starts again."""
    from harness import train_on_ranks
    kw = dict(steps=6, eval_interval=2, eval_iters=3, log_interval=1, save_interval=100, resume="auto")
    whole = train_on_ranks(2, small_config(small_data, tmp_path / "whole", **kw))["summary"]
    cfg = small_config(small_data, tmp_path / "stopped", **kw)
    summary = spawn(2, _stopped_at, cfg, where, call, init_group=False)[0]
    assert summary["stopped_by"] == "SIGTERM (to 1 of 2 ranks)" and summary["steps"] == step
    saved = tmp_path / "stopped" / "checkpoints" / f"step_{step:06d}"
    log = (tmp_path / "stopped" / "logs" / "rank0000.log").read_text()
    if step:
        assert json.loads((saved / "meta.json").read_text())["evaluation_owed"] is True
        assert f"continue with resume=auto (which evaluates step {step} first)" in log
    else:
        assert not saved.parent.exists() and "before step 1: nothing trained since the start" in log
        text = (tmp_path / "stopped" / "summary.json").read_text()      # strict JSON: null for what it lacks, not NaN
        strict = json.loads(text, parse_constant=lambda name: pytest.fail(f"summary.json holds {name}"))
        assert strict["final_loss"] is None and strict["final_val_loss"] is None and summary["final_loss"] is None
        assert "| no train loss | val loss not evaluated |" in log
    assert (f"step     {step}/6 | evaluation cut short by SIGTERM (to 1 of 2 ranks)" in log) == (where == "eval_step")
    resumed = train_on_ranks(2, cfg)
    assert resumed["summary"]["steps"] == 6 and "stopped_by" not in resumed["summary"]
    for key in ("final_loss", "final_val_loss"):      # (after the last step: the loss its checkpoint kept)
        assert resumed["summary"][key] == whole[key]
    assert resumed["val_loss"][0][0] == step
    assert _curve(tmp_path / "stopped") == _curve(tmp_path / "whole")
    _same_weights(tmp_path / "stopped" / "checkpoints" / "step_000006", tmp_path / "whole" / "checkpoints" /
                  "step_000006")
    if step:              # started again from it (a branch, or a restart after a crash): evaluated once more,
        cfg.resume = str(saved)                                    # its line replacing the earlier start's
        assert train_on_ranks(2, cfg)["val_loss"][0][0] == step
        assert _curve(tmp_path / "stopped") == _curve(tmp_path / "whole")


def test_a_stop_that_comes_with_the_last_step_ends_a_whole_run(small_data, tmp_path):
    """A signal during the last step (no evaluation due): the run is whole, so it ends as one never signalled,
    its summary without stopped_by (a requeue script that reads it would start it again and again)."""
    summary = spawn(2, _stopped_at, small_config(small_data, tmp_path, steps=2), "train_step", 2, init_group=False)[0]
    assert summary["steps"] == 2 and "stopped_by" not in summary
    assert "stopped by" not in (tmp_path / "logs" / "rank0000.log").read_text()


def test_a_resume_without_evaluation_owes_none(small_data, tmp_path):
    """Resumed with eval_interval=0 from a checkpoint that owes its evaluation: nothing is evaluated, and the
    next checkpoint owes nothing (a later resume with evaluation on would evaluate a step it never asked for)."""
    from harness import train_on_ranks
    cfg = small_config(small_data, tmp_path, steps=6, eval_interval=2, eval_iters=3, resume="auto")
    assert spawn(2, _stopped_at, cfg, "eval_step", 8, init_group=False)[0]["steps"] == 4
    cfg.eval_interval = 0
    resumed = train_on_ranks(2, cfg)
    assert resumed["summary"]["steps"] == 6 and resumed["val_loss"] == []
    assert json.loads((tmp_path / "checkpoints" / "step_000006" / "meta.json").read_text())["evaluation_owed"] is False


def test_a_deadline_asks_to_stop_once_it_has_passed_and_a_signal_first():
    """StopRequest.asked(): None before its deadline (time.monotonic()) and without one, the time limit after
    it, and a signal's name whenever one came; without take_signals no handler is touched."""
    from megatron_mini.launch import StopRequest
    handlers = [signal.getsignal(s) for s in StopRequest.SIGNALS]
    assert StopRequest(take_signals=False).asked() is None
    assert StopRequest(time.monotonic() + 60, take_signals=False).asked() is None
    past = StopRequest(time.monotonic() - 1e-3, take_signals=False)
    assert past.asked() == StopRequest.TIME_LIMIT == "exit_after_minutes" and not past.requested
    past.requested, past.name = True, "SIGUSR1"
    assert past.asked() == "SIGUSR1"
    assert [signal.getsignal(s) for s in StopRequest.SIGNALS] == handlers


def test_the_time_limit_saves_and_stops_every_rank_and_the_resume_continues_exactly(small_data, tmp_path):
    """exit_after_minutes (counted from train's start): every rank saves and stops at the end of the first step
    past it, exit 0 with the limit in the stop line and summary; resumed without it, the run ends with
    bitwise the weights of one never stopped."""
    from harness import train_on_ranks
    whole = small_config(small_data, tmp_path / "whole", steps=3)
    train_on_ranks(2, whole)
    cfg = small_config(small_data, tmp_path / "run", steps=3, exit_after_minutes=1e-9, resume="auto")
    summary = train_on_ranks(2, cfg)["summary"]
    assert summary["steps"] == 1 and summary["stopped_by"] == "exit_after_minutes=1e-09 (reached on 2 of 2 ranks)"
    log = (tmp_path / "run" / "logs" / "rank0000.log").read_text()
    assert "exit_after_minutes=1e-09: every rank saves and stops after the first step past 20" in log
    assert "stopped by exit_after_minutes=1e-09 (reached on 2 of 2 ranks) after step 1: saved" in log
    cfg.exit_after_minutes = 0
    assert train_on_ranks(2, cfg)["summary"]["steps"] == 3
    first = small_config(small_data, tmp_path / "first", steps=3, exit_after_minutes=1e-9, eval_interval=2)
    assert train_on_ranks(2, first)["summary"]["steps"] == 0              # (cut short: the evaluation at step 0)
    assert "exit_after_minutes=1e-09 passed before the first step: raise it, or every start stops here" in \
        (tmp_path / "first" / "logs" / "rank0000.log").read_text()
    _same_weights(tmp_path / "run" / "checkpoints" / "step_000003", tmp_path / "whole" / "checkpoints" / "step_000003")


def _until(condition, seconds: float = 5.0) -> bool:
    """Wait for `condition` (a signal sent to this process runs its Python handler at the main thread's next check)."""
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)
    return condition()


def test_each_stopping_signal_is_a_request_and_a_second_ctrl_c_interrupts():
    """StopRequest turns each signal that ends a job (SIGTERM, Ctrl-C, a hangup, Slurm's --signal=USR1 warning) into
    a request to save and stop, named after the first that came; a second Ctrl-C interrupts at once, and a signal
    the process was started ignoring (nohup's SIGHUP) stays ignored."""
    from megatron_mini.launch import StopRequest
    names = ["SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1"]
    saved = {s: signal.getsignal(s) for s in StopRequest.SIGNALS}
    try:
        for name in names:
            for s in StopRequest.SIGNALS:
                signal.signal(s, signal.SIG_DFL)
            stop = StopRequest()
            handled = [n for n in names if signal.getsignal(getattr(signal, n)) == stop._handle]
            assert handled == names, handled              # (before sending: an unhandled one would end the test)
            os.kill(os.getpid(), getattr(signal, name))
            assert _until(lambda: stop.requested)
            os.kill(os.getpid(), signal.SIGTERM)          # a later one: the first names the request
            assert _until(lambda: stop.name == name and signal.getsignal(signal.SIGTERM) == stop._handle)
        os.kill(os.getpid(), signal.SIGINT)               # the last request's first Ctrl-C: asked again
        assert _until(lambda: signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        with pytest.raises(KeyboardInterrupt):            # the second: now
            os.kill(os.getpid(), signal.SIGINT)
            _until(lambda: False)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        stop = StopRequest()
        os.kill(os.getpid(), signal.SIGHUP)
        assert not _until(lambda: stop.requested, 0.2) and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def test_a_ctrl_c_that_a_callback_swallowed_is_raised_as_the_signals_are_taken(monkeypatch):
    """Python passes on no exception raised in a callback (a weakref's, a __del__; the import system runs some as a
    module is imported): it prints "Exception ignored" and goes on. A Ctrl-C whose KeyboardInterrupt Python's own
    handler raised there was lost, and the command went on to train (a rank of a job then waited in the rendezvous
    for the ranks that the Ctrl-C, forwarded by torchrun, had ended, until torchrun's SIGKILL 30 s later). With
    EarlyInterrupt, SIGINT's handler from train.py's first lines, StopRequest.take raises it again."""
    from megatron_mini.launch import STOPPING, EarlyInterrupt, StopRequest

    class Callback:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)

    swallowed = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: swallowed.append(u.exc_type))
    saved = {s: signal.getsignal(s) for s in StopRequest.SIGNALS}
    try:
        for early in (False, True):
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if early:
                EarlyInterrupt.install()
            Callback()                                    # (collected at once: the Ctrl-C comes in its __del__)
            assert swallowed == [KeyboardInterrupt] * (1 + early), swallowed
            before, stop = signal.getsignal(signal.SIGINT), StopRequest(take_signals=False)
            try:
                if early:
                    with pytest.raises(KeyboardInterrupt):
                        stop.take(STOPPING, signal.SIG_DFL)
                else:                                     # Python's own handler: lost
                    stop.take(STOPPING, signal.SIG_DFL)
            finally:
                stop.close()
            assert signal.getsignal(signal.SIGINT) is before
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


def test_a_held_signal_stops_as_the_outermost_hold_ends():
    """stop_on_signals + signals_held: a signal within a hold (nested ones too) lets the held code finish and raises
    Stopped as the outermost hold ends, with this thread's signal mask as it was; an exception leaving a hold while
    a signal waits gives way to the Stopped, and no signal is left over for a later hold; a signal outside any hold
    raises at once. With a second thread alive, which the kernel may hand the signal to."""
    import threading

    from megatron_mini.launch import STOPPING, Stopped, signals_held, stop_on_signals
    saved = {s: signal.getsignal(s) for s in STOPPING}
    alive = threading.Event()
    threading.Thread(target=alive.wait, daemon=True).start()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    ran = []
    try:
        stop_on_signals()
        with pytest.raises(Stopped, match="SIGHUP"):
            with signals_held():
                with signals_held():
                    os.kill(os.getpid(), signal.SIGHUP)
                    _until(lambda: False, 0.1)
                    ran.append("inner")
                ran.append("outer")
        assert ran == ["inner", "outer"] and signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
        with pytest.raises(Stopped, match="SIGTERM"):
            with signals_held():
                os.kill(os.getpid(), signal.SIGTERM)
                raise ValueError("the work failed")
        with signals_held():
            ran.append("clean")                           # (nothing left over from before)
        with pytest.raises(Stopped, match="SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
            _until(lambda: False)
        assert ran[-1] == "clean" and signal.pthread_sigmask(signal.SIG_BLOCK, []) == mask
    finally:
        alive.set()
        for s, handler in saved.items():
            signal.signal(s, handler)


def _handlers_around_train(cfg):
    """The handlers of StopRequest's signals before train(cfg) on this rank (its main thread), and after."""
    from megatron_mini.launch import StopRequest
    from megatron_mini.training import train
    before = [repr(signal.getsignal(s)) for s in StopRequest.SIGNALS]
    train(cfg)
    return before, [repr(signal.getsignal(s)) for s in StopRequest.SIGNALS]


def test_train_gives_the_signals_back_when_it_returns(small_data, tmp_path):
    """train(cfg) takes SIGTERM, SIGINT, SIGHUP and SIGUSR1 as stop requests only while it runs: a program that
    calls it (a notebook, a script that trains then generates) gets Ctrl-C as KeyboardInterrupt again after it
    returns, not a request nobody reads."""
    before, after = spawn(1, _handlers_around_train, small_config(small_data, tmp_path, gbs=4, steps=2),
                          init_group=False)[0]
    assert after == before, (before, after)


def test_workers_stop_when_their_launcher_dies(small_data, tmp_path):
    """kill -9 of torchrun: its workers get SIGTERM (parent-death signal), save and exit; no orphan trains on."""
    run_dir = tmp_path / "run"
    with running(torchrun_argv(2, [*model_args(small_data, run_dir), *RESUMABLE, "steps=400"]), env()) as proc:
        _wait_for(proc, run_dir / "logs" / "rank0000.log", "step     2/")
        workers = _workers(proc)
        proc.kill()
        proc.communicate()
    deadline = time.monotonic() + 60
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_alive(w) for w in workers)
    # both get the signal at once, but a step's stop vote may count one of them before the other's arrives
    assert re.search(r"stopped by SIGTERM \(to [12] of 2 ranks\)", (run_dir / "logs" / "rank0000.log").read_text())


def _pending(pid: int, signum: int) -> bool:
    """Whether signal `signum` waits to be delivered to process `pid` (a stopped one's)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return any(int(re.search(rf"^{field}:\s*([0-9a-f]+)", status, re.M)[1], 16) >> (signum - 1) & 1
               for field in ("SigPnd", "ShdPnd"))


def test_a_worker_whose_launcher_dies_while_it_starts_stops(small_data, tmp_path, hooks):
    """kill -9 of torchrun while its worker starts (stopped as it imports megatron_mini.training, which imports
    torch: seconds, a minute from a shared file system): continued, the worker ends at once, trained nothing. It
    asked for the parent-death signal only in train(), after the imports, and then compared its parent's pid, read
    there, with itself: init's by then, so it trained on as an orphan."""
    run_dir = tmp_path / "run"
    with running(torchrun_argv(1, [*model_args(small_data, run_dir), "steps=400"]),
                 env(hooks, HOOK_STOP_RANK=0, HOOK_STOP_AT="megatron_mini.training")) as proc:
        deadline = time.monotonic() + 60
        while not _workers(proc) and time.monotonic() < deadline:
            time.sleep(0.05)
        (worker,) = _workers(proc)
        try:
            _wait_stopped(worker, "the worker (as it imports megatron_mini.training)")
            proc.kill()
            proc.wait()
            os.kill(worker, signal.SIGCONT)
            deadline = time.monotonic() + 20
            while _alive(worker) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _alive(worker), "the worker outlived its launcher by 20 s"
        finally:
            if _alive(worker):
                os.kill(worker, signal.SIGKILL)
    assert not (run_dir / "checkpoints").exists()


def test_a_stalled_rank_ends_the_job(small_data, tmp_path):
    """kill -STOP of one of 2 ranks: the other's collective fails after timeout_s with a message naming the rank,
    the collective and its group; torchrun then sends the stopped rank SIGTERM, which it cannot act on while stopped
    (torchrun kills it 30 s later). Continued (kill -CONT) once that SIGTERM waits, it finds its peer gone and exits
    at once, adding no error of its own (train.Terminated): the job's one line is the other rank's."""
    timeout_s = 5
    run_dir = tmp_path / "run"
    with running(torchrun_argv(2, [*model_args(small_data, run_dir), *RESUMABLE, "steps=400",
                                   f"timeout_s={timeout_s}"]), env()) as proc:
        _wait_for(proc, run_dir / "logs" / "rank0000.log", "step     2/")
        rank0, rank1 = _workers(proc)
        os.kill(rank1, signal.SIGSTOP)
        stopped = time.monotonic()
        while not _pending(rank1, signal.SIGTERM) and time.monotonic() < stopped + timeout_s + 20:
            time.sleep(0.05)
        assert not _alive(rank0) and _pending(rank1, signal.SIGTERM), "rank 0 did not fail, or torchrun sent no SIGTERM"
        os.kill(rank1, signal.SIGCONT)
        r = finish(proc)
    # (continued, it ends in seconds; left to torchrun's 30 s kill grace it would take timeout_s + 30 s and more: the
    # bound is between the two, with room for a loaded CI machine, where 16.5 s was seen against the 10 s alone)
    assert time.monotonic() - stopped < timeout_s + 20, r
    assert_one_error(r, ["rank 0: ", "group (ranks [0, 1]) failed"], "torchrun",
                     code=1, quick=False)
    if TORCHRUN_LISTS_STOPPED_RANKS:
        assert re.search(r"exitcode\s*: 143 ", r.err), r       # (rank 1: Terminated, not killed)


def test_a_bug_on_one_rank_is_the_root_cause_with_its_traceback(small_data, tmp_path, hooks):
    """Rank 1 raises an exception no one explains (a bug: the hook's ZeroDivisionError in a layer norm, mid-step):
    its traceback is on its stderr and is the Root Cause of torchrun's report; rank 0, whose all-reduce then finds
    rank 1's connection closed, adds no line of its own and is stopped by torchrun. Rank 1 wrote no error file, so
    rank 0's CommError ('Connection closed by peer') was the root cause; and written at once, rank 0's file was as
    early as rank 1's in torchrun's whole seconds, where a tie goes to the rank torchrun saw end first."""
    r = torchrun_train(2, [*model_args(small_data, tmp_path / "run"), "steps=4"],
                       env(hooks, HOOK_RAISE_RANK=1, HOOK_RAISE_AT_CALL=100))     # (17 calls a forward: mid-run)
    bug = "ZeroDivisionError: hook: a bug in rank 1's layer norm"
    own, report = r.err.split("Root Cause (first observed failure):")
    assert r.rc == 1 and "error: " not in r.all, r
    assert re.search(r'File "[^"]*megatron_mini/model\.py", line \d+, in forward\n(.*\n)*' + re.escape(bug), own), r
    assert re.search(r"rank\s*: 1 ", report) and bug in report and "megatron_mini/model.py" in report, r
    if TORCHRUN_LISTS_STOPPED_RANKS:                                                     # (rank 0: stopped by torchrun)
        assert re.search(r"rank\s*: 0 \(local_rank: 0\)\n\s*exitcode\s*: -15 ", own), r


@pytest.mark.parametrize("end", ["SIGKILL to rank 1", "SIGINT to torchrun"])
def test_a_job_stopped_before_its_ranks_meet_ends_at_once(small_data, tmp_path, hooks, end):
    """Rank 0 waits in the rendezvous for rank 1, which has not started (stopped as it starts); then rank 1 dies
    (kill -9), or Ctrl-C to torchrun, which forwards it to both: the job ends at once, rank 1's end its root cause.
    Rank 0 took torchrun's SIGTERM (or the SIGINT) as a request to stop after a step, and could not act on it in the
    wait either: torchrun killed it 30 s later."""
    run_dir = tmp_path / "run"
    with running(torchrun_argv(2, [*model_args(small_data, run_dir), "timeout_s=120"]),
                 env(hooks, HOOK_STOP_RANK=1)) as proc:
        _wait_for(proc, run_dir / ".lock")                  # rank 0 has the run directory: it goes on to meet rank 1
        rank0, rank1 = _workers(proc)
        _wait_stopped(rank1, "rank 1 (as it starts)")
        time.sleep(1.0)                                     # (rank 0 reads the data, then waits for rank 1)
        if end == "SIGKILL to rank 1":
            os.kill(rank1, signal.SIGKILL)
        else:
            os.kill(proc.pid, signal.SIGINT)
            os.kill(rank1, signal.SIGCONT)                  # (rank 1 then ends on it as it starts)
        ended = time.monotonic()
        r = finish(proc)
    assert time.monotonic() - ended < 15, r
    assert r.rc != 0 and not _alive(rank0), r
    if end == "SIGKILL to rank 1":
        cause = r.err.split("Root Cause (first observed failure):")[-1]
        assert re.search(r"rank\s*: 1 ", cause) and re.search(r"exitcode\s*: -9 ", cause), r


def test_ctrl_c_as_a_run_starts_ends_it_without_a_traceback(small_data, tmp_path, hooks):
    """Ctrl-C while the command imports torch (stopped there by the hook, given SIGINT, continued), before train()
    takes it as a request to stop: the command ends at once by SIGINT (a shell's 130), silent (a KeyboardInterrupt
    traceback into an import, printed by every rank), and trained nothing."""
    from commandline import PYTHON
    run_dir = tmp_path / "run"
    with running([PYTHON, "train.py", *model_args(small_data, run_dir)],
                 env(hooks, RANK=0, WORLD_SIZE=1, HOOK_STOP_RANK=0, HOOK_STOP_AT="megatron_mini.training")) as proc:
        _wait_stopped(proc.pid, "the command (as it imports megatron_mini.training)")
        os.kill(proc.pid, signal.SIGINT)
        os.kill(proc.pid, signal.SIGCONT)
        r = finish(proc, limit=20)
    assert r.rc == -signal.SIGINT and r.all == "", r
    assert not run_dir.exists()


def test_a_ctrl_c_lost_in_a_callback_as_a_run_starts_still_ends_it(small_data, tmp_path, hooks):
    """Ctrl-C while a callback runs (the hook's __del__, as the command imports megatron_mini.training), where
    Python cannot raise its KeyboardInterrupt: printed as "Exception ignored", it was lost, and the run trained to
    its end. train() raises it again before it makes the run directory: the command ends by SIGINT, trained
    nothing."""
    from commandline import PYTHON
    run_dir = tmp_path / "run"
    r = finish(start([PYTHON, "train.py", *model_args(small_data, run_dir)],
                     env(hooks, RANK=0, WORLD_SIZE=1, HOOK_LOSE_SIGINT_AT="megatron_mini.training")), limit=60)
    assert r.rc == -signal.SIGINT and "Exception ignored" in r.err, r
    assert not run_dir.exists()


def test_a_second_ctrl_c_mid_step_ends_it_without_a_traceback_with_wandb_on(small_data, tmp_path, hooks):
    """A second Ctrl-C raises KeyboardInterrupt wherever the step is (the hook raises it in a LayerNorm, mid-step):
    the command ends at once by SIGINT (a shell's 130), unsaved and silent, as before train(), also with wandb on
    (offline, the default without an API key): wandb.init wraps sys.excepthook in a hook that prints every
    traceback, which was 60 lines through the model's frames. wandb still records the run as interrupted, with the
    exit code its own hook gives a Ctrl-C (255; 0, a finished run, once its hook was replaced): its debug.log says."""
    from commandline import PYTHON
    run_dir = tmp_path / "run"
    r = finish(start([PYTHON, "train.py", *model_args(small_data, run_dir)],
                     env(hooks, RANK=0, WORLD_SIZE=1, WANDB_MODE="offline", HOOK_RAISE_RANK=0, HOOK_RAISE_AT_CALL=100,
                         HOOK_RAISE="KeyboardInterrupt")), limit=60)      # (17 calls a forward: mid-run)
    assert r.rc == -signal.SIGINT, r
    assert "Traceback" not in r.all and "KeyboardInterrupt" not in r.all, r
    assert (run_dir / "wandb").is_dir() and not (run_dir / "checkpoints").exists(), r
    (log,) = (run_dir / "wandb").glob("offline-run-*/logs/debug.log")
    assert re.findall(r"got exitcode: (\d+)", log.read_text()) == ["255"], log.read_text()[-2000:]


def test_torchrun_restarts_after_a_kill_and_resumes_exactly(small_data, tmp_path, hooks, uninterrupted):
    """torchrun --max-restarts=1 and resume=auto: kill -9 of a rank mid-run; the restarted job resumes from the
    last checkpoint and ends with bitwise the weights of an uninterrupted run. "Mid-run" is made certain, not
    raced: rank 0 stops itself (SIGSTOP) after its 17th fsync (the first file of the step-6 save, after the lock,
    the config and 7 a save: 3 files, meta.json, 2 directories and `latest`; step 4 is saved and named by
    `latest`), so the job cannot reach its end before the kill, however late the kill is."""
    run_dir = tmp_path / "run"
    args = [*model_args(small_data, run_dir), *RESUMABLE, "steps=10"]
    with running(torchrun_argv(2, args, "--max-restarts=1"),
                 env(hooks, HOOK_CRASH_RANK=0, HOOK_CRASH_AT_FSYNC=17, HOOK_CRASH_SIGNAL="SIGSTOP")) as proc:
        _wait_for(proc, run_dir / "checkpoints" / "latest", "step_000004")
        rank0, rank1 = _workers(proc)
        _wait_stopped(rank0, "rank 0 (at its 17th fsync)")
        os.kill(rank1, signal.SIGKILL)
        os.kill(rank0, signal.SIGCONT)
        r = finish(proc)
    assert r.rc == 0, r
    assert f"resumed from {run_dir}/checkpoints/step_000004" in r.out, r
    _same_weights(run_dir / "checkpoints" / "step_000010", uninterrupted / "step_000010")


def test_a_kill_during_a_save_resumes_from_the_previous_checkpoint(small_data, tmp_path, hooks, uninterrupted):
    """Rank 0, the writer, dies (SIGKILL) in the middle of the second save, after writing one file (its 10th
    fsync: the run directory's lock, the run's config, the first save's 3 files (weights, optimizer, tokenizer),
    meta.json, its directory and checkpoints/ (Save._publish's syncs) and `latest`, then the second save's
    weights): the half-written step_000004.tmp is never taken; the
    restarted job removes it, saying so, resumes from step 2 and ends as the uninterrupted run."""
    run_dir = tmp_path / "run"
    args = [*model_args(small_data, run_dir), *RESUMABLE, "steps=6"]
    r = finish(start(torchrun_argv(2, args, "--max-restarts=1"), env(hooks, HOOK_CRASH_RANK=0, HOOK_CRASH_AT_FSYNC=10)))
    assert r.rc == 0, r
    assert f"resumed from {run_dir}/checkpoints/step_000002" in r.out, r
    assert f"resume: removed {run_dir}/checkpoints/step_000004.tmp, the partial files of a save that a crash " \
           f"interrupted" in r.out, r
    assert not list((run_dir / "checkpoints").glob("*.tmp"))
    _same_weights(run_dir / "checkpoints" / "step_000006", uninterrupted / "step_000006")


@pytest.mark.parametrize("signame", ["SIGINT", "SIGHUP"])
def test_ctrl_c_or_hangup_to_torchrun_saves_and_resume_continues_exactly(small_data, tmp_path, hooks, uninterrupted,
                                                                         signame):
    """Ctrl-C (SIGINT) or a hangup (SIGHUP: the terminal or ssh session gone) to torchrun, which forwards it to its
    workers: every rank saves at the end of the step and stops, with no traceback of ours (SIGINT was a
    KeyboardInterrupt on every rank, from inside a collective; SIGHUP killed them; the steps since the last
    checkpoint were lost either way); the resumed run ends as the uninterrupted one. As in the SIGTERM test, rank 0
    stops itself in the step-4 save, so the signal lands mid-run."""
    def to_the_launcher(launcher, rank0, rank1):
        os.kill(launcher, getattr(signal, signame))
        deadline = time.monotonic() + 30                      # torchrun forwards it: pending on the stopped rank 0
        while "SigPnd:\t0000000000000000" in Path(f"/proc/{rank0}/status").read_text() \
                and "ShdPnd:\t0000000000000000" in Path(f"/proc/{rank0}/status").read_text() \
                and time.monotonic() < deadline:
            time.sleep(0.05)
    r, run_dir, args = _stopped_mid_run(small_data, tmp_path, hooks, to_the_launcher)
    assert "KeyboardInterrupt" not in r.all and not re.search(r'File "[^"]*(megatron_mini|train\.py)"', r.all), r
    stopped = re.search(rf"stopped by {signame} \(to [12] of 2 ranks\) after step (\d+)", r.out)
    assert stopped and int(stopped[1]) < 10, r
    assert (run_dir / "checkpoints" / f"step_{int(stopped[1]):06d}").is_dir()
    again = torchrun_train(2, args)
    assert again.rc == 0 and f"resumed from {run_dir}/checkpoints/step_{int(stopped[1]):06d}" in again.out, again
    _same_weights(run_dir / "checkpoints" / "step_000010", uninterrupted / "step_000010")


def test_a_run_without_a_launcher_outlives_the_shell_that_started_it(small_data, tmp_path):
    """`nohup python train.py ... &`, then the shell exits (a logout): the run trains on to its last step. The
    parent-death signal is for torchrun's workers; given to a run without a launcher, it stopped the run (after a
    save, "stopped by SIGTERM") as soon as its shell was gone."""
    from commandline import PYTHON
    run_dir = tmp_path / "run"
    argv = [PYTHON, "train.py", *model_args(small_data, run_dir), "steps=30", "log_interval=1"]
    log = run_dir / "logs" / "rank0000.log"
    shell = (f"import pathlib, subprocess, sys, time\n"          # starts the run, waits until it trains, exits
             f"run = subprocess.Popen({argv!r}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
             f"print(run.pid, flush=True)\n"
             f"log = pathlib.Path({str(log)!r})\n"
             f"while not (log.exists() and 'step     2/' in log.read_text()) and run.poll() is None:\n"
             f"    time.sleep(0.05)\n")
    r = finish(start([PYTHON, "-c", shell], env()))
    assert r.rc == 0, r
    run = int(r.out.split()[0])
    deadline = time.monotonic() + 120
    while _alive(run) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(run), "the run did not end within 120 s"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 30 and "stopped_by" not in summary, (summary, log.read_text())
