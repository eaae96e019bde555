"""Reliability as operators meet it: every refusal from the command line, verified resumes, one run per run
directory, a rank that never comes (failures mid-run: tests/test_interruptions.py).

Each refusal runs `python train.py` or `torchrun ... train.py` and must end with exit code != 0, our one
line `error: ...` exactly once, no frame of our code, and under torchrun its Root Cause naming our line
(commandline.assert_one_error). Multi-rank refusals and one of each kind (hydra, a config value, the run
directory, the data, a checkpoint) run under torchrun; the other one-rank ones run plain `python train.py`,
the same code path without torchrun's 3 s of start-up. They run a few at a time. The runs that train use the test
model (8 blocks, hidden 64) for a few steps on the test data, in fp32 on CPU ranks.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from commandline import PYTHON, assert_one_error, env, finish, model_args, python_train, start, torchrun_train
from harness import HAS_TRITON, small_config, train_on_ranks
from megatron_mini.kernels import interpreter_unsupported
from megatron_mini.launch import OTHER_RANKS_WAIT_S, RunLock, free_port
from megatron_mini.model import cpu_compile_missing


# ----------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def trained(small_data, tmp_path_factory):
    """A run of the test model, 3 steps, saving every step and keeping 2: its run directory."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    cfg = small_config(small_data, run_dir, steps=3, save_interval=1, keep_checkpoints=2, gbs=4)
    train_on_ranks(1, cfg)
    return cfg


def _copy_run(cfg, dest: Path) -> Path:
    shutil.copytree(cfg.run_dir, dest)
    (dest / ".lock").unlink(missing_ok=True)
    return dest


def test_saves_keep_the_newest_checkpoints_with_checksums(trained):
    root = Path(trained.run_dir) / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000002", "step_000003"]
    meta = json.loads((root / "step_000003" / "meta.json").read_text())
    assert set(meta["files"]) == {"model_pp00_tp00.pt", "optim_pp00_tp00_dp00.pt", "tokenizer.model"}
    assert all(len(digest) == 64 for digest in meta["files"].values())
    assert meta["data"]["tokenizer_sha256"] and meta["data"]["corpus_sha256"]


# ------------------------------------------------------------------------------- refusals (torchrun)
def _corrupt(path: Path, offset: int = 2000) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


def _edit_meta(edit):
    def damage(path: Path) -> None:
        meta = json.loads((path / "meta.json").read_text())
        edit(meta)
        (path / "meta.json").write_text(json.dumps(meta))
    return damage


def _edit_file(name: str, edit):
    """A checkpoint damage that edits the objects of file `name` in place and updates its checksum in meta.json
    (so that it verifies, and fails only where it is read)."""
    def damage(path: Path) -> None:
        from megatron_mini.checkpoint import sha256_file
        f = path / name
        saved = torch.load(f, weights_only=True)
        edit(saved)
        torch.save(saved, f)
        _edit_meta(lambda meta: meta["files"].update({name: sha256_file(str(f))}))(path)
    return damage


