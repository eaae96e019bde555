"""The command line as a user meets it: `python train.py ...` and `torchrun ... train.py ...` in subprocesses.

A bad configuration must end every rank with one clear paragraph and a non-zero exit, before any
process group exists: never a hang, never a traceback from our code. Every run has a wall-clock
limit (its whole process group is killed past it), so a hang fails the test instead of stalling it.

torchrun itself answers a failed child with its own report: a Python traceback of torchrun's frames
ending in `ChildFailedError`, the ranks' exit codes and a "Root Cause" block. That wall is torchrun's,
not ours (nothing in train.py can suppress it); what we check there is that no frame of it comes from
train.py or megatron_mini, that the first failing rank exited with our code 2 (not 1, an uncaught
exception), that our message is printed once above it, and that the Root Cause names it
(tests/commandline.py). Every other refusal of the reliability issue is in tests/test_reliability.py.

Which rank reaches the error first is a race between processes. To keep these checks deterministic,
a test hook starts some ranks late: "others" gives rank 0 a head start (the usual case), "rank0"
makes rank 0 the last to fail (test_message_survives_slow_rank0).
"""
from __future__ import annotations

import io
import os
import re
import sys

import pytest

import commandline
from commandline import (PYTHON, QUICK_S, REPO, assert_one_error, assert_torchrun_report, env, model_args, python_train,
                         torchrun_train)

SLOW_START_S = 4       # how late the slowed ranks start (a sleeper is killed by torchrun when a peer fails)


def _slow(hooks, which: str) -> dict:
    return env(hooks, HOOK_SLOW_RANKS=which, HOOK_SLOW_S=SLOW_START_S)


# ------------------------------------------------------------------------------------- single process

@pytest.mark.parametrize("missing", ["fcntl", "resource"])
def test_a_python_without_the_posix_modules_is_refused_in_one_line(missing):
    """Native Windows has neither fcntl (the run and data locks) nor resource (a CPU rank's peak memory): train.py
    there ends in one line naming where it runs, not in a traceback from wherever the package first imports one."""
    import subprocess
    r = subprocess.run([sys.executable, "-c", f"import sys; sys.modules[{missing!r}] = None; import runpy; "
                        "runpy.run_path('train.py', run_name='__main__')"], cwd=REPO, env=env(),
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout, r.stderr.splitlines()) == (1, "", [
        f"error: megatron_mini runs on Linux or macOS (on Windows: in WSL); this Python has no {missing} module "
        "(POSIX only), which it needs."]), r


def test_layout_needs_48_processes(small_data, tmp_path):
    args = [a.replace("num_layers=8", "num_layers=12") for a in model_args(small_data, tmp_path / "run")]
    r = python_train([*args, "tp=4", "pp=12"])
    assert_one_error(r, ["48 processes", "tp=4 x pp=12 x dp=1", "this run has 1",
                            "Launch it with the same arguments: torchrun --nproc_per_node=48 train.py <the same "
                            "arguments> (on several nodes, --nnodes times --nproc_per_node = 48)."], "python")


def test_rejected_config_leaves_run_dir_alone(small_data, tmp_path):
    run_dir = tmp_path / "run"
    r = python_train([*model_args(small_data, run_dir), "tp=4", "pp=12"])
    assert r.rc == 2, r
    assert not run_dir.exists()                       # refused before anything was created


def test_missing_dataset_names_prepare_command(small_data, tmp_path):
    """Refused before train.py imports torch (seconds) or creates the run directory."""
    missing = tmp_path / "no-data-here"
    args = model_args(small_data, tmp_path / "run") + [f"data.dir={missing}"]
    r = commandline.finish(commandline.start([PYTHON, "-X", "importtime", "train.py", *args], env()))
    assert_one_error(r, [f"{missing}: no such directory (a mistyped path, or data not prepared there yet); prepare "
                         f"it with: python tools/prepare_data.py", f"data.dir={missing}", "data.vocab_size=512"],
                     "python")
    assert not missing.exists()                       # nothing was built behind the user's back
    assert not re.search(r"\| +torch$", r.err, re.M), "train.py imported torch before it refused the data directory"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key", ["resume", "init_from"])
def test_a_start_path_that_is_not_there_is_refused_before_torch(key, small_data, tmp_path):
    """resume=PATH, or init_from=PATH of a new run, with no directory there: refused before train.py imports torch
    (seconds), with the line that the run's lookup gives it once torch is loaded (checkpoint.verify), naming the key
    the path was given to, and before the run directory is made."""
    missing = tmp_path / "no-checkpoint-here"
    args = model_args(small_data, tmp_path / "run") + [f"{key}={missing}"]
    r = commandline.finish(commandline.start([PYTHON, "-X", "importtime", "train.py", *args], env()))
    assert_one_error(r, [f"error: {key}={missing}: no such checkpoint directory."], "python")
    assert not re.search(r"\| +torch$", r.err, re.M), f"train.py imported torch before it refused {key}=PATH"
    assert not (tmp_path / "run").exists()


