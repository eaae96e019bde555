"""Bad arguments to the command-line tools (tools/plot_schedule.py, export_hf.py, evaluate.py, compare_runs.py,
plan.py, generate.py, the benches' output options) give one line on stderr and a non-zero exit, no traceback;
an output file that cannot be written is refused before any work; generate.py notes a cut prompt; generate.py and
evaluate.py on the CPU reuse freed memory as train.py's ranks do."""
import argparse
import csv
import glob
import importlib
import json
import os
import re
import signal
import socket
import subprocess

import pytest
import torch

import commandline
from harness import needs_glibc_2_35, needs_triton, new_block_faults, pretend_read_only, small_config, train_on_ranks
from megatron_mini import inference, schedules

import compare_runs  # tools/, on pytest's pythonpath
import evaluate
import export_hf
import generate
import plan
import plot_schedule


@pytest.fixture(scope="module")
def tiny_checkpoint(small_data, tmp_path_factory) -> str:
    """A one-step, two-block run's checkpoint (seq_len 32)."""
    cfg = small_config(small_data, tmp_path_factory.mktemp("tiny") / "run", steps=1, gbs=2,
                       **{"model.num_layers": 2})
    return train_on_ranks(1, cfg)["checkpoint"]


def _one_error_line(capsys) -> str:
    """stderr's one error line (argparse's parser.error puts its usage lines before it)."""
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if "error: " in line]
    assert "Traceback" not in err and len(errors) == 1 and err.endswith(errors[0] + "\n"), err
    assert all(line.startswith(("usage: ", " ")) for line in err.splitlines()[:-1]), err
    return errors[0]


def _exit_code(tool, argv) -> int:
    with pytest.raises(SystemExit) as stop:
        tool.main(argv)
    return stop.value.code


@pytest.mark.parametrize("argv, fact", [
    (["--pp", "0", "-m", "4"], "--pp: must be >= 1, got 0"),
    (["--pp", "2", "--vpp", "0", "-m", "4"], "--vpp: must be >= 1, got 0"),
    (["--pp", "2", "-m", "-1"], "--microbatches/-m: must be >= 1, got -1"),
    (["--pp", "4", "--vpp", "2", "-m", "3"], "needs at least 4 microbatches per step"),
    (["--pp", "4", "-m", "3", "--compare"], "needs at least 4 microbatches per step"),  # the interleaved panel
    (["--pp", "2", "-m", "4", "-o", "s.txt"], ".png"),
])
def test_plot_schedule_bad_arguments(argv, fact, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert _exit_code(plot_schedule, argv) == 2
    err = _one_error_line(capsys)
    assert "error: " in err and fact in err, err
    assert not list(tmp_path.iterdir())


def test_plot_schedule_offers_the_schedules_kinds(monkeypatch):
    """--schedule's choices are schedules.KINDS, so a new kind can be drawn without editing the tool."""
    assert plot_schedule.KINDS is schedules.KINDS
    monkeypatch.setattr(plot_schedule, "KINDS", schedules.KINDS + ("zero_bubble",))
    assert plot_schedule.parse_args(["--pp", "2", "-m", "4", "--schedule", "zero_bubble"]).schedule == "zero_bubble"


def test_export_to_an_existing_file_is_one_line(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    out.write_text("keep me")
    assert export_hf.main([tiny_checkpoint, str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and str(out) in err and "not a directory" in err, err
    assert out.read_text() == "keep me"


def test_export_that_runs_out_of_disk_is_one_line_and_leaves_nothing(tiny_checkpoint, tmp_path):
    """The weights are the file a full disk stops: safetensors raises its own SafetensorError there, not an
    OSError, so export_hf.py ended in a traceback (and left the directories it had created). Files capped with
    RLIMIT_FSIZE, as a full disk refuses them: one line, exit 2, and no new directory."""
    import resource
    import subprocess
    import sys

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))
    out = tmp_path / "new" / "hf"
    run = subprocess.run([sys.executable, export_hf.__file__, tiny_checkpoint, str(out)], capture_output=True,
                         text=True, timeout=300, preexec_fn=cap)
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.startswith(f"error: cannot write {out}: ") and run.stderr.count("\n") == 1, run.stderr
    assert "model.safetensors" in run.stderr and "File too large" in run.stderr, run.stderr
    assert list(tmp_path.iterdir()) == []


def test_compare_runs_refuses_an_unwritable_suffix(tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s / 10}) + "\n" for s in range(5)))
    monkeypatch.chdir(tmp_path)
    assert _exit_code(compare_runs, [str(run), "-o", "c.txt"]) == 2
    err = _one_error_line(capsys)
    assert "c.txt" in err and ".png" in err and ".pdf" in err and ".svg" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]          # neither c.txt nor c.csv
    import plotting                                # .pgf: matplotlib runs a TeX system (xelatex), here none
    monkeypatch.setattr(plotting.shutil, "which", lambda name: None)
    assert _exit_code(compare_runs, [str(run), "-o", "c.pgf"]) == 2
    assert "c.pgf: matplotlib writes .pgf with xelatex (rcParams['pgf.texsystem']), which is not installed here" \
        in _one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.parametrize("argv, fact", [
    (["--labels", "a,b"], "--labels has 2 labels for 1 runs"),
    (["--smooth", "1"], "--smooth 1.0 must be in [0, 1)"),
    (["--smooth", "-0.5"], "--smooth -0.5 must be in [0, 1)"),
])
def test_compare_runs_bad_arguments(argv, fact, tmp_path, monkeypatch, capsys):
    """--labels of another count than the runs, or a smoothing outside [0, 1) (1 would hold the first value
    forever), is one line and exit 2, before any run is read or a file written."""
    run = _run_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(compare_runs, "read_run", lambda spec: pytest.fail("a run was read"))
    assert _exit_code(compare_runs, [run, "-o", "c.png", *argv]) == 2
    assert fact in _one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_plan_refuses_an_unwritable_plot_before_planning(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plan, "plan", lambda base: pytest.fail("planned before refusing --plot"))
    assert _exit_code(plan, ["--csv", "p.csv", "--plot", "p.txt"]) == 2
    err = _one_error_line(capsys)
    assert "--plot p.txt: matplotlib writes only" in err and ".png" in err, err
    assert not list(tmp_path.iterdir())                                # no p.csv either


