"""The command line as a user meets it, for tests: `python train.py ...` and `torchrun ... train.py ...`
in subprocesses, with a wall-clock limit, and the checks every refusal must pass.

Test hooks reach the rank processes through a `sitecustomize.py` (put on PYTHONPATH by `env(hooks=...)`),
read from environment variables, acting only in processes that torchrun started (RANK is set), but the first:
  HOOK_UNRESOLVABLE_HOST=1                     in every process, torchrun's agent too: socket.getfqdn() is a
                                               name no resolver knows, as on a Mac whose name is in no DNS
  HOOK_NO_PYTHON_HEADERS=1                     in every process: sysconfig's include directory (get_path's and
                                               get_paths') is the hooks' directory, which holds no Python.h
                                               (python3.X-dev not installed)
  HOOK_SLOW_RANKS=rank0|others, HOOK_SLOW_S   start those ranks late (which rank fails first)
  HOOK_FSIZE_LIMIT=bytes                       no file may grow past this (RLIMIT_FSIZE): a full disk
  HOOK_CRASH_RANK=r, HOOK_CRASH_AT_FSYNC=n     rank r kills itself (SIGKILL) right after its n-th
                                               os.fsync (the checkpoint writer's), on the first attempt
  HOOK_CRASH_SIGNAL=SIGSTOP                    ... or stops itself there instead (the test resumes it)
  HOOK_DRIFT_RANK=r                            rank r's F.layer_norm scales its output by 1 + 2^-20: a kernel
                                               whose rounding differs from the other ranks'
  HOOK_STOP_RANK=r                             rank r stops itself (SIGSTOP) as it starts, before it imports
                                               anything: the test decides what becomes of it
  HOOK_STOP_AT=module                          ... or as it first imports `module` (megatron_mini.training)
  HOOK_LOSE_SIGINT_AT=module                   as it first imports `module`, a callback (a __del__) gets a
                                               Ctrl-C, whose KeyboardInterrupt Python cannot pass on from there
  HOOK_RAISE_RANK=r, HOOK_RAISE_AT_CALL=n      rank r's F.layer_norm raises ZeroDivisionError at its n-th call:
                                               a bug that stops one rank mid-step
  HOOK_RAISE=KeyboardInterrupt                 ... or KeyboardInterrupt, as a second Ctrl-C raises it mid-step
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
TORCHRUN = Path(PYTHON).with_name("torchrun")
RUN_LIMIT_S = 150      # a run past this is killed: it hung
QUICK_S = 40           # a bad config ends well before any collective timeout (300 s by default)

SITECUSTOMIZE = """\
import os, signal, time
if os.environ.get("HOOK_UNRESOLVABLE_HOST"):
    import socket
    socket.getfqdn = lambda name="": "unresolvable.invalid"
if os.environ.get("HOOK_NO_PYTHON_HEADERS"):
    import sysconfig
    _get_path, _get_paths, _here = sysconfig.get_path, sysconfig.get_paths, os.path.dirname(__file__)
    sysconfig.get_path = lambda name, *a, **k: _here if name == "include" else _get_path(name, *a, **k)
    sysconfig.get_paths = lambda *a, **k: {**_get_paths(*a, **k), "include": _here}     # (Triton's build asks this)