def _refusal_cases(data, trained, tmp: Path, hooks: Path) -> list:
    """(id, nproc, extra args, facts of our line, environment) of every refusal (`hooks`: the test hooks' directory,
    commandline.SITECUSTOMIZE)."""
    ckpt = Path(trained.run_dir) / "checkpoints" / "step_000003"

    def ckpt_copy(name, damage):
        path = tmp / name
        shutil.copytree(ckpt, path)
        damage(path)
        return path

    bad_tokens, other_tokens = tmp / "bad_tokens", tmp / "other_tokens"
    for directory in (bad_tokens, other_tokens):
        shutil.copytree(data.dir, directory)
        tokens = np.memmap(directory / "tokens.bin", dtype=np.uint16, mode="r+")
        if directory == bad_tokens:
            tokens[::50] = 60000                          # ids past the 512-token vocabulary, same file size
        else:
            tokens[:] = np.roll(np.array(tokens), 1)      # another build's tokens, as many
        tokens.flush()
        del tokens
    # (a build of before meta.json recorded its tokens_fingerprint, or one damaged between the blocks that it reads:
    # its ids are checked as they are read)
    _edit_meta(lambda meta: meta.pop("tokens_fingerprint"))(bad_tokens)
    not_a_dir = tmp / "a_file"
    not_a_dir.write_text("x")
    empty = tmp / "empty"
    empty.mkdir()
    weights, optim = "model_pp00_tp00.pt", "optim_pp00_tp00_dp00.pt"        # the files of a 1-rank checkpoint
    truncated = ckpt_copy("truncated", lambda p: (p / weights).write_bytes((p / weights).read_bytes()[:999]))
    flipped = ckpt_copy("flipped", lambda p: _corrupt(p / optim))
    broken_run = tmp / "broken_run"                     # a run directory whose one checkpoint is corrupt
    ckpt_copy(Path("broken_run") / "checkpoints" / "step_000003", lambda p: _corrupt(p / optim))
    bad_meta = ckpt_copy("bad_meta", lambda p: (p / "meta.json").write_text("{not json"))
    no_optim = ckpt_copy("no_optim", lambda p: (p / optim).unlink())
    no_config = ckpt_copy("no_config", _edit_meta(lambda meta: meta.pop("config")))
    text_step = ckpt_copy("text_step", _edit_meta(lambda meta: meta.update(step="3")))
    # meta.json's values that no checksum covers, edited: init_from compared 16 < "32", a resume added 1 to "3"
    text_seq_len = ckpt_copy("text_seq_len", _edit_meta(lambda meta: meta["config"]["model"].update(seq_len="32")))
    text_step_count = ckpt_copy("text_step_count", _edit_meta(lambda meta: meta["optimizer"].update(step_count="3")))
    # a checkpoint of older code, one parameter under another name; an optimizer state that is no mapping
    renamed = ckpt_copy("renamed", _edit_file(weights,
                                              lambda t: t.update({"head.ln_f.b": t.pop("head.ln_f.bias")})))
    garbled = ckpt_copy("garbled", _edit_file(optim,
                                              lambda saved: saved.update({"head.ln_f.bias": []})))
    resume = [f"resume={ckpt}", "steps=5"]
    plain, no_interpreter = env(), env(interpreter=False)
    interpreted = env(TRITON_INTERPRET=1)   # (a GPU machine's tests run without it; the runs here are device=cpu)
    cases = [
        ("appended-key", 1, ["+foo=1"], ["Unknown config key foo"]),
        ("appended-typo", 1, ["+optimizer.lrr=1e-3"],
         ["Unknown config key optimizer.lrr (did you mean optimizer.lr?)"]),
        ("device-tpu", 1, ["device=tpu"], ["Invalid value 'tpu', expected one of [auto, cpu, cuda]"]),
        ("decay-style-typo", 1, ["optimizer.decay_style=cosin"],
         ["Invalid value 'cosin', expected one of [cosine, linear, sqrt, constant]"]),
        ("no-layers", 1, ["model.num_layers=0"], ["model.num_layers=0 must be >= 1"]),
        ("negative-lr", 1, ["optimizer.lr=-0.001"], ["optimizer.lr=-0.001 must be >= 0"]),
        ("loss-scale-inf", 1, ["precision=fp16", "precision.initial_loss_scale=inf"],
         ["precision.initial_loss_scale=inf must be a finite number in [2**-24, 2**64] (2**-24: fp16's least "
          "number; a smaller scale is 0 in fp16)"]),
        ("loss-scale-tiny", 1, ["precision=fp16", "precision.initial_loss_scale=1e-30",
                                "precision.min_loss_scale=1e-30"],
         ["precision.initial_loss_scale=1e-30 must be in [2**-24, 2**64] (2**-24: fp16's least number; a smaller "
          "scale is 0 in fp16)"]),
        ("adam-eps-inf", 1, ["optimizer.eps=inf"], ["optimizer.eps=inf must be a finite number >= 2**-126"]),
        ("adam-eps-tiny", 1, ["optimizer.eps=1e-46"],
         ["optimizer.eps=1e-46 must be >= 2**-126 (fp32's least normal number: a smaller one may be 0 to the fp32 "
          "optimizer, and 0 / 0 a NaN)"]),
        ("data-vocab-negative", 1, ["data.vocab_size=-5"], ["data.vocab_size=-5 must be >= 1"]),
        ("data-dir-empty", 1, ["data.dir="], ["data.dir is empty: give the directory of the prepared data"]),
        ("log-interval-0", 1, ["log_interval=0"], ["log_interval=0 must be >= 1"]),
        ("eval-iters-0", 1, ["eval_iters=0"], ["eval_iters=0 must be >= 1"]),
        ("heads-0", 1, ["model.num_heads=0"], ["model.num_heads=0 must be >= 1"]),
        ("seq-len-0", 1, ["model.seq_len=0"], ["model.seq_len=0 must be >= 1"]),
        ("timeout-0", 1, ["timeout_s=0"], ["timeout_s=0 must be in [1, 10**8] seconds"]),
        ("first-blocks-negative", 1, ["pipeline_first_blocks=-4"], ["pipeline_first_blocks=-4 must be >= 0"]),
        ("first-blocks-too-many", 3, ["pp=3", "pipeline_first_blocks=10"],
         ["pipeline_first_blocks=10 + pipeline_last_blocks=0 leave no blocks"]),
        ("pp3-uneven", 3, ["pp=3"],
         ["8 blocks must divide over 3 virtual stages", "pipeline_first_blocks=2 gives 2+3+3"]),
        ("triton-on-cpu", 1, ["kernels=triton"], ["set TRITON_INTERPRET=1", "or use kernels=torch"], no_interpreter),
        ("attention-head-dim", 2, ["pp=2", "kernels=attention", "model.hidden_size=272", "model.num_heads=2"],
         ["kernels=attention: the Triton attention supports head dims 1 to 128 (a model's hidden_size / num_heads), "
          "and this one is 136",
          "use kernels=torch"], interpreted),
        ("unwritable-run-dir", 1, [f"run_dir={not_a_dir}/run"], [f"run_dir={not_a_dir}/run cannot be written"]),
        ("token-ids", 1, [f"data.dir={bad_tokens}"], [f"{bad_tokens}/tokens.bin: holds token id 60000, outside the "
                                                     f"vocabulary of 512", "rebuild it with:"]),
        ("token-files", 1, [f"data.dir={other_tokens}"], [f"{other_tokens}: its tokens.bin and tokens.idx are not the "
                                                          f"files its meta.json was written for", "rebuild it with:"]),
        ("resume-empty-dir", 1, [f"resume={empty}"], [f"resume={empty} is not a checkpoint (no meta.json)"]),
        ("resume-run-dir", 1, [f"resume={broken_run}"],
         [f"resume={broken_run} has checkpoints but none is complete and intact (skipped {broken_run}/checkpoints/"
          f"step_000003: {broken_run}/checkpoints/step_000003/{optim} does not match its sha256",
          "Give another checkpoint, or run directory."]),
        ("bool-given-a-number", 1, ["sp=2"], ["sp=2: sp is true or false"]),
        ("resume-truncated", 1, [f"resume={truncated}"], [f"{truncated}/{weights} does not match its sha256"]),
        ("resume-flipped-byte", 1, [f"resume={flipped}"], [f"{flipped}/{optim} does not match its sha256"]),
        ("resume-bad-meta", 1, [f"resume={bad_meta}"], [f"{bad_meta}/meta.json is unreadable"]),
        ("resume-no-optimizer", 1, [f"resume={no_optim}"], [f"{no_optim}/{optim} is missing"]),
        ("resume-meta-no-config", 1, [f"resume={no_config}"], [f"{no_config}/meta.json has no config (not a "]),
        ("resume-meta-text-step", 1, [f"resume={text_step}"], [f"{text_step}/meta.json has no step (a count)"]),
        ("init-from-meta-text-seq-len", 1, [f"init_from={text_seq_len}", "model.seq_len=16"],
         [f"{text_seq_len}/meta.json has no config.model.seq_len (an integer) (not a megatron_mini checkpoint"]),
        ("resume-meta-text-step-count", 2, [f"resume={text_step_count}", "steps=5"],
         [f"{text_step_count}/meta.json has no optimizer.step_count (a count)"]),
        ("resume-renamed-tensor", 2, [f"resume={renamed}", "steps=5"],
         [f"{renamed} does not fit this run's model ({weights} holds no head.ln_f.bias)", "start a new run"]),
        ("resume-garbled-optimizer", 2, [f"resume={garbled}", "steps=5"],
         [f"{garbled} does not fit this run's model ({optim} holds head.ln_f.bias's optimizer state as a list, not a "
          f"mapping)"]),
        ("seed-huge", 1, ["seed=1" + "0" * 400], ["must be in [0, 2**32)"]),
        ("gbs-past-the-data", 1, ["gbs=1000000000000", "mbs=1"],
         ["gbs=1000000000000 is more samples than the training set holds (", "samples of seq_len + 1 = 33 tokens)"]),
        ("rampup-two-values", 1, ["rampup_batch_size=[8,8]"],
         ["rampup_batch_size=[8, 8] must be [start, increment, samples]"]),
        ("rampup-start-per-rank", 2, ["rampup_batch_size=[4,4,64]"],
         ["rampup_batch_size=[4, 4, 64]: its global batch of 4 is not divisible by mbs x dp = 4 x 2 = 8"]),
        ("init-from-other-model", 1, [f"init_from={ckpt}", "model.num_layers=4"],
         [f"init_from={ckpt} holds another model than this run asks for: model.num_layers: 8 -> 4"]),
        ("init-from-and-resume", 1, [f"init_from={ckpt}", f"resume={ckpt}"],
         [f"init_from={ckpt} starts a new run from a checkpoint's weights, and resume={ckpt} continues"]),
        ("resume-more-layers", 1, [*resume, "model.num_layers=4"], ["model.num_layers: 8 -> 4"]),
        ("resume-other-heads", 1, [*resume, "model.num_heads=2"], ["model.num_heads: 4 -> 2"]),
        ("resume-other-hidden", 1, [*resume, "model.hidden_size=96"], ["model.hidden_size: 64 -> 96"]),
        ("resume-other-seed", 1, [*resume, "seed=7"], ["seed: 1234 -> 7 (it draws the train/validation split)"]),
        ("never-over-checkpoints", 1, [f"run_dir={trained.run_dir}", "resume=never"],
         [f"resume=never, but {trained.run_dir} already holds checkpoints"]),
        ("resume-blank", 1, ["resume="], ["resume is empty: use resume=auto"]),
        ("run-name-parent", 1, ["run_name=../x"], ["run_name='../x' must name a directory below runs/"]),
        ("seed-negative", 1, ["seed=-1"], ["seed=-1 must be in [0, 2**32)"]),
        ("timeout-huge", 1, ["timeout_s=1000000000000000"],
         ["timeout_s=1000000000000000 must be in [1, 10**8] seconds"]),
        ("interpolation", 1, ["seed=${oc.env:MEGATRON_MINI_NO_SUCH_VARIABLE}"],
         ["Environment variable 'MEGATRON_MINI_NO_SUCH_VARIABLE' not found"]),
        ("multirun", 1, ["-m", "steps=1,2"], ["multirun (-m) is not supported"]),
        ("profile-past-steps", 1, ["steps=5", "profile.start=6"],
         ["profile.start=6 is past steps=5: no step would be traced"]),
        ("profile-rank-outside", 2, ["profile.start=1", "profile.ranks=[0,2]"],
         ["profile.ranks names rank 2, but this run's ranks are 0 to 1."]),
        ("rank-not-an-integer", 1, [], ["RANK='abc' is not an integer"], env(RANK="abc", WORLD_SIZE=2)),
        ("rank-outside-the-world", 1, [], ["RANK=5 with WORLD_SIZE=2", "a rank in [0, size)"],
         env(RANK=5, WORLD_SIZE=2)),
        ("world-of-none", 1, [], ["RANK=0 with WORLD_SIZE=0"], env(RANK=0, WORLD_SIZE=0)),
        ("compile-without-cxx", 2, ["compile=true"],
         ["compile=true on the CPU: torch.compile builds C++ there (inductor) and finds no C++ compiler "
          "(`/nonexistent/g++ --version` ($CXX) failed): install g++ (Debian/Ubuntu: apt install g++) or set CXX to "
          "one; or set compile=false."], env(CXX="/nonexistent/g++")),
    ]
    if sys.platform == "linux":     # (model.cpu_compile_missing looks for the headers on Linux only)
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        headers = [f"compile=true on the CPU: torch.compile builds C++ there (inductor) that includes Python.h, which "
                   f"is not in {hooks}: install Python's headers (Debian/Ubuntu: apt install python{version}-dev); "
                   f"or set compile=false."]
        if "no C++ compiler" in (cpu_compile_missing() or ""):   # (this machine's compiler is refused first)
            headers = ["compile=true on the CPU: torch.compile builds C++ there (inductor) and finds no C++ compiler"]
        cases.append(("compile-without-python-headers", 1, ["compile=true"], headers,
                      env(hooks, HOOK_NO_PYTHON_HEADERS=1)))
    if not HAS_TRITON:     # (macOS, Windows) the Triton kernels are refused for that first
        kernels = {i: next(a for a in args if a.startswith("kernels=")) for i, _, args, *_ in cases
                   if i in ("triton-on-cpu", "attention-head-dim")}
        cases = [(i, n, args, [f"{kernels[i]} needs the triton package (Linux with a GPU); use kernels=torch or "
                               "auto."] if i in kernels else facts, *rest) for i, n, args, facts, *rest in cases]
    elif why := interpreter_unsupported():    # (triton < 3.7 with numpy >= 2.4, as a GPU machine may have) the
        cases = [(i, n, args, [f"kernels=attention: {why}; or use kernels=torch."]   # interpreter is refused first
                  if i == "attention-head-dim" else facts, *rest) for i, n, args, facts, *rest in cases]
    if not torch.cuda.is_available():
        cases.append(("cuda-without-gpu", 1, ["device=cuda"], ["device=cuda, but torch sees no CUDA GPU"]))
    elif HAS_TRITON and sys.platform == "linux":    # (what Triton builds with on CUDA: model.triton_build_missing)
        built = "Triton builds C there (its driver's utilities and each kernel's launcher)"
        cases += [("cuda-compile-without-cc", 1, ["device=cuda", "compile=true"],
                   [f"compile=true on CUDA: {built} with $CC=/nonexistent/cc, which is not found"],
                   env(CC="/nonexistent/cc")),
                  ("cuda-kernels-without-python-headers", 1, ["device=cuda", "kernels=layer_norm"],
                   [f"kernels=layer_norm (the Triton layer_norm) on CUDA: {built} that includes Python.h, which is "
                    f"not in {hooks}"], env(hooks, HOOK_NO_PYTHON_HEADERS=1))]
    return [(i, n, args, facts, (rest[0] if rest else plain)) for i, n, args, facts, *rest in cases]


