"""The command line as a user meets it: `python train.py ...` and `torchrun ... train.py ...` in subprocesses.

A bad configuration must end every rank with one clear paragraph and a non-zero exit, before any
process group exists: never a hang, never a traceback from our code. Every run has a wall-clock
limit (its whole process group is killed past it), so a hang fails the test instead of stalling it.

torchrun itself answers a failed child with its own report: a Python traceback of torchrun's frames
ending in `ChildFailedError`, the ranks' exit codes and a "Root Cause" block. That wall is torchrun's,
not ours (nothing in train.py can suppress it); what we check there is that no frame of it comes from
train.py or megatron_mini, that the first failing rank exited with our code 2 (not 1, an uncaught
exception), and that our message is printed once above it.

Which rank reaches the error first is a race between processes. To keep these checks deterministic,
`_sitecustomize` lets a test start some ranks late: `slow="others"` gives rank 0 a head start (the
usual case), `slow="rank0"` makes rank 0 the last to fail (test_message_survives_slow_rank0).
"""
from __future__ import annotations

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
RUN_LIMIT_S = 120      # a run past this is killed: it hung
QUICK_S = 40           # a bad config ends well before any collective timeout (300 s by default)
SLOW_START_S = 4       # how late the slowed ranks start (a sleeper is killed by torchrun when a peer fails)

_SITECUSTOMIZE = """\
import os, time
_rank, _slow = os.environ.get("RANK"), os.environ.get("CLI_TEST_SLOW_RANKS")
if _rank is not None and _slow and ((_slow == "rank0") == (_rank == "0")):
    time.sleep(float(os.environ.get("CLI_TEST_SLOW_S", "4")))
"""


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli_site")
    (d / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    return d


def _env(site_dir: Path | None = None, slow: str | None = None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "HYDRA_FULL_ERROR")}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONUNBUFFERED="1")
    if slow:
        env["PYTHONPATH"] = os.pathsep.join([str(site_dir)] + [p for p in [env.get("PYTHONPATH")] if p])
        env.update(CLI_TEST_SLOW_RANKS=slow, CLI_TEST_SLOW_S=str(SLOW_START_S))
    return env


class Result:
    def __init__(self, rc: int, out: str, err: str, elapsed: float):
        self.rc, self.out, self.err, self.elapsed = rc, out, err, elapsed
        self.all = out + err

    def __repr__(self) -> str:  # shown by pytest on a failed assert
        return f"<rc={self.rc} in {self.elapsed:.1f}s\n--- stdout ---\n{self.out}\n--- stderr ---\n{self.err}>"


def _run(argv: list, env: dict) -> Result:
    """Run argv from the repository root in its own process group; kill the whole group past RUN_LIMIT_S."""
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, argv))} hung for {RUN_LIMIT_S} s\nstdout:\n{out}\nstderr:\n{err}")
    return Result(proc.returncode, out, err, time.monotonic() - start)


def _model_args(data, run_dir) -> list:
    return [f"data.source={data.source}", f"data.dir={data.dir}", f"data.vocab_size={data.vocab_size}",
            f"data.val_fraction={data.val_fraction}", "data.num_workers=1",
            "model.num_layers=8", "model.hidden_size=64", "model.num_heads=4", "model.seq_len=32",
            "steps=2", "eval_iters=1", f"run_dir={run_dir}"]   # a config that wrongly passes ends soon


def python_train(args: list) -> Result:
    return _run([PYTHON, "train.py", *args], _env())


def torchrun_train(nproc: int, args: list, site_dir: Path | None = None, slow: str | None = None) -> Result:
    launcher = [str(TORCHRUN)] if TORCHRUN.exists() else [PYTHON, "-m", "torch.distributed.run"]
    return _run([*launcher, "--standalone", f"--nproc_per_node={nproc}", "train.py", *args], _env(site_dir, slow))


_FRAME = re.compile(r'File "([^"]+)", line \d+')