def test_start_paths_are_checked_before_torch_where_the_run_reads_them_on_one_disk(small_data, tmp_path):
    """The check before torch, on every rank, refuses a missing resume=PATH, or a missing init_from where the run
    reads it (its run directory holds no checkpoint), with the line the run gives after torch (checkpoint.find_resume,
    check_init), only where all ranks run on this node (one file system): on several nodes rank 0's answer is every
    rank's (training.prepare_run, the same line), and a node whose disk alone lacked PATH would end by itself, its peers
    waiting for it in the rendezvous. The line names the key the path was given to (resume=PATH or init_from=PATH), a
    file there too; the tools name their argument's path alone (test_export). A run directory with checkpoints resumes
    them (resume=auto) or is refused for them (resume=never): its init_from is not read, and a missing one must not
    stop a restarted job (Megatron's --pretrained-checkpoint and torchtitan's initial_load_path are read only by a run
    with no checkpoint of its own)."""
    from harness import small_config

    from megatron_mini import checkpoint, training
    from megatron_mini.checkpoint_dir import CheckpointError, check_start_dirs
    from megatron_mini.config import TrainConfig
    from megatron_mini.dataset import load_run_data
    missing, present, resumed = str(tmp_path / "missing"), str(tmp_path), tmp_path / "resumed"
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a checkpoint")
    os.makedirs(resumed / "checkpoints" / "step_000005")

    def run(run_dir=str(tmp_path / "fresh"), **keys) -> TrainConfig:
        return small_config(small_data, run_dir, **{"resume": "auto", **keys})

    def after_torch(cfg: TrainConfig) -> str:
        with pytest.raises(CheckpointError) as err:
            checkpoint.find_resume(cfg) or checkpoint.check_init(cfg, "")
        return str(err.value)

    def on_nodes(cfg: TrainConfig) -> str:
        """What rank 0 of a job on two nodes refuses for every rank (prepare_run: the others wait for its answer)."""
        run = training.prepare_run(cfg, 0, 2, datasets)
        run.lock.release()
        return run.refused
    datasets = load_run_data(run())
    refused = [(run(resume=missing), f"resume={missing}: no such checkpoint directory."),
               (run(init_from=missing), f"init_from={missing}: no such checkpoint directory."),
               (run(init_from=missing, resume="never"), f"init_from={missing}: no such checkpoint directory."),
               (run(resume=str(a_file)), f"resume={a_file}: is a file, not a checkpoint directory."),
               (run(init_from=str(a_file)), f"init_from={a_file}: is a file, not a checkpoint directory.")]
    started = [run(resume=present), run(), run(resume="never"), run(init_from=present),
               run(str(resumed), init_from=missing), run(str(resumed), init_from=missing, resume="never")]
    for world_size, here in ((1, 1), (8, 8)):
        for cfg, line in refused:
            with pytest.raises(CheckpointError) as err:
                check_start_dirs(cfg, world_size, here)
            assert str(err.value) == after_torch(cfg) == on_nodes(cfg) == line, cfg
        for cfg in started:
            check_start_dirs(cfg, world_size, here)
    for cfg, _ in refused:
        check_start_dirs(cfg, 8, 4)                   # (two nodes: left to rank 0)


@pytest.mark.parametrize("override, facts", [
    ("precision.dtype=fp8", ["Invalid value 'fp8', expected one of [fp32, fp16, bf16]"]),
    ("foo=1", ["Unknown config key foo; the keys are: model, data"]),
    ("+foo=1", ["Unknown config key foo; the keys are: model, data"]),
    ("lr=0.1", ["Unknown config key lr (did you mean optimizer.lr?)"]),
    ("+lr=0.1", ["Unknown config key lr (did you mean optimizer.lr?)"]),
    ("optimizer.lrr=0.1", ["Unknown config key optimizer.lrr (did you mean optimizer.lr?); "
                           "the keys of optimizer are: lr,"]),
    ("tp=abc", ["'abc'", "could not be converted to Integer"]),
    ("model=[1,2]", ["model=[1,2]: model is a config group, which takes one name (bloom-176b, ", ", tiny)"]),
    ("precision=1", ["precision=1: precision is a config group, which takes one name (bf16, fp16, fp32)"]),
    ("optimizer={a:1}", ["optimizer={a:1}: optimizer is a config group, which takes one name (adamw)"]),
    ("model=", ["model=: model is a config group, which takes one name (bloom-176b, "]),
    ("precision=NULL", ["precision=NULL: precision is a config group, which takes one name (bf16, fp16, fp32)"]),
    ("model=nope", ["model=nope: model has no option nope; its options are bloom-176b, gpt2-large, ",
                    ", gpt3-6.7b, tiny"]),
    ("cluster=h100-80gb", ["cluster=h100-80gb: cluster is a config group of conf/plan.yaml, not of this command "
                           "(conf/config.yaml), whose groups are data, layout, model, optimizer, precision"]),
    ("+cluster=h100-80gb", ["+cluster=h100-80gb: cluster is a config group of conf/plan.yaml, not of this command"]),
    ("cluster.gpus=8", ["cluster.gpus=8: cluster is a config group of conf/plan.yaml, not of this command"]),
    ("data.blend=[1,x]", ["data.blend mixes directories already prepared, and reads no corpus: data.source="]),
], ids=["fp8", "unknown-key", "appended-unknown-key", "leaf-key", "appended-leaf-key", "typo", "wrong-type",
        "group-list", "group-number", "group-mapping", "group-empty", "group-null", "no-such-name", "plans-group",
        "plans-group-appended", "plans-group-key", "source-beside-a-blend"])
def test_hydra_rejects_at_startup(small_data, tmp_path, override, facts):
    """Hydra's refusals come out as our one line too (its text, without its stack-trace hint); an unknown key
    names the key meant, not Hydra's advice to append it with +key=, which would be refused next."""
    run_dir = tmp_path / "run"
    r = python_train([*model_args(small_data, run_dir), override])
    assert_one_error(r, facts, "python")
    assert "HYDRA_FULL_ERROR" not in r.all and "To append" not in r.all, r
    assert not run_dir.exists(), r                    # it failed before the run started