@pytest.fixture(scope="module")
def refusals(small_data, trained, tmp_path_factory, hooks):
    """Every refusal's result, run three at a time: {id: (Result, facts, launcher)}."""
    tmp = tmp_path_factory.mktemp("refusals")
    cases = _refusal_cases(small_data, trained, tmp, hooks)

    def run(case):
        name, nproc, extra, facts, environment = case
        args = [*model_args(small_data, tmp / name / "run"), *extra]
        if nproc > 1 or name in UNDER_TORCHRUN:
            return name, (torchrun_train(nproc, args, environment), facts, "torchrun")
        return name, (python_train(args, environment), facts, "python")

    with ThreadPoolExecutor(max_workers=3) as pool:
        return dict(pool.map(run, cases))


REFUSAL_IDS = ["appended-key", "appended-typo", "device-tpu", "decay-style-typo", "no-layers", "negative-lr",
               "loss-scale-inf", "loss-scale-tiny", "adam-eps-inf", "adam-eps-tiny",
               "data-vocab-negative", "data-dir-empty", "log-interval-0",
               "eval-iters-0", "heads-0", "seq-len-0", "timeout-0", "first-blocks-negative", "first-blocks-too-many",
               "pp3-uneven", "triton-on-cpu", "attention-head-dim", "unwritable-run-dir",
               "token-ids", "token-files", "resume-empty-dir", "resume-run-dir", "bool-given-a-number",
               "resume-truncated", "resume-flipped-byte", "resume-bad-meta", "resume-no-optimizer",
               "resume-meta-no-config", "resume-meta-text-step", "init-from-meta-text-seq-len",
               "resume-meta-text-step-count", "resume-renamed-tensor", "resume-garbled-optimizer",
               "seed-huge", "gbs-past-the-data", "rampup-two-values", "rampup-start-per-rank", "init-from-other-model",
               "init-from-and-resume",
               "resume-more-layers", "resume-other-heads", "resume-other-hidden", "resume-other-seed",
               "never-over-checkpoints", "resume-blank", "run-name-parent", "seed-negative", "timeout-huge",
               "interpolation", "multirun", "profile-past-steps", "profile-rank-outside",
               "rank-not-an-integer", "rank-outside-the-world", "world-of-none", "compile-without-cxx",
               "compile-without-python-headers", "cuda-without-gpu", "cuda-compile-without-cc",
               "cuda-kernels-without-python-headers"]