if os.environ.get("RANK") is not None:
    _rank = os.environ["RANK"]
    _slow = os.environ.get("HOOK_SLOW_RANKS")
    if _slow and ((_slow == "rank0") == (_rank == "0")):
        time.sleep(float(os.environ.get("HOOK_SLOW_S", "4")))
    if os.environ.get("HOOK_FSIZE_LIMIT"):
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # a write past the limit fails with EFBIG
        _n = int(os.environ["HOOK_FSIZE_LIMIT"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (_n, _n))
    if os.environ.get("HOOK_CRASH_RANK") == _rank and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        _fsync, _calls, _at = os.fsync, [0], int(os.environ["HOOK_CRASH_AT_FSYNC"])
        _sig = getattr(signal, os.environ.get("HOOK_CRASH_SIGNAL", "SIGKILL"))
        def _crashing_fsync(fd):
            _fsync(fd)
            _calls[0] += 1
            if _calls[0] == _at:
                os.kill(os.getpid(), _sig)
        os.fsync = _crashing_fsync
    if os.environ.get("HOOK_STOP_RANK") == _rank and not os.environ.get("HOOK_STOP_AT"):
        os.kill(os.getpid(), signal.SIGSTOP)
    if os.environ.get("HOOK_STOP_RANK") == _rank and os.environ.get("HOOK_STOP_AT"):
        import builtins
        _import = builtins.__import__
        def _stopping_import(name, *args, **kwargs):
            if name == os.environ["HOOK_STOP_AT"]:
                builtins.__import__ = _import
                os.kill(os.getpid(), signal.SIGSTOP)
            return _import(name, *args, **kwargs)
        builtins.__import__ = _stopping_import
    if os.environ.get("HOOK_LOSE_SIGINT_AT"):
        import builtins
        _imports = builtins.__import__
        class _Callback:
            def __del__(self):
                signal.raise_signal(signal.SIGINT)
        def _losing_import(name, *args, **kwargs):
            if name == os.environ["HOOK_LOSE_SIGINT_AT"]:
                builtins.__import__ = _imports
                _Callback()
            return _imports(name, *args, **kwargs)
        builtins.__import__ = _losing_import
    if os.environ.get("HOOK_DRIFT_RANK") == _rank:
        import torch.nn.functional as _F
        _layer_norm = _F.layer_norm
        _F.layer_norm = lambda *args, **kwargs: _layer_norm(*args, **kwargs) * (1 + 2 ** -20)
    if os.environ.get("HOOK_RAISE_RANK") == _rank:
        import torch.nn.functional as _F
        _norm, _norms, _raise_at = _F.layer_norm, [0], int(os.environ["HOOK_RAISE_AT_CALL"])
        def _raising_layer_norm(*args, **kwargs):
            _norms[0] += 1
            if _norms[0] == _raise_at and os.environ.get("HOOK_RAISE") == "KeyboardInterrupt":
                raise KeyboardInterrupt
            if _norms[0] == _raise_at:
                raise ZeroDivisionError(f"hook: a bug in rank {_rank}'s layer norm")
            return _norm(*args, **kwargs)
        _F.layer_norm = _raising_layer_norm
"""


def env(hooks: Path | None = None, interpreter: bool = True, **variables) -> dict:
    """The environment of a launched run: none of the launcher variables of an outer job; the test
    hooks when given; TRITON_INTERPRET dropped unless `interpreter`."""
    e = {k: v for k, v in os.environ.items()
         if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_TASKS_PER_NODE",
                      "SLURM_STEP_TASKS_PER_NODE", "HYDRA_FULL_ERROR")}
    if not interpreter:
        e.pop("TRITON_INTERPRET", None)
    e.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    if hooks:
        e["PYTHONPATH"] = os.pathsep.join([str(hooks)] + [p for p in [e.get("PYTHONPATH")] if p])
    e.update({k: str(v) for k, v in variables.items()})
    return e


class Result:
    def __init__(self, rc: int, out: str, err: str, elapsed: float):
        self.rc, self.out, self.err, self.elapsed = rc, out, err, elapsed
        self.all = out + err

    def __repr__(self) -> str:  # shown by pytest on a failed assert
        return f"<rc={self.rc} in {self.elapsed:.1f}s\n--- stdout ---\n{self.out}\n--- stderr ---\n{self.err}>"


def start(argv: list, environment: dict) -> subprocess.Popen:
    """Start argv from the repository root in its own process group."""
    proc = subprocess.Popen(argv, cwd=REPO, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    proc.started = time.monotonic()
    return proc


@contextlib.contextmanager
def running(argv: list, environment: dict):
    """start(argv) for a test that acts on the job while it runs; whatever the test does, nothing of the job
    outlives the block (a failed wait or assert kills it and every process below it, stopped ones too)."""
    proc = start(argv, environment)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            kill_tree(proc)
            proc.communicate()


def descendants(pid: int) -> list:
    """Every process below `pid` (torchrun puts its workers in sessions of their own)."""
    try:
        children = [int(c) for t in os.listdir(f"/proc/{pid}/task")
                    for c in open(f"/proc/{pid}/task/{t}/children").read().split()]
    except OSError:
        return []
    return children + [d for c in children for d in descendants(c)]


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc` and every process below it (all of them listed before the first is killed)."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def finish(proc: subprocess.Popen, limit: float = RUN_LIMIT_S) -> Result:
    """Wait for `proc`; past `limit` seconds it and every process below it are killed and the test fails."""
    try:
        out, err = proc.communicate(timeout=max(1.0, limit - (time.monotonic() - proc.started)))
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, proc.args))} hung for {limit} s\nstdout:\n{out}\nstderr:\n{err}")
    return Result(proc.returncode, out, err, time.monotonic() - proc.started)


def torchrun_argv(nproc: int, args: list, *launcher_args: str) -> list:
    launcher = [str(TORCHRUN)] if TORCHRUN.exists() else [PYTHON, "-m", "torch.distributed.run"]
    # one machine: the ranks meet at 127.0.0.1, not at its name (socket.getfqdn()), which may not resolve (macOS)
    return [*launcher, "--standalone", "--local-addr=127.0.0.1", f"--nproc_per_node={nproc}", *launcher_args,
            "train.py", *args]


def python_train(args: list, environment: dict | None = None) -> Result:
    return finish(start([PYTHON, "train.py", *args], environment or env()))


def torchrun_train(nproc: int, args: list, environment: dict | None = None) -> Result:
    return finish(start(torchrun_argv(nproc, args), environment or env()))


def model_args(data, run_dir) -> list:
    """The test model (8 blocks, hidden 64, 4 heads, sequence 32) on the test data, 2 steps, no memory plan."""
    return [f"data.source={data.source}", f"data.dir={data.dir}", f"data.vocab_size={data.vocab_size}",
            f"data.val_fraction={data.val_fraction}", "data.num_workers=1",
            "model.num_layers=8", "model.hidden_size=64", "model.num_heads=4", "model.seq_len=32",
            "steps=2", "eval_iters=1", f"run_dir={run_dir}", "device=cpu",   # a config that wrongly passes ends soon
            "memory_plan=false"]   # the planner's report (seconds on rank 0): test_two_rank_run_succeeds, test_planner


_FRAME = re.compile(r'File "([^"]+)", line \d+')


def root_cause(r: Result) -> str:
    """The "traceback" line of the Root Cause section of torchrun's failure report."""
    section = r.all.split("Root Cause (first observed failure):", 1)
    assert len(section) == 2, r
    found = re.search(r"traceback\s*:\s*(.*)", section[1])
    assert found, r
    return found.group(1).strip()


def assert_torchrun_report(r: Result, code: int = 2) -> None:
    """torchrun's own failure report is allowed; anything more is not."""
    assert r.rc == 1, r                                # torchrun's exit code for a failed child
    assert r.all.count("Traceback (most recent call last)") <= 1, r
    ours = [f for f in _FRAME.findall(r.all) if f.endswith("train.py") or "megatron_mini" in f]
    assert not ours, r
    if "Traceback" in r.all:
        assert "ChildFailedError" in r.all, r
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", r.all)]
    assert code in codes, r                            # the first rank to fail left with our code
    assert all(c in (code, -15, -9, 143) for c in codes), r   # the others exited so or were stopped by torchrun


def assert_one_error(r: Result, facts: list, launcher: str, code: int = 2, quick: bool = True) -> None:
    """Our one-paragraph message, once, on stderr, naming every fact; exit `code` (1 from torchrun, whose
    Root Cause names our message); no traceback of ours; quick (before any collective could hang)."""
    assert r.rc != 0, r
    assert not quick or r.elapsed < QUICK_S, r
    lines = [ln for ln in r.err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, r                          # one message, whatever the number of ranks
    for fact in facts:
        assert fact in lines[0], (fact, r)
        expected = 2 if launcher == "torchrun" else 1  # ours, and torchrun's Root Cause section
        assert r.all.count(fact) == expected, (fact, r)
    assert "error: " not in r.out, r
    if launcher == "python":
        assert r.rc == code, r
        assert "Traceback" not in r.all, r
    else:
        assert_torchrun_report(r, code)
        assert root_cause(r) == lines[0][len("error: "):], r