def test_help_says_where_the_examples_and_keys_are():
    """--help (Hydra's): what the command takes and where its examples and keys are explained, its groups, the
    composed config, and that the cluster group it lists is tools/plan.py's; exit 0, nothing else said."""
    r = python_train(["--help"])
    assert r.rc == 0 and r.err == "", r
    assert r.out.startswith('train.py (megatron_mini): key=value overrides of the config below, and group=name '
                            'choices.\nIts examples: the docstring of train.py; every key: README.md, "Config keys".'
                            '\n\n== Configuration groups ==\n'), r.out
    assert "\n## Config keys\n" in (REPO / "README.md").read_text()        # (the section it names)
    assert "\nprecision: bf16, fp16, fp32\n" in r.out and "\n  hidden_size: 128\n" in r.out, r.out
    assert r.out.rstrip().endswith("The cluster group is tools/plan.py's (conf/plan.yaml), not this command's. --cfg "
                                   "job prints the\nconfig a command line composes, without running it."), r.out


def test_every_way_to_ask_hydra_for_a_sweep_is_seen():
    """Hydra's parser takes abbreviations and joined flags (--multi, -mc job) and hydra.mode=MULTIRUN asks for a sweep
    too: each ran the sweep (a second job resumed the first's checkpoint, in the one run directory both named), where
    only -m and --multirun were refused."""
    from megatron_mini.launch import HydraCommandLine

    def sweeps(*argv):
        command_line = HydraCommandLine(argv=list(argv), multirun=False)
        return command_line.sweeps(command_line.hydra_args())
    for argv in (["-m"], ["--multirun"], ["--multi", "steps=1,2"], ["-mc", "job"], ["steps=1", "-m"],
                 ["hydra.mode=MULTIRUN"], ["++hydra.mode='RunMode.MULTIRUN'"], ["+hydra.mode=2"]):
        assert sweeps(*argv), argv
    for argv in ([], ["steps=1"], ["hydra.mode=RUN"], ["-c", "job"], ["--cfg", "job", "model.name=multirun"]):
        assert not sweeps(*argv), argv
    assert HydraCommandLine(argv=["--cfg", "bad"]).hydra_args() is None        # (Hydra refuses it itself)


@pytest.mark.parametrize("argv, facts", [
    (["--multi", "optimizer.lr=1e-3,3e-3"], ["multirun (-m) is not supported: each run is a job of its own ranks"]),
    (["hydra.mode=MULTIRUN"], ["multirun (-m) is not supported"]),
    (["--resolve"], ["ValueError: The --resolve flag can only be used in conjunction with --cfg or --help"]),
    (["--cfg", "bad"], ["argument --cfg/-c: invalid choice: 'bad' (choose from 'job', 'hydra', 'all') (--hydra-help "
                        "lists the options)"]),
    (["steps=1", "--cfg", "job", "tp=2"], ["unrecognized arguments: tp=2 hydra.sweep.dir=", "steps=1: give the "
                                           "overrides together, after the flags"]),
    (["hydra.run.dir={tmp}/out"], ["hydra.run.dir=", "/out: Hydra's output directory is off for this command"]),
    (["hydra.job.chdir=true", "hydra.run.dir={tmp}/out"], ["hydra.job.chdir=true: Hydra's output directory is off",
                                                          "relative paths (data.dir, run_dir) are read from"]),
], ids=["abbreviated-multirun", "hydra-mode", "resolve-alone", "cfg-bad", "overrides-apart", "hydra-run-dir",
        "hydra-chdir"])
def test_hydra_flags_refused_in_one_line(tmp_path, argv, facts):
    """What Hydra's flags refuse is one line, exit 2, and no sweep or Hydra output directory is written: --resolve
    without --cfg was Hydra's ValueError traceback (exit 1), a usage error a line led by the whole synopsis;
    hydra.run.dir made an empty directory, the run going to run_dir, and hydra.job.chdir=true moved the process into
    it, where data.dir=data/... was not found."""
    sweep = tmp_path / "sweep"
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    r = python_train([*argv, f"hydra.sweep.dir={sweep}", f"run_dir={tmp_path / 'run'}", "steps=1"])
    assert_one_error(r, facts, "python")
    assert sorted(p.name for p in tmp_path.iterdir()) == [], r


def test_hydra_output_settings_that_keep_it_off_pass():
    """The values conf/config.yaml gives Hydra's output settings pass, whatever their spelling."""
    from megatron_mini.launch import HydraCommandLine
    for arg in ("hydra.run.dir=.", "hydra.job.chdir=False", "++hydra.output_subdir=null", "hydra/job_logging=disabled",
                "hydra.verbose=true", "hydra.job.name=x"):
        command_line = HydraCommandLine(argv=[arg])
        assert command_line.hydra_output(command_line.hydra_args()) is None, arg
    command_line = HydraCommandLine(argv=["steps=1", "hydra.output_subdir=.hydra"])
    assert command_line.hydra_output(command_line.hydra_args()) == "hydra.output_subdir=.hydra"