ON_A_GPU = {"cuda-compile-without-cc", "cuda-kernels-without-python-headers"}    # (with triton, on Linux)


# one-rank refusals that run under torchrun: one of each kind (the multi-rank ones always do)
UNDER_TORCHRUN = {"appended-key", "no-layers", "unwritable-run-dir", "token-ids", "resume-truncated"}


@pytest.mark.parametrize("case", REFUSAL_IDS)
def test_refusal(refusals, case):
    if case not in refusals:
        pytest.skip("not refused on this machine (cuda-without-gpu: it has a GPU; compile-without-python-headers: "
                    "not Linux; cuda-*: no GPU, triton or Linux)")
    result, facts, launcher = refusals[case]
    assert_one_error(result, facts, launcher)


def test_one_process_needs_no_port(small_data, tmp_path):
    """`python train.py` joins a group of one through an in-memory store: a second run beside it, or anything
    holding MASTER_PORT, is no EADDRINUSE."""
    import socket
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        r = python_train(model_args(small_data, tmp_path / "run"), env(MASTER_PORT=taken.getsockname()[1]))
    assert r.rc == 0 and "Traceback" not in r.all, r


def test_free_port_is_no_port_a_connection_holds(monkeypatch, tmp_path):
    """launch.free_port, the MASTER_PORT of the tests' and benchmarks' ranks. A port from bind(0) is an ephemeral one,
    which the kernel may give to an outgoing connection before rank 0 listens on it; then the store fails with
    EADDRINUSE (CI: 127.0.0.1:39451, while the other worker's gloo ranks connected). free_port's lie below the
    ephemeral range (read here from the kernel), and one that a connection's socket holds is passed over."""
    import socket
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_mini import launch
    try:
        with open(launch.EPHEMERAL_PORTS) as f:
            ephemeral = int(f.read().split()[0])
    except OSError:
        ephemeral = 32768
    ports = [free_port() for _ in range(20)]
    assert all(20000 <= p < ephemeral for p in ports) and len(set(ports)) > 1, (ports, ephemeral)

    with socket.socket() as server, socket.socket() as client:
        server.bind(("127.0.0.1", 0))
        server.listen()
        held = ports[0]
        client.bind(("127.0.0.1", held))      # what the kernel does for a connection given an ephemeral port
        client.connect(server.getsockname())
        with pytest.raises(RuntimeError, match="EADDRINUSE"):
            dist.TCPStore("127.0.0.1", held, 1, True, timeout=timedelta(seconds=5))
        picks = iter([held, ports[1]])
        monkeypatch.setattr(launch, "PORT_PICKS", SimpleNamespace(randrange=lambda low, high: next(picks)))
        assert free_port() == ports[1]

    monkeypatch.undo()
    monkeypatch.setattr(launch, "EPHEMERAL_PORTS", str(tmp_path / "no such file"))   # not Linux: below 32768
    assert all(20000 <= free_port() < 32768 for _ in range(20))