def assert_config_error(r: Result, facts: list, launcher: str) -> None:
    """Our one-paragraph message, once, on stderr; exit 2 (1 from torchrun); no traceback of ours; quick."""
    assert r.rc != 0, r
    assert r.elapsed < QUICK_S, r
    lines = [ln for ln in r.err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, r                          # one message, whatever the number of ranks
    for fact in facts:
        assert fact in lines[0], (fact, r)
        assert r.all.count(fact) == 1, (fact, r)       # and nowhere else (no per-rank copies)
    assert "error: " not in r.out, r
    if launcher == "python":
        assert r.rc == 2, r
        assert "Traceback" not in r.all, r
    else:
        _assert_torchrun_report(r)


def _assert_torchrun_report(r: Result) -> None:
    """torchrun's own failure report is allowed; anything more is not."""
    assert r.rc == 1, r                                # torchrun's exit code for a failed child
    assert r.all.count("Traceback (most recent call last)") <= 1, r
    ours = [f for f in _FRAME.findall(r.all) if f.endswith("train.py") or "megatron_mini" in f]
    assert not ours, r
    if "Traceback" in r.all:
        assert "ChildFailedError" in r.all, r
    codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", r.all)]
    assert 2 in codes, r                               # the first rank to fail left with our code
    assert all(c in (2, -15, -9) for c in codes), r    # the others exited 2 or were stopped by torchrun


# ------------------------------------------------------------------------------------- single process

def test_layout_needs_48_processes(small_data, tmp_path):
    r = python_train([*_model_args(small_data, tmp_path / "run"), "tp=4", "pp=12"])
    assert_config_error(r, ["48 processes", "tp=4 x pp=12 x dp=1", "this run has 1",
                            "torchrun --nproc_per_node=48 train.py tp=4 pp=12"], "python")


def test_rejected_config_leaves_run_dir_alone(small_data, tmp_path):
    run_dir = tmp_path / "run"
    r = python_train([*_model_args(small_data, run_dir), "tp=4", "pp=12"])
    assert r.rc == 2, r
    # Hydra creates the (empty) run directory itself; nothing of ours may be written into it
    assert not list(run_dir.rglob("*")), sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))


def test_missing_dataset_names_prepare_command(small_data, tmp_path):
    missing = tmp_path / "no-data-here"
    args = _model_args(small_data, tmp_path / "run") + [f"data.dir={missing}"]
    r = python_train(args)
    assert_config_error(r, [str(missing / "tokenizer.model") + ": missing;", "tools/prepare_data.py",
                            f"data.dir={missing}", "data.vocab_size=512"], "python")
    assert not missing.exists()                       # nothing was built behind the user's back


def test_fp8_rejected(small_data, tmp_path):
    r = python_train([*_model_args(small_data, tmp_path / "run"), "precision.dtype=fp8"])
    assert_config_error(r, ["precision.dtype='fp8'", "fp32, fp16 or bf16"], "python")


@pytest.mark.parametrize("override, facts", [
    ("foo=1", ["Key 'foo' not in 'TrainConfig'"]),
    ("tp=abc", ["'abc'", "could not be converted to Integer", "full_key: tp"]),
], ids=["unknown-key", "wrong-type"])
def test_hydra_rejects_at_startup(small_data, tmp_path, override, facts):
    run_dir = tmp_path / "run"
    r = python_train([*_model_args(small_data, run_dir), override])
    assert r.rc != 0, r
    assert r.elapsed < QUICK_S, r
    for fact in facts:
        assert r.err.count(fact) == 1, (fact, r)
    assert "Traceback" not in r.all, r
    assert not run_dir.exists(), r                    # it failed before the run started


# ------------------------------------------------------------------------------------------ torchrun