def test_hydras_output_is_kept_off_beside_the_overrides():
    """output_off adds the settings that keep Hydra's output off where Hydra's parser takes them: beside the
    overrides, or first where there are none (after `--info`, which takes an optional value, it read the first as
    that value: "invalid choice")."""
    from hydra._internal.utils import get_args_parser
    from megatron_mini.launch import HydraCommandLine, hydra_parser_allowed
    off = {"hydra.run.dir=.", "hydra.job.chdir=false", "hydra.output_subdir=null", "hydra/job_logging=disabled",
           "hydra/hydra_logging=disabled"}
    for argv, flag, value in ((["--info"], "info", "all"), (["-cn", "config", "--cfg", "job", "tp=2", "steps=5"], "cfg",
                              "job"), (["steps=5", "--info", "config"], "info", "config")):
        command_line = HydraCommandLine(argv=argv)
        with hydra_parser_allowed():
            args = get_args_parser().parse_args(command_line.output_off(command_line.hydra_args()))
        assert getattr(args, flag) == value and set(args.overrides) == off | {a for a in argv if "=" in a}, args


def test_hydras_parser_is_built_under_the_help_check_of_python_314(monkeypatch, tmp_path):
    """Python 3.14's argparse checks each option's help as it is added and refuses Hydra 1.3's --shell-completion
    help (an object that makes its text when shown): Hydra's parser, built by hydra_args and by the entry point
    (main() in run), raised `badly formed help string` on every command line. Within hydra_parser_allowed both take
    the command line; a help string that is badly formed is still refused, and outside it the check is as it was.
    (An older Python gets a stand-in of 3.14's check: a help that does not %-format with the parser's prog.)"""
    import argparse

    import hydra
    from hydra._internal.utils import get_args_parser
    from megatron_mini.launch import HydraCommandLine, hydra_parser_allowed
    if not hasattr(argparse.ArgumentParser, "_check_help"):
        def check_help(parser, action):
            try:
                action.help % {"prog": parser.prog}
            except (TypeError, KeyError) as e:
                raise ValueError("badly formed help string") from e
        add_argument = argparse._ActionsContainer.add_argument

        def add_checked(container, *args, **kwargs):
            action = add_argument(container, *args, **kwargs)
            if action.help is not None:
                argparse.ArgumentParser._check_help(container, action)
            return action
        monkeypatch.setattr(argparse.ArgumentParser, "_check_help", check_help, raising=False)
        monkeypatch.setattr(argparse._ActionsContainer, "add_argument", add_checked)
    if hydra.__version__.startswith("1.3."):   # (Hydra 1.4 skips the check for this help itself)
        with pytest.raises(ValueError, match="badly formed help string"):
            get_args_parser()
    assert HydraCommandLine(argv=["--multi", "steps=2"]).hydra_args().multirun
    seen = []
    main = hydra.main(version_base=None, config_path=str(tmp_path))(lambda cfg: seen.append(cfg.steps))
    monkeypatch.setattr(sys, "argv", ["train.py", "+steps=3"])
    HydraCommandLine(multirun=False).run(main)
    assert seen == [3]
    with hydra_parser_allowed(), pytest.raises(ValueError, match="badly formed help string"):
        argparse.ArgumentParser().add_argument("--x", help="%(nothing)s")
    with pytest.raises(ValueError, match="badly formed help string"):
        argparse.ArgumentParser().add_argument("--x", help=object())


def test_the_commands_a_run_prints_are_ready_for_a_shell(tmp_path):
    """The lines below the done line quote their paths for a shell: run_name='a b' printed `sample: python
    tools/generate.py runs/a b/checkpoints/...` (two arguments) and a `wandb sync` pattern that split at the space;
    a run stopped before any checkpoint printed `checkpoint: None` and `generate.py None`."""
    import shlex
    import subprocess
    from megatron_mini.logger import offline_segments
    from megatron_mini.training import closing_lines
    wandb = tmp_path / "runs" / "a b" / "wandb"
    starts = ("20261206_170732-a b-x1", "20261206_170732-a b-x1-1", "20261207_080000-a b-x1")  # (-1: the same second)
    for start in starts + ("20261207_080000-a b-x1-b1", "20261207_080000-a b-x1-b1-1"):   # (a branch: another run)
        (wandb / f"offline-run-{start}").mkdir(parents=True)
    sync = offline_segments(str(wandb), "a b-x1")
    lines = closing_lines("runs/a b/checkpoints/step_000002", "runs/a b/metrics.jsonl", str(wandb), sync)
    assert shlex.split(lines[-1].partition(":")[2]) == [
        "python", "tools/generate.py", "runs/a b/checkpoints/step_000002", "--prompt", "def main(",
        "--max-new-tokens", "200"], lines
    listed = subprocess.run(["bash", "-c", f"printf '%s\\n' {sync}"], capture_output=True, text=True).stdout
    assert sorted(listed.splitlines()) == [str(wandb / f"offline-run-{s}") for s in starts], listed
    assert f"wandb sync {sync} )" in lines[2], lines
    lines = closing_lines(None, "runs/x/metrics.jsonl", None, None)
    assert lines == ["checkpoint: none", "metrics:    runs/x/metrics.jsonl", "wandb:      disabled"], lines