def test_a_rank_that_never_comes_is_one_line(small_data, tmp_path):
    """A job whose other rank never starts (a task that died before it ran) ends each rank that waited, after
    timeout_s, with one line naming the address and the ways out, not a rendezvous traceback. Rank 0 (which hosts
    the rendezvous) and rank 1 (which finds no host) run side by side, each at a port of its own, so neither meets
    the other."""
    port = free_port()
    ports = [port, next(p for p in iter(free_port, None) if p != port)]
    procs = [start([PYTHON, "train.py", *model_args(small_data, tmp_path / f"run{rank}"), "timeout_s=3"],
                   env(RANK=rank, WORLD_SIZE=2, MASTER_PORT=ports[rank])) for rank in (0, 1)]
    for rank, proc in enumerate(procs):
        address = f"127.0.0.1:{ports[rank]}"
        assert_one_error(finish(proc), [f"rank {rank}: joining the process group of 2 ranks at {address} failed",
                                        "raise timeout_s=3"], "python", code=1, quick=False)


@pytest.mark.parametrize("layout, message", [
    ({"tp": 4, "pp": 12}, "8 blocks must divide over 12 virtual stages"),
    ({"tp": 3}, "model.num_heads=4 is not divisible by tp=3"),
    ({"pp": 2, "pipeline_first_blocks": 9}, "leave no blocks for the other 1 block stages"),
    ({"pp": 4, "vpp": 2, "gbs": 8, "mbs": 4}, "needs at least 4 microbatches per step"),
], ids=["split", "heads", "first-blocks", "microbatches"])
def test_too_few_processes_is_said_once_the_advised_launch_would_pass(layout, message):
    """A layout that one process cannot run, and that would be refused anyway, says why it would be: the launch
    the process-count message advises (tp x pp processes, dp = 1) was refused for the next reason."""
    from megatron_mini.config import ConfigError, ModelConfig, TrainConfig, validate
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(TrainConfig(**layout), 1)
    if layout == {"tp": 4, "pp": 12}:                  # (a model it splits: then the process count is what is short)
        with pytest.raises(ConfigError, match="needs at least 48 processes"):
            validate(TrainConfig(tp=4, pp=12, model=ModelConfig(num_layers=12)), 1)