@pytest.mark.parametrize("argv, fact", [
    (["--top", "0"], "--top: must be >= 1, got 0"),
    (["gbs=-1"], "gbs=-1 must be >= 1"),                                   # wrong for every layout: said once
    (["optimizer.min_lr=1"], "optimizer.min_lr=1.0 is above optimizer.lr"),
    (["--csv", "."], "--csv . is a directory"),
    (["model.num_heads=7"], "model.hidden_size=128 is not divisible by model.num_heads=7"),
    (["cluster.gpus=8", "cluster.gpus_per_node=2", "--layout", "tp=4"], "TP groups would span nodes"),
    (["cluster.reserve_gib=nan"], "cluster.reserve_gib=nan must be a finite number"),     # (nan < 0 is False)
    (["cluster.memory_gib=inf"], "cluster.memory_gib=inf must be a finite number"),       # (everything fit)
    (["cluster.inter_node_gbps=inf"], "cluster.inter_node_gbps=inf must be a finite number"),
])
def test_plan_bad_arguments_are_one_line_before_planning(argv, fact, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(plan, "plan", lambda base: pytest.fail("planned before refusing"))
    try:
        code = plan.main(argv)
    except SystemExit as stop:                                             # argparse's refusals
        code = stop.code
    assert code == 2
    err = _one_error_line(capsys)
    assert fact in err, err
    assert not list(tmp_path.iterdir())


def _run_dir(tmp_path) -> str:
    """A run directory compare_runs reads: five steps of metrics.jsonl."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 5.0 - s / 10}) + "\n" for s in range(5)))
    return str(run)


# Each tool that writes a file, as (module, argv writing to PATH, the option, what it must not start first).
WRITERS = {
    "compare_runs -o": (compare_runs, lambda path: ["run", "-o", path], "-o", "read_run"),
    "plot_schedule -o": (plot_schedule, lambda path: ["--pp", "2", "-m", "4", "-o", path], "-o", "plot"),
    "plan --csv": (plan, lambda path: ["--csv", path[:-len(".png")] + ".csv"], "--csv", "plan"),
    "plan --plot": (plan, lambda path: ["--plot", path], "--plot", "plan"),
}


@pytest.mark.parametrize("where, fact", [
    ("afile/x.png", "{tmp}/afile is not a directory"),              # the directory is a file
    ("afile/sub/x.png", "{tmp}/afile is not a directory"),          # one to create would be under a file
    ("ro/x.png", "the directory {tmp}/ro is not writable"),
    ("ro/sub/x.png", "the directory {tmp}/ro is not writable"),
])
@pytest.mark.parametrize("tool", WRITERS)
def test_tools_refuse_an_unwritable_output_before_any_work(tool, where, fact, tmp_path, monkeypatch, capsys):
    """compare_runs -o gave a FileNotFoundError traceback, plot_schedule -o an OSError after drawing, plan --csv
    one after the whole plan: now one line, exit 2, before anything is read, simulated or planned."""
    module, argv, option, work = WRITERS[tool]
    _run_dir(tmp_path)
    (tmp_path / "afile").write_text("keep me")
    (tmp_path / "ro").mkdir()
    pretend_read_only(monkeypatch, tmp_path / "ro")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(module, work, lambda *a: pytest.fail(f"{tool}: {work} ran before refusing {where}"))
    path = argv(where)[-1]
    assert _exit_code(module, argv(where)) == 2
    err = _one_error_line(capsys)
    assert f"{option} {path}: " + fact.format(tmp=tmp_path) in err, err
    assert (tmp_path / "afile").read_text() == "keep me" and not list((tmp_path / "ro").iterdir())


@pytest.mark.parametrize("tool", ["compare_runs -o", "plot_schedule -o"])
def test_tools_create_the_missing_directories_of_an_output(tool, tmp_path, monkeypatch):
    """One rule for every tool (plot_schedule created them, compare_runs gave a FileNotFoundError traceback and
    plan refused them; plan's case is test_planner.test_plan_command_line), and their --help says it."""
    module, argv, _, _ = WRITERS[tool]
    _run_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert module.main(argv("new/dir/x.png")) == 0
    written = sorted(p.name for p in (tmp_path / "new" / "dir").iterdir())
    assert written == (["x.csv", "x.png"] if module is compare_runs else ["x.png"]), written


@pytest.mark.parametrize("module, argv", [(compare_runs, ["run"]), (plot_schedule, ["--pp", "2", "-m", "4"]),
                                          (plan, [])])
def test_tools_help_says_missing_directories_are_created(module, argv, capsys):
    assert _exit_code(module, argv + ["--help"]) == 0
    assert "missing directories are created" in " ".join(capsys.readouterr().out.split())


class _Parsed(Exception):
    """Raised in place of a tool's parse_args: carries the parser the tool built."""


@pytest.mark.parametrize("tool", ["generate", "evaluate", "export_hf", "compare_runs", "plot_schedule", "plan",
                                  "bench_gpu", "bench_kernels", "bench_train", "sweep_attention", "baseline_gpt2",
                                  pytest.param("check_kernels", marks=needs_triton)])
def test_tools_help_gives_every_options_default(tool, monkeypatch, capsys):
    """Every tool's --help, on a CPU too (the GPU benches build their parser before they look for a GPU): an option
    that has a default (argparse's own value, not None, an empty text or a flag's) says it (plan's --top 10,
    plot_schedule's --vpp, --schedule and -o, the --dtype of generate, evaluate and export_hf, baseline_gpt2's sizes
    were silent), so the README need not repeat them: once, the parser's own value as --help prints it (a list as it
    is typed, space-separated: defaults_help.DefaultsHelp), not also by hand in its help text, where it drifts (a
    stand-in such as bench_gpu's --peak-tflops 0.0, "the table", is None, whose help says what it means)."""
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", ""))   # (check_kernels pops it)
    module = importlib.import_module(tool)      # (tools/, on pytest's pythonpath)
    assert _exit_code(module, ["--help"]) == 0
    printed = "".join(capsys.readouterr().out.split())     # (without the spaces of its wrapping: "baseline-\ncompile")

    def capture(parser, *args, **kwargs):
        raise _Parsed(parser)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Parsed) as parsed:       # (the parser the tool builds, before it parses anything)
        module.main([])
    parser = parsed.value.args[0]
    defaults = [a for a in parser._actions if a.option_strings and a.nargs != 0
                and a.default not in (None, "", argparse.SUPPRESS)]
    assert defaults
    for action in defaults:
        value = " ".join(action.default) if isinstance(action.default, list) else action.default
        shown = parser._get_formatter()._expand_help(action)    # (its help, as --help prints it)
        assert "".join(shown.split()) in printed and shown.endswith(f"(default: {value})"), (action.option_strings,
                                                                                            shown)
        said = re.findall(r"\bdefault\b(?!,)", shown)       # (not bench_gpu's row named default: "default,")
        assert len(said) == 1, (action.option_strings, shown)


@pytest.mark.parametrize("buffered", [True, False])
def test_a_tool_whose_reader_stops_early_ends_quietly(buffered, tmp_path):
    """`tools/plan.py ... | head -1`, its reader gone before the plan is printed: the lines meet a closed pipe at the
    print (PYTHONUNBUFFERED=1, or more than a buffer of output) or at the exit's flush (buffered). The tool ends as
    `yes | head` ends `yes`: status 128 + SIGPIPE, nothing on stderr (before errors.run_tool: a BrokenPipeError
    traceback and status 1; buffered, status 0 as if all was read). Its --csv and --plot files are written whole
    (before the printing; they were not written at all). Every tool's main runs through run_tool (prepare_data's
    through Hydra's command line, as train.py's)."""
    environment = commandline.env(interpreter=False)
    if buffered:
        environment.pop("PYTHONUNBUFFERED")
    csv_path, png = tmp_path / "plan.csv", tmp_path / "plan.png"
    argv = [commandline.PYTHON, "tools/plan.py", "model=gpt2-small", "gbs=8", "mbs=1", "--csv", csv_path, "--plot", png]
    with commandline.running(argv, environment) as proc:
        proc.stdout.close()                    # (before the tool has imported what it needs: seconds)
        err, rc = proc.stderr.read(), proc.wait(timeout=120)
    assert (rc, err) == (128 + signal.SIGPIPE, "")
    with open(csv_path) as f:                  # (written before the printing: whole)
        rows = list(csv.DictReader(f))
    assert len(rows) > 1 and all(None not in row.values() for row in rows) and png.read_bytes()[1:4] == b"PNG"
    for tool in glob.glob(os.path.join(commandline.REPO, "tools", "*.py")):
        with open(tool) as f:
            main = f.read().partition('if __name__ == "__main__":')[2]
        assert not main or "run_tool(main)" in main or "command_line.run(main)" in main, tool


def test_a_broken_pipe_not_of_stdout_is_raised():
    """A BrokenPipeError of another pipe (a worker's, a socket's) while stdout's reader reads on is a failure:
    errors.run_tool raises it (traceback, status 1), it does not end the tool quietly."""
    code = ("from megatron_mini.errors import run_tool\n"
            "def main():\n    raise BrokenPipeError(32, 'Broken pipe')\n"
            "run_tool(main)")
    r = commandline.finish(commandline.start([commandline.PYTHON, "-c", code], commandline.env()))
    assert r.rc == 1 and r.err.rstrip().endswith("BrokenPipeError: [Errno 32] Broken pipe"), r


def test_a_tool_whose_socket_reader_is_gone_ends_quietly():
    """stdout a socket (a socketpair's end, as a supervisor or a test harness may give) whose reader has closed it:
    the tool's print meets EPIPE as at a pipe, and it ends as at a pipe, status 128 + SIGPIPE, nothing on stderr
    (poll reports POLLHUP, not POLLERR, on such a socket: errors.run_tool read it as another pipe's, a traceback
    and status 1)."""
    code = ("from megatron_mini.errors import run_tool\n"
            "def main():\n    print('x' * 1_000_000)\n"
            "run_tool(main)")
    ours, theirs = socket.socketpair()
    ours.close()                                            # (the reader, gone before the tool writes)
    with theirs:
        r = subprocess.run([commandline.PYTHON, "-c", code], stdout=theirs, stderr=subprocess.PIPE, text=True,
                           env=commandline.env(), timeout=60)
    assert (r.returncode, r.stderr) == (128 + signal.SIGPIPE, "")


def _failing_write(errno: int, reason: str):
    def write(*args, **kwargs):
        raise OSError(errno, reason)
    return write


@pytest.mark.parametrize("tool", ["compare_runs -o", "plot_schedule -o"])
def test_a_figure_that_fails_to_save_is_one_line(tool, tmp_path, monkeypatch, capsys):
    """A write that fails after the check (a full disk, a read-only remount) is one line and exit 2, not
    savefig's OSError traceback."""
    import matplotlib.figure

    module, argv, _, _ = WRITERS[tool]
    _run_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", _failing_write(30, "Read-only file system"))
    assert _exit_code(module, argv("out/x.png")) == 2
    assert _one_error_line(capsys) == "error: cannot write out/x.png: Read-only file system"


def test_a_table_that_fails_to_write_is_one_line(tmp_path, monkeypatch, capsys):
    """compare_runs' FILE.csv and plan's --csv: a failing write is one line, exit 2."""
    _run_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(compare_runs, "save_csv", _failing_write(28, "No space left on device"))
    assert _exit_code(compare_runs, ["run", "-o", "c.png"]) == 2
    assert _one_error_line(capsys) == "error: cannot write c.csv: No space left on device"
    monkeypatch.setattr(plan, "write_csv", _failing_write(28, "No space left on device"))
    assert _exit_code(plan, ["cluster.gpus=1", "cluster.gpus_per_node=1", "--csv", "p.csv"]) == 2
    assert _one_error_line(capsys) == "error: cannot write p.csv: No space left on device"


def _write_half_then_fail(*args, **kwargs):
    """savefig / save_csv stand-in: half of a file written to the path it is given, then a full disk."""
    path = next(a for a in args if isinstance(a, str))
    with open(path, "wb") as f:
        f.write(b"half a file")
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("tool", ["compare_runs -o", "plot_schedule -o"])
def test_a_write_that_fails_leaves_the_earlier_output_whole(tool, tmp_path, monkeypatch, capsys):
    """A figure or table whose write fails half-way (a full disk, RLIMIT_FSIZE) left the half file in place of
    the earlier, whole one (savefig wrote straight into -o): now the earlier file stays as it was, and no
    temporary file is left beside it."""
    import matplotlib.figure

    module, argv, _, _ = WRITERS[tool]
    _run_dir(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert module.main(argv("out/x.png")) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    assert before["x.png"].startswith(b"\x89PNG")
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", _write_half_then_fail)
    assert _exit_code(module, argv("out/x.png")) == 2
    assert _one_error_line(capsys) == "error: cannot write out/x.png: No space left on device"
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    if module is compare_runs:
        monkeypatch.undo()
        monkeypatch.chdir(tmp_path)
        monkeypatch.setattr(compare_runs, "save_csv", lambda rows, names, path: _write_half_then_fail(path))
        assert _exit_code(module, argv("out/x.png")) == 2
        assert _one_error_line(capsys) == "error: cannot write out/x.csv: No space left on device"
        assert (tmp_path / "out" / "x.csv").read_bytes() == before["x.csv"]
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["x.csv", "x.png"]


def test_a_written_file_is_as_if_written_in_place(tmp_path, monkeypatch):
    """The temporary file a tool writes before the rename has the output's own name, so a writer that records it
    (an EPS figure's %%Title) records the output's, and a text goes through one temporary file and one rename (a
    .tmp inside a .tmp renamed twice, when bench.report.write_text handed write_output files.atomic_write)."""
    import os
    from bench import report
    monkeypatch.chdir(tmp_path)
    assert plot_schedule.main(["--pp", "2", "-m", "4", "-o", "out/s.eps"]) == 0
    assert b"%%Title: s.eps" in (tmp_path / "out" / "s.eps").read_bytes()
    assert os.listdir(tmp_path / "out") == ["s.eps"]
    renames, replace = [], os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (renames.append((os.path.basename(a), b)), replace(a, b))[1])
    report.write_text("out/doc.md", "text\n")
    assert renames == [("doc.md", "out/doc.md")] and (tmp_path / "out" / "doc.md").read_text() == "text\n"
    assert sorted(os.listdir(tmp_path / "out")) == ["doc.md", "s.eps"]


@pytest.mark.parametrize("writer", ["write_output", "atomic_write"])
def test_an_output_that_is_a_symbolic_link_stays_one(writer, tmp_path, monkeypatch):
    """A tool's output (bench.report.write_text: plotting.write_output) or a run's file (files.atomic_write) that
    is a symbolic link: the file it leads to gets the new text and the link stays a link, as a plain open() writes
    through it (the rename put a file in the link's place); no temporary file is left in either directory."""
    import os
    from bench import report

    from megatron_mini import files
    monkeypatch.chdir(tmp_path)
    os.makedirs("real")
    os.makedirs("out")
    with open("real/doc.md", "w") as f:
        f.write("old\n")
    os.symlink("../real/doc.md", "out/doc.md")
    (report.write_text if writer == "write_output" else files.atomic_write)("out/doc.md", "new\n")
    assert os.path.islink("out/doc.md") and os.readlink("out/doc.md") == "../real/doc.md"
    assert (tmp_path / "real" / "doc.md").read_text() == "new\n"
    assert os.listdir("out") == ["doc.md"] and os.listdir("real") == ["doc.md"]


def test_a_figure_written_through_a_link_takes_the_format_of_the_name_asked_for(tmp_path, monkeypatch):
    """-o sched.pdf, a link to a file whose name has no suffix (or another): the figure is a PDF, written to the
    link's target (matplotlib reads the format from the name it is given: the target's name gave it none)."""
    import os
    monkeypatch.chdir(tmp_path)
    os.symlink("store_v1", "sched.pdf")
    assert plot_schedule.main(["--pp", "2", "-m", "4", "-o", "sched.pdf"]) == 0
    assert os.path.islink("sched.pdf") and (tmp_path / "store_v1").read_bytes().startswith(b"%PDF")
    assert sorted(os.listdir(tmp_path)) == ["sched.pdf", "store_v1"]


@pytest.mark.parametrize("tool, argv, work", [
    ("bench_kernels", ["--out", "afile/out"], "run"),
    ("bench_kernels", ["--doc", "afile/b.md"], "run"),
    ("bench_gpu", ["--out", "afile"], "_init_one_rank_group"),
    ("bench_gpu", ["--doc", "afile/sub/b.md"], "_init_one_rank_group"),
    ("bench_gpu", ["--profile", "default", "--trace", "afile/t.json"], "_init_one_rank_group"),
])
def test_benches_refuse_an_unwritable_output_before_running(tool, argv, work, tmp_path, monkeypatch, capsys):
    import importlib

    module = importlib.import_module(tool)
    (tmp_path / "afile").write_text("keep me")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(module, work, lambda *a, **k: pytest.fail(f"{tool} ran before refusing {argv}"))
    assert _exit_code(module, argv) == 2
    err = _one_error_line(capsys)
    assert f"{argv[-2]} {argv[-1]}: {tmp_path}/afile is not a directory" in err, err


@pytest.mark.parametrize("tool, argv, fact, work", [
    ("bench_kernels", ["--ops", ","], "--ops names none of", "run"),       # (ran nothing, then "every path ran")
    ("bench_gpu", ["--rows", ","], "at least one of each", "_init_one_rank_group"),
    ("bench_gpu", ["--models", " "], "at least one of each", "_init_one_rank_group"),
    # (docs/benchmarks.md's older commands name a row `compile`, since renamed: the refusal names it)
    ("bench_gpu", ["--rows", "default,compile"], "unknown --rows ['compile']", "_init_one_rank_group"),
    ("bench_gpu", ["--models", "small,large"], "unknown --models ['large']", "_init_one_rank_group"),
    ("bench_gpu", ["--trace", "t.json"], "name the row to profile", "_init_one_rank_group"),   # (was ignored)
    ("bench_gpu", ["--peak-tflops", "-1"], "--peak-tflops must be a finite number > 0", "_init_one_rank_group"),
    ("bench_gpu", ["--peak-tflops", "nan"], "--peak-tflops must be a finite number > 0", "_init_one_rank_group"),
    ("bench_gpu", ["--peak-tflops", "0"], "--peak-tflops must be a finite number > 0", "_init_one_rank_group"),
])
def test_bench_arguments_that_ask_for_nothing_are_refused(tool, argv, fact, work, tmp_path, monkeypatch, capsys):
    """An option the bench would have ignored, or a list that names nothing, is one line and exit 2 before any
    work (an empty --ops printed a table of nothing; a negative or NaN peak fell back to the table silently, as 0 did:
    leave --peak-tflops out for the table's)."""
    import importlib

    module = importlib.import_module(tool)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(module, work, lambda *a, **k: pytest.fail(f"{tool} ran before refusing {argv}"))
    assert _exit_code(module, argv) == 2
    err = _one_error_line(capsys)
    assert fact in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("tool, argv, fact", [
    (generate, ["--temperature", "-1"], "--temperature must be >= 0"),
    (generate, ["--temperature", "nan"], "--temperature must be >= 0"),
    (generate, ["--temperature", "inf"], "--temperature must be finite"),
    (generate, ["--top-k", "-1"], "--top-k must be >= 0"),
    (generate, ["--top-p", "0"], "--top-p must be in (0, 1]"),
    (generate, ["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (generate, ["--top-p", "nan"], "--top-p must be in (0, 1]"),
    (generate, ["--num-samples", "0"], "--num-samples must be >= 1"),
    (generate, ["--seed", str(2 ** 64)], "--seed must be in [0, 2**64)"),            # (torch.Generator's range)
    (generate, ["--seed", "-1"], "--seed must be in [0, 2**64)"),
    (evaluate, ["--samples", "-1"], "--samples must be >= 0 (0: all)"),
    (evaluate, ["--batch", "0"], "--batch must be >= 1"),
], ids=lambda v: v.__name__ if hasattr(v, "__name__") else None)
def test_checkpoint_tools_bad_arguments_are_one_line_before_loading(tool, argv, fact, monkeypatch, capsys):
    monkeypatch.setattr(tool, "open_chosen", lambda *a, **k: pytest.fail("loaded before refusing"))
    assert _exit_code(tool, ["some/checkpoint", "--device", "cpu", *argv]) == 2
    err = _one_error_line(capsys)
    assert "error: " in err and fact in err, err


def test_evaluate_without_a_checkpoint_is_one_line(tmp_path, capsys):
    assert evaluate.main([str(tmp_path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {tmp_path} is not a checkpoint (no meta.json) nor a "
                                                 f"run directory with checkpoints"), err


def test_generate_without_new_tokens_times_nothing(tiny_checkpoint, capsys, monkeypatch):
    """--max-new-tokens 0 prints the prompt and no timing line (it printed a prefill that never ran), and
    runs no warmup."""
    calls = []
    monkeypatch.setattr(generate, "generate", lambda *a, **k: calls.append(a[2]) or inference.generate(*a, **k))
    assert generate.main([tiny_checkpoint, "--max-new-tokens", "0", "--device", "cpu", "--prompt", "def f("]) == 0
    out, err = capsys.readouterr()
    assert out == "def f(\n" and "prefill" not in err and "tokens/s" not in err, (out, err)
    assert calls == [0]                                 # the call itself, no one-token warmup


@needs_glibc_2_35
@pytest.mark.parametrize("tool, argv", [("evaluate", ["--samples", "2"]), ("generate", ["--max-new-tokens", "2"])])
def test_checkpoint_tools_reuse_the_memory_of_freed_tensors_on_the_cpu(tool, argv, tiny_checkpoint):
    """generate.py and evaluate.py set up the CPU as train.py's ranks (hardware.configure_device): after them a big
    tensor freed and allocated again costs no page faults, where without it each cost one per 4 KiB page."""
    argv = [tiny_checkpoint, "--device", "cpu", *argv]
    assert new_block_faults(f"import {tool}\nassert {tool}.main({argv!r}) == 0") < 100


def test_generate_times_prefill_and_decode_apart(tiny_checkpoint, monkeypatch):
    """The decode time starts where the prefill's ends: a clock that ticks 1 s per reading gives 1 s each
    (a decode timed from the start would read 2)."""
    ticks = iter(range(100))
    monkeypatch.setattr(inference._Clock, "_now", lambda self: float(next(ticks)))
    model = inference.load_model(inference.read_checkpoint(tiny_checkpoint))
    timing = {}
    assert len(inference.generate(model, [1, 2, 3], 4, 0.0, timing=timing)[0]) == 4
    assert timing == {"prefill_s": 1.0, "decode_s": 1.0}


def test_generate_notes_a_prompt_longer_than_the_context(tiny_checkpoint, capsys):
    ckpt = inference.read_checkpoint(tiny_checkpoint)
    tok = inference.find_tokenizer(ckpt)
    seq_len = ckpt.cfg.model.seq_len
    prompt = "def main(args):\n    return [x * 2 for x in args if x is not None]\n" * 4
    n = len(tok.encode(prompt))
    assert n > seq_len
    argv = [tiny_checkpoint, "--max-new-tokens", "2", "--temperature", "0", "--device", "cpu"]
    assert generate.main(argv + ["--prompt", prompt]) == 0
    out, err = capsys.readouterr()
    notes = [line for line in err.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1, err
    assert f"{n - seq_len} of the prompt's {n} tokens" in notes[0] and f"context is {seq_len} tokens" in notes[0]
    assert out.startswith(tok.decode(tok.encode(prompt)))                 # the whole prompt is still printed
    assert generate.main(argv + ["--prompt", "def main("]) == 0
    assert "note: " not in capsys.readouterr().err
    ids = tok.encode(prompt)
    whole = next(text for text in (tok.decode(ids[:k]) for k in range(seq_len - 8, seq_len + 8))
                 if len(tok.encode(text)) == seq_len)              # a prompt of exactly the context: nothing dropped
    assert generate.main(argv + ["--prompt", whole]) == 0
    assert "note: " not in capsys.readouterr().err


def test_a_bench_write_that_fails_mid_run_is_one_line(tmp_path, capsys, monkeypatch):
    """The benches write their tables after the rows are measured (bench_kernels after every row): a write that
    fails then (a full disk; here a file where its directory should be) is one line and exit 2, not a traceback,
    and a file that was there keeps its old content."""
    from bench import report
    blocked = tmp_path / "afile"
    blocked.write_text("x")
    with pytest.raises(SystemExit) as stop:
        report.write_doc_section(str(blocked / "doc.md"), "t", "body")
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"error: cannot write {blocked / 'doc.md'}: {blocked} is not a directory\n"
    doc = tmp_path / "doc.md"
    doc.write_text("old\n")

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(report.os, "replace", full_disk)
    with pytest.raises(SystemExit):
        report.write_text(str(doc), "new\n")
    assert doc.read_text() == "old\n" and "No space left on device" in capsys.readouterr().err


def test_tools_refuse_a_tokenizer_the_checkpoint_was_not_trained_with(tiny_checkpoint, small_data, tmp_path, capsys):
    """A tokenizer of the same size but another content (data.dir rebuilt in place after the corpus changed, or
    another run's, passed with --tokenizer) maps the model's ids to other text: generate.py printed it and
    export_hf.py shipped it as tokenizer.model. Both now refuse it in one line, by the sha256 the checkpoint
    recorded."""
    from megatron_mini.checkpoint import CheckpointError
    from megatron_mini.data import Tokenizer, read_corpus, train_tokenizer
    ckpt = inference.read_checkpoint(tiny_checkpoint)
    own = inference.find_tokenizer(ckpt)
    assert own.sha256 == ckpt.meta["data"]["tokenizer_sha256"]
    docs = list(read_corpus(small_data.source)[0])
    other = tmp_path / "rebuilt" / "tokenizer.model"
    other.parent.mkdir()
    train_tokenizer(docs[len(docs) // 2:], small_data.vocab_size, small_data.tokenizer_sample_chars,
                    small_data.tokenizer_seed, other)
    assert Tokenizer(other).vocab_size == own.vocab_size and Tokenizer(other).sha256 != own.sha256
    assert generate.main([tiny_checkpoint, "--tokenizer", str(other), "--device", "cpu", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "not the tokenizer" in err, err
    assert export_hf.main([tiny_checkpoint, str(tmp_path / "hf"), "--tokenizer", str(other)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "not the tokenizer" in err, err
    assert not (tmp_path / "hf").exists()
    assert str(inference.find_tokenizer(ckpt).path) == f"{ckpt.path}/tokenizer.model"     # (the checkpoint's copy)
    ckpt.cfg.data.dir = str(other.parent)                      # the run's data.dir, rebuilt in place, read by a
    del ckpt.meta["files"]["tokenizer.model"]                  # checkpoint older than its copy of the tokenizer
    with pytest.raises(CheckpointError, match="not the tokenizer"):
        inference.find_tokenizer(ckpt)
    assert inference.find_tokenizer(ckpt, str(own.path)).sha256 == own.sha256     # the run's own, named: taken


@pytest.mark.parametrize("doc", ["intro\n<!-- t begin -->\nold\n\nnotes by hand\n",
                                 "intro\nold\n<!-- t end -->\nnotes by hand\n",
                                 "intro\n<!-- t end -->\nold\n<!-- t begin -->\nnotes by hand\n"],
                         ids=["begin-only", "end-only", "reversed"])
def test_a_doc_section_whose_markers_are_not_a_pair_is_refused(doc, tmp_path, capsys):
    """A bench's section of a markdown file with one marker lost (a hand edit): its bounds are unknown, so the file
    is left as it is, with one line (a begin marker alone took everything after it as the section and replaced
    it, the notes by hand too)."""
    from bench import report
    path = tmp_path / "doc.md"
    path.write_text(doc)
    with pytest.raises(SystemExit) as stop:
        report.write_doc_section(str(path), "t", "new")
    assert stop.value.code == 2 and path.read_text() == doc
    assert "are not a pair in this order" in _one_error_line(capsys)
    report.write_doc_section(str(tmp_path / "fresh.md"), "t", "new")        # no markers: appended
    report.write_doc_section(str(tmp_path / "fresh.md"), "t", "newer")
    assert (tmp_path / "fresh.md").read_text() == "<!-- t begin -->\nnewer\n<!-- t end -->\n"


@pytest.mark.parametrize("edit, fact", [
    ({"model": {"num_layers": 3}}, ": tensors do not match the config's {model} (missing ['blocks.2.attn.proj.bias', "),
    ({"model": {"num_layers": 1}}, ": tensors do not match the config's {model} (missing [], unexpected "
                                   "['blocks.1.attn.proj.bias', "),
    ({"model": {"ffn_mult": 2}}, ": blocks.0.mlp.fc1.weight has shape (256, 64), the config's {model} needs (128, 64)"),
    ({"model": {"num_heads": 3}}, "/meta.json: its config's model.hidden_size=64 is not divisible by "
                                  "model.num_heads=3."),
    ({"model": {"seq_len": "32"}}, "/meta.json has no config.model.seq_len (an integer) (not a megatron_mini "
                                   "checkpoint, or a damaged one)."),
    ({"model": {"init_std": "0.02"}}, "/meta.json: its config's model.init_std='0.02' must be a number > 0."),
    ({"data": {"val_fraction": 0}}, "/meta.json: its config's data.val_fraction=0 must be in (0, 1)."),
    # (JSON's 2.0 and true, which Hydra refuses for an int: a traceback in the model, and a model of 1 head loaded)
    ({"model": {"num_layers": 2.0}}, "/meta.json has no config.model.num_layers (an integer) (not a megatron_mini "
                                     "checkpoint, or a damaged one)."),
    ({"model": {"num_heads": True}}, "/meta.json has no config.model.num_heads (an integer) (not a megatron_mini "
                                     "checkpoint, or a damaged one)."),
], ids=["more-layers", "fewer-layers", "other-mlp", "heads-3", "text-seq-len", "text-init-std", "val-fraction-0",
        "float-layers", "bool-heads"])
def test_a_checkpoints_config_that_does_not_fit_it_is_one_line(tiny_checkpoint, edit, fact, tmp_path, capsys):
    """meta.json's config, which no checksum covers, edited by hand: a model whose tensors are not the checkpoint's, or
    a value train.py refuses. generate.py, evaluate.py and export_hf.py each say so in one line naming the checkpoint
    and exit 2 (3 heads of a hidden size of 64, or a seq_len in quotes, were tracebacks in the model and were
    exported; val_fraction=0 a traceback in evaluate.py's split); the export leaves no directory."""
    import shutil
    path = tmp_path / "step_000001"
    shutil.copytree(tiny_checkpoint, path)
    meta = json.loads((path / "meta.json").read_text())
    for section, values in edit.items():
        meta["config"][section].update(values)
    (path / "meta.json").write_text(json.dumps(meta))
    for tool, args, model in ((generate, ["--device", "cpu", "--max-new-tokens", "1"], "model"),
                              (evaluate, ["--device", "cpu", "--samples", "2"], "model"),
                              (export_hf, [str(tmp_path / "hf")], "GPT-2")):
        assert tool.main([str(path), *args]) == 2, tool
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {path}{fact.format(model=model)}"), (tool, err)
    assert not (tmp_path / "hf").exists()


FC1 = "blocks.0.mlp.fc1.weight"          # [4h, h] = [256, 64]


@pytest.mark.parametrize("damage, fact", [
    (lambda saved: saved.update({"head.ln_f.b": saved.pop("head.ln_f.bias")}),
     "(model_pp00_tp00.pt holds no head.ln_f.bias)"),
    (lambda saved: saved.update({"head.ln_f.bias": torch.zeros(7)}),
     "(model_pp00_tp00.pt: head.ln_f.bias is float32 [7], not float32 [64])"),
    (lambda saved: saved.update({FC1: saved[FC1].t().contiguous()}),
     f"(model_pp00_tp00.pt: {FC1} is float32 [64, 256], not float32 [256, 64])"),
    (lambda saved: saved.update({"head.ln_f.bias": saved["head.ln_f.bias"].long()}),
     "(model_pp00_tp00.pt: head.ln_f.bias is int64 [64], not float32 [64])"),
    (lambda saved: saved.update({"head.ln_f.bias": saved["head.ln_f.bias"].to(torch.complex64)}),
     "(model_pp00_tp00.pt: head.ln_f.bias is complex64 [64], not float32 [64])"),
    (lambda saved: saved.update({"head.ln_f.bias": saved["head.ln_f.bias"].tolist()}),
     "(model_pp00_tp00.pt: head.ln_f.bias is list, not float32 [64])"),
    (lambda saved: b"not a torch file", "(model_pp00_tp00.pt: RuntimeError: "),
], ids=["renamed-tensor", "other-shape", "transposed", "int64", "complex", "list", "not-a-torch-file"])
def test_a_checkpoint_file_that_verifies_but_holds_other_tensors_is_one_line(tiny_checkpoint, damage, fact, tmp_path,
                                                                             capsys):
    """A weights file whose sha256 meta.json records, but that holds other tensors than meta.json's index lists (a
    checkpoint put together by hand, or of other code): generate.py, evaluate.py and export_hf.py each say so in one
    line naming the checkpoint and exit 2, as train.py's resume does (it was a KeyError, a RuntimeError or torch.load's
    traceback). A tensor of another dtype or shape is named with both and what the index has: int64 or complex
    values were cast into weights silently (load_model_tensors' .float()), a transposed weight (as many values) was
    read scrambled (a view)."""
    import shutil
    from megatron_mini.checkpoint import sha256_file
    path = tmp_path / "step_000001"
    shutil.copytree(tiny_checkpoint, path)
    weights = path / "model_pp00_tp00.pt"
    saved = torch.load(weights, weights_only=True)
    damaged = damage(saved)
    weights.write_bytes(damaged) if isinstance(damaged, bytes) else torch.save(saved, weights)
    meta = json.loads((path / "meta.json").read_text())
    meta["files"][weights.name] = sha256_file(str(weights))
    (path / "meta.json").write_text(json.dumps(meta))
    for tool, args in ((generate, ["--device", "cpu", "--max-new-tokens", "1"]),
                       (evaluate, ["--device", "cpu", "--samples", "2"]), (export_hf, [str(tmp_path / "hf")])):
        assert tool.main([str(path), *args]) == 2, tool
        err = capsys.readouterr().err
        said = f"error: {path}: its files do not hold the tensors its meta.json lists {fact}"
        assert err.count("\n") == 1 and err.startswith(said) and err.endswith(
            "): a damaged checkpoint, or one of other code\n"), (tool, err)
    assert not (tmp_path / "hf").exists()


def test_tools_refuse_a_missing_garbled_or_other_size_tokenizer(tiny_checkpoint, small_data, tmp_path, capsys):
    """--tokenizer naming no file, a file that is no sentencepiece model, or another run's tokenizer of another
    vocabulary size (it would map the model's ids past its end, or to other text) is one line and exit 2 from
    generate.py and export_hf.py, naming the path, before any export is written."""
    from megatron_mini.data import Tokenizer, read_corpus, train_tokenizer
    other = tmp_path / "other.model"
    docs = list(read_corpus(small_data.source)[0])[:10]
    train_tokenizer(docs, 400, 200_000, small_data.tokenizer_seed, other)
    assert Tokenizer(other).vocab_size == 400 != small_data.vocab_size
    garbled = tmp_path / "garbled.model"
    garbled.write_bytes(b"not a sentencepiece model")
    missing = tmp_path / "missing.model"
    for path, fact in ((missing, f"tokenizer not found at {missing}; pass --tokenizer PATH"),
                       (garbled, f"{garbled}: not a valid sentencepiece model"),
                       (other, f"{other}: 400 tokens, but the checkpoint's model.vocab_size is "
                               f"{small_data.vocab_size}; pass the run's tokenizer with --tokenizer PATH")):
        assert generate.main([tiny_checkpoint, "--tokenizer", str(path), "--device", "cpu",
                              "--max-new-tokens", "1"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and fact in err, (fact, err)
        assert export_hf.main([tiny_checkpoint, str(tmp_path / "hf"), "--tokenizer", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and fact in err, (fact, err)
        assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("section, value, said", [
    ("precision", "bf16", " has no config.precision.dtype (fp32, bf16 or fp16) (not a megatron_mini checkpoint, or a "
                          "damaged one)."),
    ("precision", {"dtype": "fp8"}, " has no config.precision.dtype (fp32, bf16 or fp16) (not a megatron_mini "
                                    "checkpoint, or a damaged one)."),
    ("optimizer", ["adamw"], ": unreadable (TypeError: OptimizerConfig must be a mapping, not list)"),
], ids=["precision-no-mapping", "precision-other-dtype", "optimizer-no-mapping"])
def test_tools_refuse_a_meta_json_whose_config_section_is_no_mapping(section, value, said, tiny_checkpoint, tmp_path,
                                                                     capsys):
    """A checkpoint whose meta.json holds a config section that is no mapping (precision: bf16, as the command line
    spells it, written there by hand; no checksum covers meta.json), or a precision.dtype of none of the weights'
    dtypes (that the checkpoint's files are read as: checkpoint.ShardReader): one line naming meta.json and what it
    lacks, exit 2 from generate.py, evaluate.py and export_hf.py, not a TypeError's or a KeyError's traceback."""
    import shutil
    copy = tmp_path / "step_000001"
    shutil.copytree(tiny_checkpoint, copy)
    meta = json.loads((copy / "meta.json").read_text())
    meta["config"][section] = value
    (copy / "meta.json").write_text(json.dumps(meta))
    for tool, argv in ((generate, ["--device", "cpu", "--max-new-tokens", "1"]), (evaluate, ["--device", "cpu"]),
                       (export_hf, [str(tmp_path / "hf")])):
        assert tool.main([str(copy), *argv]) == 2
        err = capsys.readouterr().err
        assert err == f"error: {copy}/meta.json{said}\n", err
    assert not (tmp_path / "hf").exists()