def test_a_traceback_hydra_prints_becomes_its_last_line():
    """Where Hydra fails inside itself it prints a traceback of its frames (model=[1,2] gave a 2,200-character
    `error: Traceback ...` line): the command line's fault when a config group got no name of its own, else
    the exception."""
    from megatron_mini.launch import HydraCommandLine

    command_line = HydraCommandLine()
    command_line.held = io.StringIO('Traceback (most recent call last):\n  File "pathlib.py", line 1116, in mkdir\n'
                                    "    os.mkdir(self, mode)\nFileExistsError: [Errno 17] File exists: '/dev/null'\n\n"
                                    f"{HydraCommandLine.HINT}\n")
    command_line.argv = ["model=tiny", "hydra.run.dir=/dev/null"]
    assert command_line.error() == ("Hydra could not start with this command line: FileExistsError: [Errno 17] "
                                    "File exists: '/dev/null'")
    command_line.argv = ["model=tiny", "+optimizer=[a]"]
    assert command_line.error() == "+optimizer=[a]: optimizer is a config group, which takes one name (adamw)"


def test_a_group_choice_from_another_config_dir_is_not_blamed(small_data, tmp_path):
    """model=mine from --config-dir is a name, not a misuse of the group: the line names the real fault. A name
    no directory has lists the names of both; a group of the user's own is named as such; a name that a file of
    --config-dir chose is named with that file, one the command line chose is not (--config-name: its config's
    groups are not conf/config.yaml's)."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "mine.yaml").write_text(
        "name: mine\nnum_layers: 2\nhidden_size: 32\nnum_heads: 2\nseq_len: 16\nvocab_size: ${data.vocab_size}\n")
    (tmp_path / "conf" / "data").mkdir()
    (tmp_path / "conf" / "data" / "mixed.yaml").write_text("defaults:\n  - /precision: bf17\n")
    (tmp_path / "conf" / "mine.yaml").write_text("defaults:\n  - base_config\n  - model: tiny\n  - data: stdlib\n"
                                                 "  - optimizer: adamw\n  - precision: fp32\n  - _self_\n")
    (tmp_path / "conf" / "mine").mkdir()
    (tmp_path / "conf" / "mine" / "a.yaml").write_text("x: 1\n")
    conf = ["--config-dir", str(tmp_path / "conf")]
    for options, extra, facts in (
            (conf, ["model=mine", "nope=1"], ["Unknown config key nope"]),
            (conf, ["model=nope"], ["model=nope: model has no option nope; its options are bloom-176b, ",
                                    ", gpt3-6.7b, mine, tiny"]),
            (conf, ["+mine=b"], ["error: mine=b: mine has no option b; its options are a"]),
            (conf, ["data=mixed"], ["precision=bf17 (chosen in data/mixed): precision has no option bf17; its "
                                    "options are bf16, fp16, fp32"]),
            (conf + ["--config-name", "mine"], ["model=nope"], ["error: model=nope: model has no option nope"]),
            (conf + ["--config-name=mine"], ["model=gpt2-small", "nope=1"], ["Unknown config key nope"])):
        r = python_train([*options, *model_args(small_data, tmp_path / "run"), *extra])
        assert_one_error(r, facts, "python")


def test_a_sweep_that_a_config_file_asks_for_is_refused(small_data, tmp_path):
    """hydra.mode: MULTIRUN in a --config-dir config (no flag of the command line asks for it, so HydraCommandLine.run
    cannot see it) is refused as the entry point starts (composed), one line and exit 2, before any run directory
    is made: every job of the sweep would share one run_dir and process group."""
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "sweeping.yaml").write_text(f"defaults:\n  - config\n  - _self_\nhydra:\n  mode: MULTIRUN\n  sweep:\n"
                                        f"    dir: {tmp_path / 'sweep'}\n")
    r = python_train(["--config-dir", str(conf), "--config-name", "sweeping",
                      *model_args(small_data, tmp_path / "run")])
    assert_one_error(r, ["multirun (-m) is not supported"], "python")
    assert not (tmp_path / "run").exists()


def test_a_primary_config_without_the_schema_is_typed_by_it(tmp_path):
    """--config-path to a directory whose config does not start from base_config (a run's recorded .hydra/, a user's
    own) composed a plain dict: `AttributeError: 'dict' object has no attribute 'resume'`, a traceback. It is typed by
    TrainConfig as conf/config.yaml is: its values converted, its defaults filled in, a wrong one one line; Hydra's
    output stays off as conf/config.yaml has it (no outputs/<date>/<time>/ in the starting directory)."""
    from omegaconf import OmegaConf
    from megatron_mini.config import ConfigError, Schedule, TrainConfig, structured
    cfg = structured(OmegaConf.create({"steps": 5, "schedule": "gpipe", "precision": {"dtype": "bf16"}}))
    assert isinstance(cfg, TrainConfig) and cfg.steps == 5 and cfg.schedule == Schedule.gpipe, cfg
    assert cfg.precision.dtype == "bf16" and cfg.model.num_layers == 8 and cfg.run_dir == "runs/tiny-dp", cfg
    with pytest.raises(ConfigError, match=r"^steps: Value 'abc' of type 'str' could not be converted to Integer$"):
        structured(OmegaConf.create({"steps": "abc"}))
    (tmp_path / "recorded.yaml").write_text(f"tp: 4\npp: 12\nmodel:\n  num_layers: 12\nrun_dir: {tmp_path / 'run'}\n")
    hydras = set(REPO.glob("outputs/*/*"))       # (Hydra's defaults, without conf/config.yaml's: every rank wrote one)
    r = python_train(["--config-path", str(tmp_path), "--config-name", "recorded"])
    assert_one_error(r, ["The layout tp=4 x pp=12 needs at least 48 processes"], "python")
    assert set(REPO.glob("outputs/*/*")) == hydras
    r = python_train(["--config-path", str(tmp_path), "--config-name", "recorded", "steps=5"])
    assert_one_error(r, ["steps: the composed config has no such key to override (its primary config leaves it out, "
                         "or ~steps removed it): set it with +steps=VALUE"], "python")
    assert not (tmp_path / "run").exists()


def test_a_config_without_a_defaults_list_is_no_command_with_groups(tmp_path):
    """HydraCommandLine.refusal reads the defaults list of every conf/*.yaml to say whose a group is: a file with
    none (a user's notes, a plain list) or one that is no YAML chooses no group, and is no fault of the command."""
    from megatron_mini.launch import HydraCommandLine
    conf = tmp_path / "conf"
    for group in ("cluster", "model"):
        (conf / group).mkdir(parents=True)
        (conf / group / "a.yaml").write_text("x: 1\n")
    (conf / "config.yaml").write_text("defaults:\n  - model: a\n  - _self_\n")
    (conf / "plan.yaml").write_text("defaults:\n  - model: a\n  - cluster: a\n")
    (conf / "notes.yaml").write_text("steps: 5\n")
    (conf / "list.yaml").write_text("- 1\n- 2\n")
    (conf / "broken.yaml").write_text("a: [\n")
    refusal = HydraCommandLine(str(conf), argv=["model=a", "cluster=a"]).refusal()
    assert refusal == "cluster=a: cluster is a config group of conf/plan.yaml, not of this command " \
                      "(conf/config.yaml), whose groups are model"
    assert HydraCommandLine(str(conf), "plan", argv=["model=a", "cluster=a"]).refusal() is None


@pytest.mark.parametrize("override, facts", [
    ("+data.vocab=4096", ["Unknown config key data.vocab (did you mean data.vocab_size?)"]),
    ("data.num_workers=0", ["data.num_workers=0 must be >= 1"]),
    ("data.vocab_size=abc", ["'abc'", "could not be converted to Integer"]),
], ids=["appended-typo", "out-of-range", "wrong-type"])
def test_prepare_data_refuses_what_train_refuses(tmp_path, override, facts):
    """tools/prepare_data.py (make data) checks the data.* keys as train.py does: a key it would drop, or a
    value out of range, is one line and exit 2, and nothing is built."""
    from commandline import PYTHON, finish, start
    out = tmp_path / "data"
    r = finish(start([PYTHON, "tools/prepare_data.py", override, f"data.dir={out}"], env()))
    assert_one_error(r, facts, "python")
    assert not (out / "tokenizer.model").exists(), r


@pytest.mark.parametrize("where", ["afile", "afile/sub", "/dev/null"])
def test_prepare_data_refuses_a_data_dir_it_cannot_create(tmp_path, where):
    """A data.dir that is a file, or would be under one, is one line naming data.dir, exit 2 (it was
    `error: Traceback ... FileExistsError`: Hydra created data.dir as its run directory before main ran)."""
    from commandline import PYTHON, finish, start
    (tmp_path / "afile").write_text("keep me")
    data_dir = where if where.startswith("/") else str(tmp_path / where)
    blocker = where if where.startswith("/") else str(tmp_path / "afile")
    r = finish(start([PYTHON, "tools/prepare_data.py", f"data.dir={data_dir}", "data.vocab_size=300"], env()))
    assert_one_error(r, [f"data.dir={data_dir}: {blocker} is not a directory"], "python")
    assert (tmp_path / "afile").read_text() == "keep me"


def test_refused_prepare_data_leaves_no_empty_data_dir(tmp_path):
    """A refused build (here its source) removes the data.dir it created (and the parents it created), when
    nothing was written into it; a directory that was there before stays."""
    from commandline import PYTHON, finish, start
    (tmp_path / "there").mkdir()
    for data_dir in (tmp_path / "new" / "data", tmp_path / "there"):
        r = finish(start([PYTHON, "tools/prepare_data.py", f"data.source={tmp_path / 'nonexistent'}",
                          f"data.dir={data_dir}"], env()))
        assert_one_error(r, [f"data.source={tmp_path / 'nonexistent'}: not found"], "python")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["there"]


@pytest.mark.parametrize("signame, to", [("SIGTERM", "group"), ("SIGINT", "group"), ("SIGHUP", "group"),
                                         ("SIGTERM", "parent"), ("SIGKILL", "parent")])
def test_prepare_data_stopped_by_a_signal(tmp_path, small_data, signame, to):
    """A build stopped while it writes tokens.bin (a scheduler's SIGTERM to the job's processes, Ctrl-C's SIGINT or
    a closed terminal's SIGHUP to the terminal's, or a kill of the command alone): one line naming the signal, exit
    128 + its number, the partial tokens.bin removed, the tokenizer kept; the encoding processes end with it. SIGKILL
    cannot be answered, but leaves no encoding process behind either (they waited forever for the dead parent), and
    the next build removes the tokens.bin.tmp<pid> it left."""
    import json
    import os
    import signal
    import time

    from commandline import PYTHON, finish, running, start
    from corpus import write_modules
    if signame == "SIGKILL" and sys.platform != "linux":
        pytest.skip("a process dies with its parent on Linux only (PR_SET_PDEATHSIG)")
    texts = [p.read_text() for p in sorted(write_modules(tmp_path / "modules", slice(None)).iterdir())]
    with open(tmp_path / "corpus.jsonl", "w") as f:
        for _ in range(8):                                 # ~18 MB: seconds of encoding on any machine
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    out = tmp_path / "data"
    signum = getattr(signal, signame)
    with running([PYTHON, "tools/prepare_data.py", f"data.source={tmp_path / 'corpus.jsonl'}", f"data.dir={out}",
                  f"data.tokenizer={small_data.dir}/tokenizer.model", "data.vocab_size=512", "data.num_workers=2"],
                 env()) as proc:
        deadline = time.monotonic() + 60
        while not list(out.glob("tokens.bin.tmp*")):       # the encoding begins: its processes are starting
            assert proc.poll() is None and time.monotonic() < deadline, finish(proc)
            time.sleep(0.05)
        (os.killpg if to == "group" else os.kill)(proc.pid, signum)
        r = finish(proc)
        for _ in range(100):                               # (the pool's processes see their parent gone)
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"processes of the build outlived it: {r}")
    if signum == signal.SIGKILL:                           # (no cleanup: the next build's to do)
        assert r.rc == -signal.SIGKILL, r
        left = [p.name for p in out.glob("tokens.bin.tmp*")]
        assert left == [f"tokens.bin.tmp{proc.pid}"], r
        again = finish(start(proc.args, env()))
        assert again.rc == 0 and f"removed {out / left[0]} (" in again.out, again
        assert sorted(p.name for p in out.iterdir()) == [
            "meta.json", "tokenizer.json", "tokenizer.model", "tokens.bin", "tokens.idx"], again
        return
    assert_one_error(r, [f"stopped by {signame}: no half-written file is left"], "python", code=128 + signum,
                     quick=False)
    assert sorted(p.name for p in out.iterdir()) == ["tokenizer.json", "tokenizer.model"], r


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
                 ["Cannot split the model evenly over the pipeline: 7 blocks must divide over 2 virtual stages",
                  "Block counts that would work here: 6, 8"], id="layers-pp"),
    # gbs 4 / mbs 4 = 1 microbatch, fewer than pp=2
    pytest.param(2, ["pp=2", "vpp=2", "gbs=4", "mbs=4"],
                 ["Interleaved 1F1B (pp=2, vpp=2)", "at least 2 microbatches per step", "but there are 1"],
                 id="interleaved-microbatches"),
]


@pytest.mark.parametrize("nproc, overrides, facts", MULTI_RANK_CASES)
def test_bad_layout_under_torchrun(small_data, tmp_path, hooks, nproc, overrides, facts):
    """Rank 0 gets a head start here (the other ranks start SLOW_START_S late), so the message is
    deterministic; the reverse order is test_message_survives_slow_rank0."""
    r = torchrun_train(nproc, [*model_args(small_data, tmp_path / "run"), *overrides], _slow(hooks, "others"))
    assert_one_error(r, facts, "torchrun")


def test_bad_layout_unordered_ranks(small_data, tmp_path):
    """No start-order control: whatever rank fails first, the run ends quickly, non-zero, no traceback of ours,
    and the message is never printed more than once."""
    r = torchrun_train(3, [*model_args(small_data, tmp_path / "run"), "tp=2"])
    assert r.elapsed < QUICK_S, r
    assert_torchrun_report(r)
    ours = [ln for ln in r.err.splitlines() if ln.startswith("error: World size 3 is not divisible")]
    assert len(ours) <= 1, r                           # printed by one rank at most
    assert r.err.count("World size 3 is not divisible") <= len(ours) + 1, r   # + torchrun's Root Cause quote


def test_what_hydra_shows_is_shown_once_under_torchrun(tmp_path):
    """--cfg job (and --help, --info) under torchrun: rank 0 prints the config, the other ranks nothing (each rank
    printed it, interleaved); exit 0, and no run directory is made."""
    r = torchrun_train(2, ["--cfg", "job", f"run_dir={tmp_path / 'run'}"])
    assert r.rc == 0, r
    assert r.out.count("\nrun_dir: ") == 1 and f"run_dir: {tmp_path / 'run'}" in r.out, r
    assert not (tmp_path / "run").exists(), r


def test_message_survives_slow_rank0(small_data, tmp_path, hooks):
    r = torchrun_train(2, [*model_args(small_data, tmp_path / "run"), "gbs=6", "mbs=2"], _slow(hooks, "rank0"))
    assert_one_error(r, ["gbs=6 is not divisible by mbs x dp = 2 x 2 = 4"], "torchrun")


# ---------------------------------------------------------------------------------------- a good run

def test_two_rank_run_succeeds(small_data, tmp_path, hooks):
    """Two ranks on one machine whose name does not resolve (a Mac's, often): torchrun --standalone there met at
    that name and waited forever (its agent, before any rank started), unless told --local-addr=127.0.0.1, as
    make train and these tests' torchrun_argv do."""
    run_dir = tmp_path / "run"
    args = [a for a in model_args(small_data, run_dir) if a != "memory_plan=false"]   # the default, as users run
    r = torchrun_train(2, [*args, "resume=never"], env(hooks, HOOK_UNRESOLVABLE_HOST=1))
    assert r.rc == 0, r
    assert re.search(r"memory per rank, MiB \(planned \| held\):\n  rank    0 .*\n"
                     r"  rank    1 \(tp 0, dp 1, pp 0\): weights ", r.out), r
    assert "memory at the first step's peak, MiB (planned | measured)" in r.out, r
    assert "Traceback" not in r.all, r
    assert "leaked" not in r.all, r          # the exit frees what the run froze (else triton's bindings complain)
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


def test_a_rank_that_cannot_open_its_log_is_one_line(small_data, tmp_path):
    """Rank 1 cannot open logs/rank0001.log (a directory stands there): one line, printed by that rank, names it,
    and the job exits 1 (before, rank 1 printed a traceback, rank 0 waited for rank 1's message, and none came)."""
    run_dir = tmp_path / "run"
    (run_dir / "logs" / "rank0001.log").mkdir(parents=True)
    r = torchrun_train(2, model_args(small_data, run_dir))
    assert_one_error(r, [f"rank 1 could not open its log {run_dir}/logs/rank0001.log: IsADirectoryError: "
                         "[Errno 21] Is a directory"], "torchrun", code=1, quick=False)


def test_a_model_that_cannot_fit_is_one_line_before_it_is_built(small_data, tmp_path):
    """10^11 blocks: what the ranks keep for the whole run (weights, fp32 gradients, Adam) is more than the host's
    memory, which the two ranks share; both stop at once with one line (before, each built blocks until the kernel
    killed it, without a word). dp = 2 without ZeRO-1, but zero=1 would not make it fit: not offered."""
    r = torchrun_train(2, [*model_args(small_data, tmp_path / "run"), "model.num_layers=100000000000"])
    assert_one_error(r, ["rank 0 could not build its model: MemoryError: its weights, fp32 gradients and Adam state "
                         "alone need at least ", " GiB (and the 1 other rank on it at least ",
                         "GiB: use a smaller model, more tensor or pipeline parallelism"], "torchrun", code=1)
    assert "zero=1" not in r.err, r


def test_copies_that_drift_apart_stop_every_rank_before_the_save(small_data, hooks, tmp_path):
    """At tp = 2 rank 1's LayerNorm rounds otherwise than rank 0's (HOOK_DRIFT_RANK): the LayerNorm weights that
    both hold drift apart, and the check before the final save stops both ranks with one line naming them; no
    checkpoint is written (it would keep rank 0's copies, and a resume would not continue this run)."""
    run_dir = tmp_path / "run"
    r = torchrun_train(2, [*model_args(small_data, run_dir), "tp=2"], env(hooks, HOOK_DRIFT_RANK=1))
    assert_one_error(r, ["rank 0 found copies of the weights that differ between ranks: the TP group (ranks 0, 1) "
                         "holds ", " shared tensors differently: blocks.",
                         "(stopped after step 2; the last checkpoint: none)"], "torchrun", code=1, quick=False)
    assert re.search(r"blocks\.\S+ \(\d+ of 64 elements, by up to [\d.e-]+; copies held by ranks 0 \| 1\)", r.err), r
    assert not list(run_dir.glob("checkpoints/step_*"))


def test_ranks_that_resolve_the_config_differently_stop(small_data, tmp_path):
    """Hydra resolves the command line on each rank: a run_dir through ${oc.env:RANK} is runs/r0 on rank 0 and
    runs/r1 on rank 1. Every rank stops at the job's first collective with one line naming both (they trained
    into two directories, or failed at the first save)."""
    run = tmp_path / "r"
    args = [a for a in model_args(small_data, run) if not a.startswith("run_dir=")]
    r = torchrun_train(2, [*args, f"run_dir={run}" + "${oc.env:RANK}"])
    assert_one_error(r, ["rank 1 resolved the config differently from rank 0",
                         f"(run_dir: rank 0 {run}0, rank 1 {run}1)", "give the value itself"], "torchrun")
    assert not (tmp_path / "r0" / "checkpoints").exists() and not (tmp_path / "r1" / "checkpoints").exists()


def test_a_bool_key_takes_true_or_false_alone():
    """OmegaConf takes any integer as a bool (sp=2, an sp degree meant, was sp=true; compile=2 too, an
    Optional[bool]); the forms Hydra means as true or false pass: any case, quoted, null where None is allowed, an
    interpolation that leads to one of them; prefixes are read past. In a group's dict too (precision={tf32:0}
    was tf32=false), and in the composed config: an interpolation's target (sp=${vpp} was sp=true) and a YAML's own
    value (a config of the user's own composes untyped)."""
    from megatron_mini.config import ConfigError, check_booleans
    from megatron_mini.planner import PlanConfig
    for schema in (None, PlanConfig):
        check_booleans(["sp=True", "++sp=false", "~sp", "async_save='true'", "compile=null", "sp=${oc.env:X,false}",
                        "tp=2", "model=tiny", "precision={tf32:True,dtype:bf16}", "model={num_layers:2}"], schema)
        for bad, key in (("sp=2", "sp"), ("+async_save=-1", "async_save"), ("compile=2", "compile"),
                         ("precision.tf32=yes", "precision.tf32"), ("sp=", "sp"),
                         ("precision={tf32:0}", "precision.tf32"), ("+precision={dtype:bf16,tf32:yes}",
                                                                    "precision.tf32")):
            with pytest.raises(ConfigError, match=rf"^{re.escape(bad)}: {re.escape(key)} is true or false$"):
                check_booleans([bad], schema)
        for composed in ({"sp": True, "tp": 2}, {"sp": "${flag}", "flag": False}, {"sp": "${oc.env:X,false}"}):
            check_booleans([], schema, composed)
        for composed, said in (({"sp": "${tp}", "tp": 2}, "sp=${tp} is 2"), ({"sp": 2}, "sp=2"),
                               ({"precision": {"tf32": "yes"}}, "precision.tf32='yes'")):
            with pytest.raises(ConfigError, match=rf"^{re.escape(said)}: .* is true or false$"):
                check_booleans([], schema, composed)