def test_min_lr_above_lr_is_refused():
    """A cosine "decay" from lr up to a larger min_lr would raise the learning rate over the run: refused,
    with the bound (lowering only optimizer.lr under the default min_lr is the way to reach it)."""
    from megatron_mini.config import ConfigError, TrainConfig, validate
    cfg = TrainConfig()
    cfg.optimizer.lr = 1e-4
    with pytest.raises(ConfigError, match=r"optimizer\.min_lr=0\.0003 is above optimizer\.lr=0\.0001: .*"
                                          r"set optimizer\.min_lr <= 0\.0001"):
        validate(cfg, 1)
    cfg.optimizer.min_lr = 1e-4
    assert validate(cfg, 1) == 1


def test_a_constant_schedule_takes_no_decay_setting_but_refuses_a_cooldown():
    """decay_style=constant holds lr throughout: min_lr and decay_steps do not apply (lr=1e-4 under the default
    min_lr 3e-4 was refused: "the schedule decays from lr to min_lr"), and cooldown_steps, which would decay nothing
    there, is refused with the way to warmup-stable-decay."""
    from megatron_mini.config import ConfigError, Decay, TrainConfig, validate
    from megatron_mini.optimizer import learning_rate
    cfg = TrainConfig()
    cfg.optimizer.decay_style, cfg.optimizer.lr, cfg.optimizer.decay_steps = Decay.constant, 1e-4, 1
    assert validate(cfg, 1) == 1
    assert {learning_rate(u, cfg.optimizer, cfg.steps) for u in range(19, cfg.steps)} == {1e-4}
    cfg.optimizer.cooldown_steps = 5
    with pytest.raises(ConfigError, match=r"^optimizer\.cooldown_steps=5 decays nothing under optimizer\.decay_style="
                                          r"constant \(lr throughout\): for warmup-stable-decay, .*"
                                          r"optimizer\.decay_style=sqrt"):
        validate(cfg, 1)