MULTI_RANK_CASES = [
    pytest.param(3, ["tp=2"], ["World size 3 is not divisible by tp x pp = 2 x 1 = 2", "multiple of 2 processes"],
                 id="world3-tp2"),
    pytest.param(2, ["gbs=6", "mbs=2"], ["gbs=6 is not divisible by mbs x dp = 2 x 2 = 4", "multiple of 4"],
                 id="gbs-mbs-dp"),
    pytest.param(2, ["tp=2", "model.num_heads=3", "model.hidden_size=48"],
                 ["model.num_heads=3 is not divisible by tp=2"], id="heads-tp"),
    # vocabulary 512 padded to a multiple of 5 is 515, odd
    pytest.param(2, ["tp=2", "model.vocab_pad_multiple=5"],
                 ["padded vocabulary 515", "not divisible by tp=2", "model.vocab_pad_multiple"], id="vocab-pad-tp"),
    pytest.param(2, ["tp=2", "sp=true", "model.seq_len=33"], ["model.seq_len=33 divisible by tp=2"], id="seq-sp-tp"),
    pytest.param(2, ["pp=2", "model.num_layers=7", "embedding_stage=none"],
                 ["Cannot split the model evenly over the pipeline: 7 blocks must divide over 2 virtual stages", "Block counts that would work here: 6, 8"], id="layers-pp"),
    # gbs 12 / mbs 4 = 3 microbatches, not a multiple of pp=2
    pytest.param(2, ["pp=2", "vpp=2", "gbs=12", "mbs=4"],
                 ["Interleaved 1F1B (pp=2, vpp=2)", "multiple of 2, but it is 3"], id="interleaved-microbatches"),
]


@pytest.mark.parametrize("nproc, overrides, facts", MULTI_RANK_CASES)
def test_bad_layout_under_torchrun(small_data, tmp_path, site_dir, nproc, overrides, facts):
    """Rank 0 gets a head start here (the other ranks start SLOW_START_S late), so the message is
    deterministic; the reverse order is test_message_survives_slow_rank0."""
    r = torchrun_train(nproc, [*_model_args(small_data, tmp_path / "run"), *overrides], site_dir, slow="others")
    assert_config_error(r, facts, "torchrun")


def test_bad_layout_unordered_ranks(small_data, tmp_path):
    """No start-order control: whatever rank fails first, the run ends quickly, non-zero, no traceback of ours,
    and the message is never printed more than once."""
    r = torchrun_train(3, [*_model_args(small_data, tmp_path / "run"), "tp=2"])
    assert r.elapsed < QUICK_S, r
    _assert_torchrun_report(r)
    assert r.err.count("World size 3 is not divisible") <= 1, r


def test_message_survives_slow_rank0(small_data, tmp_path, site_dir):
    r = torchrun_train(2, [*_model_args(small_data, tmp_path / "run"), "gbs=6", "mbs=2"], site_dir, slow="rank0")
    assert_config_error(r, ["gbs=6 is not divisible by mbs x dp = 2 x 2 = 4"], "torchrun")


# ---------------------------------------------------------------------------------------- a good run

def test_two_rank_run_succeeds(small_data, tmp_path):
    run_dir = tmp_path / "run"
    r = torchrun_train(2, [*_model_args(small_data, run_dir), "resume=never"])
    assert r.rc == 0, r
    assert "Traceback" not in r.all, r
    assert len(re.findall(r"^done: 2 steps", r.out, re.M)) == 1, r   # the summary comes from rank 0 only
    assert "dp=0/2" in r.out and "dp=1/2" not in r.all, r
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert "num_layers: 8" in (run_dir / ".hydra" / "config.yaml").read_text()
    assert (run_dir / "metrics.jsonl").read_text().strip(), "metrics.jsonl is empty"
    for rank in (0, 1):
        assert (run_dir / "logs" / f"rank{rank:04d}.log").is_file()
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    assert latest == "step_000002"
    assert (run_dir / "checkpoints" / latest / "meta.json").is_file()
    assert f"checkpoint: {run_dir / 'checkpoints' / latest}" in r.out, r