def test_a_decay_that_ends_within_the_warmup_is_refused():
    """optimizer.decay_steps at or before the step where the lr peaks (the warmup's last, or the first without
    one) would put min_lr at the peak: refused."""
    from megatron_mini.config import ConfigError, TrainConfig, validate
    cfg = TrainConfig()
    for warmup, peak in ((20, 20), (0, 1)):
        cfg.optimizer.warmup_steps, cfg.optimizer.decay_steps = warmup, peak
        with pytest.raises(ConfigError, match=rf"optimizer\.decay_steps={peak} ends the decay no later than the lr "
                                              rf"peaks \(step {peak}, optimizer\.warmup_steps={warmup}\): set it "
                                              rf"above {peak}, or to 0"):
            validate(cfg, 1)
        cfg.optimizer.decay_steps = peak + 1
        assert validate(cfg, 1) == 1


def test_a_cooldown_longer_than_the_decay_is_refused():
    """optimizer.cooldown_steps can be at most the steps from the lr's peak to the decay's end."""
    from megatron_mini.config import ConfigError, TrainConfig, validate
    cfg = TrainConfig(steps=100)
    cfg.optimizer.warmup_steps, cfg.optimizer.cooldown_steps = 20, 81
    with pytest.raises(ConfigError, match=r"optimizer\.cooldown_steps=81 is longer than the decay can be: from the "
                                          r"lr's peak \(step 20\) to the decay's end \(step 100, the last, steps=100\) "
                                          r"is 80 steps; lower it, or raise steps\."):
        validate(cfg, 1)
    cfg.optimizer.cooldown_steps = 80
    assert validate(cfg, 1) == 1


def test_min_loss_scale_above_the_initial_scale_is_refused():
    """A minimum above the initial scale would make the first back-off raise the scale: refused."""
    from megatron_mini.config import ConfigError, TrainConfig, validate
    cfg = TrainConfig()
    cfg.precision.dtype, cfg.precision.initial_loss_scale, cfg.precision.min_loss_scale = "fp16", 1.0, 1024.0
    with pytest.raises(ConfigError, match=r"precision\.min_loss_scale=1024 is above precision\.initial_loss_scale="
                                          r"1: .*set precision\.min_loss_scale <= 1\."):
        validate(cfg, 1)
    cfg.precision.min_loss_scale = 1.0
    assert validate(cfg, 1) == 1
    cfg.precision.min_loss_scale = 1e-30               # (fp16's least number is 2**-24: 0 in fp16)
    with pytest.raises(ConfigError, match=re.escape("precision.min_loss_scale=1e-30 must be >= 2**-24 (2**-24: "
                                                    "fp16's least number; a smaller scale is 0 in fp16)")):
        validate(cfg, 1)


def test_refusal_ids_cover_every_case(small_data, trained, tmp_path, hooks):
    assert UNDER_TORCHRUN <= set(REFUSAL_IDS)
    assert [c[0] for c in _refusal_cases(small_data, trained, tmp_path, hooks)] == \
        [i for i in REFUSAL_IDS if (i != "cuda-without-gpu" or not torch.cuda.is_available()) and
         (i != "compile-without-python-headers" or sys.platform == "linux") and
         (i not in ON_A_GPU or torch.cuda.is_available() and HAS_TRITON and sys.platform == "linux")]


def test_a_locked_run_dir_is_refused(small_data, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = RunLock(str(run_dir))                       # another run holds it: this test process
    try:
        r = torchrun_train(1, model_args(small_data, run_dir))
    finally:
        lock.release()
    assert_one_error(r, [f"{run_dir} is in use by another run", f"pid {os.getpid()}", "run_name=NAME"], "torchrun")


def test_a_locked_run_dir_is_refused_on_every_rank_without_torchrun(small_data, tmp_path):
    """Two ranks started as srun starts them (no agent to stop the others when rank 0 exits): rank 0 alone finds
    the run directory held; every rank stops with exit 2, where rank 1 waited for rank 0 in the rendezvous until
    timeout_s and then failed with a CommError. Rank 0 says why, once: rank 1 sees it end (launch.reporter_ended)
    and ends with it, silent, not OTHER_RANKS_WAIT_S later with the same line."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    port = free_port()
    lock = RunLock(str(run_dir))
    try:
        procs = [start([PYTHON, "train.py", *model_args(small_data, run_dir), "timeout_s=60"],
                       env(RANK=r, WORLD_SIZE=2, LOCAL_RANK=r, LOCAL_WORLD_SIZE=2, MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=port)) for r in range(2)]
        results = [finish(p) for p in procs]
    finally:
        lock.release()
    for r in results:
        assert r.rc == 2 and "Traceback" not in r.all, r
    lines = [ln for ln in results[0].err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and f"{run_dir} is in use by another run (host" in lines[0], results[0]
    assert "error: " not in results[1].all, results[1]
    assert results[1].elapsed < results[0].elapsed + OTHER_RANKS_WAIT_S / 3, (results[0].elapsed, results[1])


# ------------------------------------------------------------------------------------------- resuming
@pytest.mark.parametrize("ranks,corrupt", [(1, "model_pp00_tp00.pt"), (2, "optim_pp00_tp00_dp00.pt")])
def test_auto_resume_takes_the_newest_intact_checkpoint(trained, small_data, tmp_path, ranks, corrupt):
    """latest missing and the newest checkpoint corrupt: resume=auto takes the one before, says so, and sets
    the corrupt one aside; the resumed run continues exactly as the original did. On 2 ranks each hashes
    half of the files, and only rank 1 hashes the optimizer's file (the files sorted, dealt out in turn):
    every rank must still skip the checkpoint (or they would resume from different steps)."""
    run_dir = _copy_run(trained, tmp_path / "run")
    (run_dir / "checkpoints" / "latest").unlink()
    _corrupt(run_dir / "checkpoints" / "step_000003" / corrupt)
    cfg = small_config(small_data, run_dir, steps=3, gbs=4, resume="auto")
    history = train_on_ranks(ranks, cfg)
    original = json.loads((Path(trained.run_dir) / "history.json").read_text())
    if ranks == 1:
        assert history["loss"] == original["loss"][2:]                   # step 3 again, bitwise
    else:                                                                # dp=2: the same model, other rounding
        np.testing.assert_allclose(history["loss"], original["loss"][2:], rtol=1e-5)
    log = (run_dir / "logs" / "rank0000.log").read_text()
    assert "skipped" in log and f"step_000003/{corrupt} does not match its sha256" in log
    assert "checkpoints/latest is missing or unreadable; took the newest complete checkpoint" in log
    assert "step_000002" in log
    assert (run_dir / "checkpoints" / "step_000003.corrupt").is_dir()
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_000003"


def test_a_finished_run_says_so_and_leaves_its_summary(trained, small_data, tmp_path):
    run_dir = _copy_run(trained, tmp_path / "run")
    summary = (run_dir / "summary.json").read_bytes()
    r = python_train([*model_args(small_data, run_dir), "steps=3"])
    assert r.rc == 0, r
    assert f"{run_dir}/checkpoints/step_000003 is at step 3, and steps=3: nothing to train" in r.out, r
    assert (run_dir / "summary.json").read_bytes() == summary


@pytest.mark.parametrize("variables, fact", [
    (dict(MASTER_PORT="abc"), "MASTER_PORT='abc' is not a TCP port (1 to 65535)"),
    (dict(MASTER_PORT="99999"), "MASTER_PORT='99999' is not a TCP port (1 to 65535)"),
    (dict(MASTER_PORT=""), "MASTER_PORT='' is not a TCP port (1 to 65535)"),
    (dict(MASTER_ADDR=""), "MASTER_ADDR is empty"),
], ids=["port-not-a-number", "port-out-of-range", "port-empty", "address-empty"])
def test_a_rendezvous_address_that_is_none_is_one_line(small_data, tmp_path, variables, fact):
    """MASTER_PORT / MASTER_ADDR that torch's env:// rendezvous cannot use: one line naming the variable, as for
    RANK and WORLD_SIZE (it was torch's ValueError, with a traceback through train.py and megatron_mini)."""
    r = python_train(model_args(small_data, tmp_path / "run"), env(RANK=0, WORLD_SIZE=2, **variables))
    assert_one_error(r, [fact], "python")


def test_the_error_file_for_torchrun_is_whole_or_absent(tmp_path):
    """torchrun's agent reads a failed rank's error file as JSON: one cut short (the rank killed while it wrote it,
    as torchrun stops the other ranks when one fails; here a file size limit of 64 bytes) made the agent itself
    fail with a JSONDecodeError, so --max-restarts did not restart the job. Now whole or absent."""
    import subprocess
    import sys
    path = tmp_path / "error.json"
    for limit, message in ((64, "x" * 1000), (1 << 20, "a whole one")):
        code = ("import resource; from megatron_mini.launch import write_error_file; "
                f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit})); write_error_file({message!r})")
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                       env={**os.environ, "TORCHELASTIC_ERROR_FILE": str(path)})
        files = list(tmp_path.iterdir())
        if limit == 64:
            assert files == [], files                    # (no half file, no temporary left)
        else:
            assert files == [path] and json.loads(path.read_text())["message"]["message"] == message
