"""RunLogger writes metrics.jsonl and a wandb offline run; tools/compare_runs.py reads both back."""
import json
import math
import os
import re
import subprocess
import sys
import types

import pytest
import torch

from megatron_mini import logger as logger_module
from megatron_mini.config import TrainConfig, WandbConfig
from megatron_mini.logger import RunLogger, Throughput, branches, record_branch, resolve_mode, run_id, strict_json

import compare_runs                                 # tools/ (pytest's pythonpath)


def fake_training(logger: RunLogger, steps=range(1, 31), offset=0.0) -> list[dict]:
    """Log known train metrics every step and val_loss every 10 steps; return the expected rows."""
    rows = []
    for step in steps:
        train = {"loss": 5.0 / step + offset, "lr": 1e-3 * min(1, step / 10), "grad_norm": 0.5 + step / 7,
                 "tokens_per_s": 1000.0 + step, "loss_scale": 2.0 ** (32 - step // 8), "skipped_steps": step // 8}
        logger.log(step, train)
        rows.append({"step": step, **train})
        if step % 10 == 0:
            logger.log(step, {"val_loss": 6.0 / step + offset})
            rows[-1]["val_loss"] = 6.0 / step + offset
    return rows


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


def test_offline_wandb_run_reads_back_exactly(tmp_path, wandb_env):
    run_dir, cfg = str(tmp_path / "run"), WandbConfig(mode="offline", name="tiny-fp16")
    logger = RunLogger(run_dir, cfg, {"tp": 1, "lr": 1e-3}, enabled=True)
    expected = fake_training(logger, range(1, 26))
    logger.summary({"final_loss": expected[-1]["loss"]})
    logger.finish()
    first = logger.wandb_path
    assert first and os.path.basename(first).startswith("offline-run-")
    assert json.load(open(os.path.join(run_dir, "summary.json"))) == {"final_loss": expected[-1]["loss"]}
    run = compare_runs.read_run(first)
    assert (run.source, run.label, run.rows) == ("wandb", "tiny-fp16", expected)

    # a .wandb file cut short by a crash reads as a prefix of the history
    (wandb_file,) = compare_runs.wandb_files(first)
    data = open(wandb_file, "rb").read()
    (tmp_path / "torn.wandb").write_bytes(data[: len(data) // 2])
    _, rows = compare_runs.read_wandb_files([str(tmp_path / "torn.wandb")])
    assert 0 < len(rows) < len(expected) and rows == expected[: len(rows)]

    # resumed from a step-20 checkpoint: a second wandb segment with the same id replaces steps 21..25
    resumed = RunLogger(run_dir, cfg, {"tp": 1, "lr": 1e-3}, enabled=True)
    again = fake_training(resumed, range(21, 31), offset=1.0)
    resumed.finish()
    assert resumed.wandb_path != first and run_id(run_dir, "tiny-fp16") in resumed.wandb_path
    synced = subprocess.run(["bash", "-c", f"printf '%s\\n' {resumed.wandb_segments}"], capture_output=True,
                            text=True).stdout.split()       # what the done line says to sync (-1: the same second)
    assert sorted(synced) == sorted([first, resumed.wandb_path]), synced
    assert compare_runs.read_wandb_files(compare_runs.wandb_files(run_dir)) == ("tiny-fp16", expected[:20] + again)
    run = compare_runs.read_run(run_dir)  # metrics.jsonl holds the same steps: it is preferred
    assert (run.source, run.label, run.rows) == ("metrics.jsonl", "tiny-fp16", expected[:20] + again)


def test_a_branch_logs_to_a_new_wandb_run_that_its_restarts_continue(tmp_path, wandb_env, capsys):
    """wandb keeps the first value logged at a step: a branch from step 20 of a run logged to step 25 goes to a
    new wandb run (<first id>-b1), which the branch's restarts continue, and a second branch to -b2; a branch
    made while wandb was disabled counts too (-b3 after it). The branches are in branches.json, whatever the
    wandb mode; compare_runs reads the branch's history from its wandb files. A branches.json that is not a
    list of steps counts as none, with a warning."""
    run_dir = str(tmp_path / "run")

    def segment(steps, offset, branch_from=None, mode="offline"):
        if branch_from is not None:
            record_branch(run_dir, branch_from)       # (training: rank 0, before it sets checkpoints aside)
        logger = RunLogger(run_dir, WandbConfig(mode=mode, name="tiny"), {}, enabled=True)
        rows = fake_training(logger, steps, offset)
        logger.finish()
        return logger.wandb_path, rows
    first_id = run_id(run_dir, "tiny")
    paths, rows = zip(*(segment(*args) for args in ((range(1, 26), 0.0), (range(21, 28), 1.0, 20),
                                                      (range(28, 31), 1.0), (range(11, 13), 2.0, 10),
                                                      (range(5, 8), 3.0, 4, "disabled"), (range(8, 9), 3.0))))
    ids = [first_id + suffix for suffix in ("", "-b1", "-b1", "-b2", "-b3")]      # (the disabled segment: none)
    logged = [{r.run.run_id for f in compare_runs.wandb_files(path) for r in compare_runs.iter_wandb_records(f)
               if r.WhichOneof("record_type") == "run"} for path in paths if path]
    assert logged == [{i} for i in ids], logged
    assert paths[4] is None and branches(run_dir) == [20, 10, 4] and run_id(run_dir, "other").endswith("-b3")
    files = [f for path in paths[:3] for f in compare_runs.wandb_files(path)]
    assert compare_runs.read_wandb_files(files) == ("tiny", rows[0][:20] + rows[1] + rows[2])
    capsys.readouterr()
    for damaged in ("[20, 10", '"20"', "[20, 1.5]"):
        with open(os.path.join(run_dir, "branches.json"), "w") as f:
            f.write(damaged)
        assert branches(run_dir) == [] and run_id(run_dir, "tiny") == first_id
        assert "branches.json is not a list of steps" in capsys.readouterr().err


def test_branches_recorded_by_f689540_count(tmp_path, capsys):
    """f689540 kept a branch's wandb ids in wandb_ids.json (no branches.json): its run directory, resumed, logs to
    its newest branch's wandb run, and a new branch to the next id, not to an id that holds another history."""
    run_dir = str(tmp_path / "run")
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "wandb_ids.json"), "w") as f:
        json.dump({"tiny": ["tiny-x", "tiny-x-b1"]}, f)
    assert run_id(run_dir, "tiny").endswith("-b1")
    record_branch(run_dir, 5)
    assert run_id(run_dir, "tiny").endswith("-b2") and branches(run_dir) == [-1, 5]
    other = tmp_path / "other"
    other.mkdir()
    (other / "wandb_ids.json").write_text('["tiny-x"]')
    assert branches(str(other)) == [] and "wandb_ids.json is not a mapping of names to wandb ids" in \
        capsys.readouterr().err


def test_disabled_writes_metrics_jsonl_and_resume_replaces_steps(tmp_path):
    run_dir = str(tmp_path / "run")
    logger = RunLogger(run_dir, WandbConfig(mode="disabled"), {}, enabled=True)
    expected = fake_training(logger, range(1, 26))
    logger.finish()
    assert logger.wandb_path is None and not os.path.exists(os.path.join(run_dir, "wandb"))
    run = compare_runs.read_run(run_dir)
    assert (run.source, run.label, run.rows) == ("metrics.jsonl", "run", expected)

    # resumed from a step-20 checkpoint: steps 21..25 are logged again, with new values
    resumed = RunLogger(run_dir, WandbConfig(mode="disabled"), {}, enabled=True)
    again = fake_training(resumed, range(21, 31), offset=1.0)
    resumed.finish()
    assert compare_runs.read_run(run_dir).rows == expected[:20] + again


def test_values_that_are_not_finite_are_strict_json_null(tmp_path):
    """An fp16 step that overflowed logs grad_norm NaN: metrics.jsonl and summary.json write null (Python's NaN and
    Infinity are not JSON: JavaScript's parser refuses the line), compare_runs reads it back as nan, and
    history.json's lists and nested records (strict_json) hold null too."""
    run_dir = tmp_path / "run"
    logger = RunLogger(str(run_dir), WandbConfig(mode="disabled"), {}, enabled=True)
    logger.log(1, {"loss": 5.0, "grad_norm": math.nan, "loss_scale": 65536.0, "x": -math.inf})
    logger.summary({"final_loss": math.inf, "steps": 1})
    logger.finish()

    def strict(text):
        return json.loads(text, parse_constant=lambda name: pytest.fail(f"not JSON: {name}"))
    assert strict((run_dir / "metrics.jsonl").read_text()) == {"step": 1, "loss": 5.0, "grad_norm": None,
                                                               "loss_scale": 65536.0, "x": None}
    assert strict((run_dir / "summary.json").read_text()) == {"final_loss": None, "steps": 1}
    (row,) = compare_runs.read_run(str(run_dir)).rows
    assert row["loss"] == 5.0 and math.isnan(row["grad_norm"]) and math.isnan(row["x"])
    history = {"loss": [5.0, math.nan], "val_loss": [(2, math.inf)], "memory": {"peak": [1.0, {"a": math.nan}]}}
    assert strict(json.dumps(strict_json(history))) == {"loss": [5.0, None], "val_loss": [[2, None]],
                                                       "memory": {"peak": [1.0, {"a": None}]}}


def test_not_enabled_is_a_no_op(tmp_path):
    logger = RunLogger(str(tmp_path / "run"), WandbConfig(mode="offline"), {}, enabled=False)
    logger.log(1, {"loss": 1.0})
    logger.summary({"loss": 1.0})
    logger.finish()
    assert not os.path.exists(tmp_path / "run") and logger.wandb_path is None


def test_auto_mode(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert resolve_mode("auto") == "offline"
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert resolve_mode("auto") == "online"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_mode("auto") == "disabled" and resolve_mode("offline") == "offline"


def test_compare_runs_plot_and_table(tmp_path, capsys):
    specs = []
    for name, offset in (("bf16", 0.0), ("fp16", 0.25)):
        logger = RunLogger(str(tmp_path / name), WandbConfig(mode="disabled"), {}, enabled=True)
        fake_training(logger, offset=offset)
        logger.finish()
        specs.append(str(tmp_path / name))
    png = tmp_path / "out" / "compare.png"
    png.parent.mkdir()
    assert compare_runs.main(specs + ["-o", str(png), "--smooth", "0.5"]) == 0
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 20_000

    table = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    # run, source, final loss, min loss, final val_loss, gap, gap step, skipped steps, median tokens/s
    assert table["bf16"][1:] == ["metrics.jsonl", "0.1667", "0.1667", "0.2000", "+0.0000", "30", "3", "1016"]
    assert table["fp16"][1:] == ["metrics.jsonl", "0.4167", "0.4167", "0.4500", "+0.2500", "30", "3", "1016"]
    csv_rows = (tmp_path / "out" / "compare.csv").read_text().splitlines()
    assert csv_rows[0].startswith("run,source,final loss") and csv_rows[2].startswith("fp16,metrics.jsonl,0.41666")

    assert compare_runs.main([str(tmp_path / "empty"), "-o", str(png)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no such run directory" in err


def test_compare_runs_tells_runs_of_one_name_apart(tmp_path, capsys):
    """Two run directories of one name (runs/a/tiny, runs/b/tiny) are labelled by their paths as given, and one
    given twice by number: before, both rows and curves were "tiny"."""
    for parent, offset in (("a", 0.0), ("b", 0.25)):
        logger = RunLogger(str(tmp_path / parent / "tiny"), WandbConfig(mode="disabled"), {}, enabled=True)
        fake_training(logger, offset=offset)
        logger.finish()
    png = tmp_path / "compare.png"
    a, b = str(tmp_path / "a" / "tiny"), str(tmp_path / "b" / "tiny") + "/"
    assert compare_runs.main([a, b, "-o", str(png)]) == 0
    rows = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in rows if "metrics.jsonl" in line] == [a, b.rstrip("/")]
    assert compare_runs.main([a, a, "-o", str(png)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if "metrics.jsonl" in line]
    assert len(rows) == 2 and rows[0].startswith(f"{a} (1) ") and rows[1].startswith(f"{a} (2) ")
    for labels in (",", "x,x", "x, "):                  # (--labels of its own that cannot tell them apart)
        with pytest.raises(SystemExit) as caught:
            compare_runs.main([a, b, "-o", str(png), "--labels", labels])
        assert caught.value.code == 2 and "each run needs a label of its own" in capsys.readouterr().err


def _wandb_dir(i: int, length: int) -> str:
    """A run label of `length` characters, a wandb offline directory's path for the longer ones (run i's)."""
    label = f"runs/exp-{i}/" + "sweep/" * 40 + f"wandb/offline-run-20261207_10450{i}-{i}bcdef1{i}"
    return label[-length:]


@pytest.mark.parametrize("labels", [
    "bf16,fp16",
    "runs/tiny-bf16/wandb/offline-run-20261207_104500-abcdef12,runs/tiny-fp16/wandb/offline-run-20261207_104501-3456789a",
    "W" * 200,                                                                   # (the widest letters)
    ",".join(_wandb_dir(i, 120) for i in range(2)),
    ",".join("a" * 100 + x + "b" * 99 for x in "xy"),                # (they differ in the middle)
    ",".join(end + "m" * 99 + x + "m" * 99 + end for end, x in ("0x", "1y", "0y")),   # (the 1st and 3rd: only there)
    ",".join(_wandb_dir(i, length) for i, length in enumerate((1, 40, 80, 120, 160, 200))),
    ",".join(_wandb_dir(i, 200) for i in range(6))],
    ids=lambda labels: f"{labels.count(',') + 1} runs, {max(map(len, labels.split(',')))} characters")
def test_compare_runs_legends_do_not_overlap(tmp_path, monkeypatch, capsys, labels):
    """The loss panel's two legends (the runs, the line styles) share no pixel and stay inside it, whatever a label's
    length (1 to 200 characters) and however many runs: with a wandb directory's path for a label, the styles'
    legend (then upper center) covered the runs'; past ~60 characters the legend was wider than the panel (1130 px
    at 120). A long label is shortened, each unique and made of its label's own pieces, in order; the table prints
    them whole."""
    import matplotlib.legend
    import matplotlib.pyplot as plt
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)   # plot() closes its figure: keep it to measure
    labels = labels.split(",")
    specs = []
    for offset in (0.0, 0.25)[:len(labels)]:
        logger = RunLogger(str(tmp_path / str(offset)), WandbConfig(mode="disabled"), {}, enabled=True)
        fake_training(logger, offset=offset)
        logger.finish()
        specs.append(str(tmp_path / str(offset)))
    specs = (specs * len(labels))[:len(labels)]
    assert compare_runs.main(specs + ["-o", str(tmp_path / "compare.png"), "--labels", ",".join(labels)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in table if "metrics.jsonl" in line] == labels
    (fig,) = figures
    renderer = fig.canvas.get_renderer()
    losses = fig.axes[0]
    legends = losses.findobj(matplotlib.legend.Legend)
    boxes = [legend.get_window_extent(renderer) for legend in legends]
    assert len(boxes) == 2 and not boxes[0].overlaps(boxes[1])
    panel = losses.get_window_extent(renderer)
    assert all(panel.x0 <= box.x0 and box.x1 <= panel.x1 and panel.y0 <= box.y0 and box.y1 <= panel.y1
               for box in boxes), (panel, boxes)
    shown = [text.get_text() for text in legends[0].get_texts()]
    assert len(set(shown)) == len(shown) == len(labels), shown
    for label, short in zip(labels, shown):
        pieces = [piece for piece in short.split(" #")[0].split("…") if piece]
        assert pieces and re.search(".*".join(map(re.escape, pieces)), label), (short, label)


def test_wandb_failure_keeps_metrics_jsonl(tmp_path, wandb_env, monkeypatch, capsys):
    import wandb

    def broken_init(**kwargs):
        raise RuntimeError("no service")

    monkeypatch.setattr(wandb, "init", broken_init)
    logger = RunLogger(str(tmp_path / "run"), WandbConfig(mode="offline"), {}, enabled=True)
    expected = fake_training(logger, range(1, 11))
    logger.finish()
    err = capsys.readouterr().err
    assert err.count("warning: wandb init failed (RuntimeError: no service)") == 1 and logger.wandb_path is None
    assert compare_runs.read_run(str(tmp_path / "run")).rows == expected


def _log_past_a_file_size_limit(run_dir, limit):
    """In this process, files capped at `limit` bytes (RLIMIT_FSIZE, as a full disk refuses a write): a line that
    fits, then one that does not; (the errno log raised, metrics.jsonl's text). finish() raises nothing."""
    import resource
    import signal
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # a write past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    logger = RunLogger(run_dir, WandbConfig(mode="disabled"), {}, enabled=True)
    logger.log(1, {"loss": 1.0})
    with pytest.raises(OSError) as caught:
        logger.log(2, {"loss": 2.0, "note": "x" * limit})
    logger.finish()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return caught.value.errno, f.read()


def test_a_line_that_cannot_be_written_raises_in_log_and_not_again_in_finish(tmp_path):
    """A line that cannot be written (a full disk, a file size limit) raises in log(), which the training loop
    turns into every rank's stop (Trainer.write_alone); finish() then closes the file without writing it again
    (a buffered file tried the line again at close, and raised there, in the middle of stopping). The file
    holds what the disk took: the lines before, then the part of the line that fitted (a torn last line, which
    the next start moves to metrics.superseded.jsonl)."""
    import errno

    from ranks import spawn
    errno_, text = spawn(1, _log_past_a_file_size_limit, str(tmp_path / "run"), 100, init_group=False)[0]
    lines = [json.dumps({"step": 1, "loss": 1.0}) + "\n", json.dumps({"step": 2, "loss": 2.0, "note": "x" * 100})]
    assert (errno_, text) == (errno.EFBIG, "".join(lines)[:100])


def test_a_logger_dropped_without_finish_closes_its_file(tmp_path):
    """A run that ends by an exception training does not catch (a CommError, a DataError before the first step)
    never calls finish: its RunLogger, once dropped, leaves no descriptor of metrics.jsonl open (a process that
    trains again, a notebook, would pile them up)."""
    import gc

    def open_on_metrics():
        fds = [os.path.join("/proc/self/fd", fd) for fd in os.listdir("/proc/self/fd")]
        return sum(os.path.realpath(fd) == str(tmp_path / "metrics.jsonl") for fd in fds if os.path.exists(fd))
    logger = RunLogger(str(tmp_path), WandbConfig(mode="disabled"), {}, enabled=True)
    logger.log(1, {"loss": 2.0})
    assert open_on_metrics() == 1
    del logger
    gc.collect()
    assert open_on_metrics() == 0
    assert (tmp_path / "metrics.jsonl").read_text() == json.dumps({"step": 1, "loss": 2.0}) + "\n"


def test_compare_runs_prefers_metrics_jsonl_when_wandb_has_part_of_the_run(tmp_path, wandb_env):
    run_dir = str(tmp_path / "run")
    first = RunLogger(run_dir, WandbConfig(mode="disabled"), {}, enabled=True)
    expected = fake_training(first, range(1, 5), offset=-1.0)     # the lowest losses: steps 1..4
    first.finish()
    resumed = RunLogger(run_dir, WandbConfig(mode="offline", name="tiny"), {}, enabled=True)
    expected += fake_training(resumed, range(5, 9))
    resumed.finish()
    assert [row["step"] for row in compare_runs.read_wandb_files(compare_runs.wandb_files(run_dir))[1]] == [5, 6, 7, 8]
    run = compare_runs.read_run(run_dir)
    assert (run.source, run.label, run.rows) == ("metrics.jsonl", "tiny", expected)
    (row,) = compare_runs.table([run], 0.5)
    assert row["min loss"] == 5.0 / 4 - 1.0 and row["source"] == "metrics.jsonl"

    # wandb is used where it holds every step of metrics.jsonl and more
    jsonl = os.path.join(run_dir, "metrics.jsonl")
    lines = open(jsonl).readlines()
    open(jsonl, "w").writelines(line for line in lines if json.loads(line)["step"] >= 7)
    run = compare_runs.read_run(run_dir)
    assert (run.source, run.rows) == ("wandb", expected[4:])
    os.remove(jsonl)
    assert compare_runs.read_run(run_dir).source == "wandb"


def test_compare_runs_leaves_the_steps_a_resume_abandoned_in_wandb(tmp_path, wandb_env):
    """A crash after step 6 and a resume from step 3's checkpoint that first logs at step 10 (log_interval raised):
    metrics.jsonl is cut to steps 1 to 3 (cut_metrics) and continues at 10, while the wandb run (the same id: no
    branch) keeps 4 to 6, which no backward step sets apart. compare_runs reads the run's steps, metrics.jsonl's,
    not wandb's superset (it took wandb, which held every metrics.jsonl step and more)."""
    run_dir = str(tmp_path / "run")
    first = RunLogger(run_dir, WandbConfig(mode="offline", name="tiny"), {}, enabled=True)
    expected = fake_training(first, range(1, 7))[:3]
    first.finish()
    logger_module.cut_metrics(run_dir, 3)
    resumed = RunLogger(run_dir, WandbConfig(mode="offline", name="tiny"), {}, enabled=True)
    expected += fake_training(resumed, [10], offset=1.0)
    resumed.finish()
    assert [row["step"] for row in compare_runs.read_wandb_files(compare_runs.wandb_files(run_dir))[1]] == \
        [1, 2, 3, 4, 5, 6, 10]
    run = compare_runs.read_run(run_dir)
    assert (run.source, run.rows) == ("metrics.jsonl", expected)


@pytest.mark.parametrize("line, said", [('{"loss": 1.0}\n', '{"loss": 1.0}'), ("[1, 2]\n", "[1, 2]"),
                                        ('{"step": "a"}\n', '{"step": "a"}'),
                                        (b'{"step": 2, "lo\xffss": 1.0}\n', None)])
def test_compare_runs_names_a_line_of_metrics_jsonl_that_is_no_metrics_line(line, said, tmp_path):
    """A line of metrics.jsonl that is JSON but not an object with an int step is one RunError naming its file and
    line (a KeyError, TypeError or ValueError traceback before); bytes that are not UTF-8 are read as U+FFFD."""
    run_dir = tmp_path / "run"
    jsonl_run(run_dir, [(1, {"loss": 2.0})])
    with open(run_dir / "metrics.jsonl", "ab") as f:
        f.write(line if isinstance(line, bytes) else line.encode())
    if said is None:
        assert [row["step"] for row in compare_runs.read_run(str(run_dir)).rows] == [1, 2]
        return
    with pytest.raises(compare_runs.RunError) as caught:
        compare_runs.read_run(str(run_dir))
    assert str(caught.value) == (f"{run_dir / 'metrics.jsonl'}: line 2 is not a metrics line (a JSON object with an "
                                 f"int step): {said}")


def test_compare_runs_reads_metrics_jsonl_beside_a_wandb_file_torn_in_its_header(tmp_path):
    """A .wandb file shorter than its header (wandb killed before its first record) holds no records, as a torn
    tail is none: the run is read from metrics.jsonl (it was refused as not a wandb record file)."""
    run_dir = tmp_path / "run"
    expected = [{"step": 1, "loss": 2.0}]
    jsonl_run(run_dir, [(1, {"loss": 2.0})])
    (run_dir / "wandb" / "offline-run-x").mkdir(parents=True)
    (run_dir / "wandb" / "offline-run-x" / "run-x.wandb").write_bytes(b":W&B")
    run = compare_runs.read_run(str(run_dir))
    assert (run.source, run.rows) == ("metrics.jsonl", expected)
    (run_dir / "wandb" / "offline-run-x" / "run-x.wandb").write_bytes(b"not a wandb file")
    with pytest.raises(compare_runs.RunError, match="run-x.wandb: not a wandb record file"):
        compare_runs.read_run(str(run_dir))


def jsonl_run(run_dir, entries) -> str:
    """A run directory whose metrics.jsonl has the (step, metrics) `entries`, as RunLogger writes it."""
    logger = RunLogger(str(run_dir), WandbConfig(mode="disabled"), {}, enabled=True)
    for step, metrics in entries:
        logger.log(step, metrics)
    logger.finish()
    return str(run_dir)


def test_a_logged_value_weighs_as_the_steps_since_the_last_one():
    """ema with steps: a value 5 steps after the last decays the average as 5 steps of it would (a curve logged
    every 5th step is drawn as the every-step one, where the loss is flat between), to rounding; without steps,
    as one step; a value that is not finite is skipped (its step too)."""
    s, a, b = 0.9, 3.0, 1.0
    assert compare_runs.ema([a, b], s, [0, 5])[-1] == pytest.approx(compare_runs.ema([a] + [b] * 5, s)[-1], rel=1e-12)
    assert compare_runs.ema([a, b], s)[-1] == pytest.approx((s * (1 - s) * a + (1 - s) * b) / (1 - s * s), rel=1e-12)
    assert compare_runs.ema([a, math.nan, b], s, [0, 1, 5]) == [a, a, compare_runs.ema([a, b], s, [0, 5])[-1]]


def test_compare_runs_gap_at_last_common_step(tmp_path, capsys):
    died = jsonl_run(tmp_path / "died", [(0, {"val_loss": 9.0})])     # died after the step-0 eval
    short = jsonl_run(tmp_path / "short", [(1, {"loss": 9.0}), (2, {"loss": 8.0})])
    long = jsonl_run(tmp_path / "long", [(1, {"loss": 9.5}), (2, {"loss": 8.5}), (3, {"loss": 2.0})])
    late = jsonl_run(tmp_path / "late", [(3, {"loss": 7.0}), (4, {"loss": 6.0})])
    png = str(tmp_path / "compare.png")

    def table(*specs):
        assert compare_runs.main([*specs, "-o", png, "--smooth", "0"]) == 0
        out = capsys.readouterr().out
        assert "nan" not in out
        return {line.split()[0]: line.split() for line in out.splitlines()}, out

    # gap vs ref, gap step: at the last step both logged, not at each run's own last step
    rows, _ = table(short, long, late)
    assert rows["short"][5:7] == ["+0.0000", "2"]
    assert rows["long"][5:7] == ["+0.5000", "2"]
    assert rows["late"][5:7] == ["-", "-"]
    assert rows["late:"] == ("late: no gap vs ref: no step where both it and the reference short "
                             "logged a train loss").split()
    rows, _ = table(long, short)
    assert rows["short"][5:7] == ["-0.5000", "2"]

    # the same losses logged at every step and at every 5th: no gap (each smoothed over the steps both logged)
    every = jsonl_run(tmp_path / "every", [(s, {"loss": 10 - s ** 0.5}) for s in range(1, 21)])
    fifth = jsonl_run(tmp_path / "fifth", [(s, {"loss": 10 - s ** 0.5}) for s in range(5, 21, 5)])
    assert compare_runs.main([fifth, every, "-o", png]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
    assert rows["every"][5:7] == ["+0.0000", "20"]

    rows, out = table(died, short, long)
    assert rows["died"][5:7] == rows["short"][5:7] == rows["long"][5:7] == ["-", "-"]
    assert "short: no gap vs ref: the reference died logged no train loss" in out
    assert "long: no gap vs ref: the reference died logged no train loss" in out
    assert "died: no gap" not in out
    csv_rows = (tmp_path / "compare.csv").read_text().splitlines()
    assert csv_rows[2] == "short,metrics.jsonl,8.0,8.0,,,,,"


def test_compare_runs_reports_the_eval_sets(tmp_path, capsys):
    """data.eval sets (eval_loss/<dir>) get a column each (the last value a run logged, "-" in a run without the
    set), in the order first met, in the table and the CSV, and a panel of the plot; runs without any keep the
    plain table."""
    web = jsonl_run(tmp_path / "web", [(1, {"loss": 5.0}), (2, {"val_loss": 4.5, "eval_loss/data/code": 6.0}),
                                       (4, {"val_loss": 4.0, "eval_loss/data/code": 5.5})])
    mix = jsonl_run(tmp_path / "mix", [(1, {"loss": 5.5}), (2, {"eval_loss/data/code": 5.0, "eval_loss/data/x": 7.0}),
                                       (4, {"eval_loss/data/code": 4.25})])
    png = tmp_path / "compare.png"
    assert compare_runs.main([web, mix, "-o", str(png), "--smooth", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-4:] == ["final", "eval_loss/data/code", "final", "eval_loss/data/x"]
    rows = {line.split()[0]: line.split() for line in lines[1:]}
    assert rows["web"][-2:] == ["5.5000", "-"] and rows["mix"][-2:] == ["4.2500", "7.0000"]
    csv_rows = (tmp_path / "compare.csv").read_text().splitlines()
    assert csv_rows[0].endswith(",median tokens/s,final eval_loss/data/code,final eval_loss/data/x")
    assert csv_rows[1].endswith(",5.5,") and csv_rows[2].endswith(",4.25,7.0")
    with_panel = png.stat().st_size
    assert compare_runs.main([web, "-o", str(png)]) == 0                  # (one run: its own set, still a panel)
    assert capsys.readouterr().out.splitlines()[0].split()[-2:] == ["final", "eval_loss/data/code"]
    plain = jsonl_run(tmp_path / "plain", [(1, {"loss": 5.0}), (2, {"val_loss": 4.5})])
    assert compare_runs.main([plain, "-o", str(png)]) == 0
    assert "eval_loss" not in capsys.readouterr().out + (tmp_path / "compare.csv").read_text()
    assert png.stat().st_size < with_panel


def _metrics_lines(*steps) -> str:
    return "".join(json.dumps({"step": s, "val_loss": 2.5}) + "\n" for s in steps)


@pytest.mark.parametrize("killed_at", range(4))
def test_a_start_killed_while_it_cuts_metrics_moves_each_line_once(tmp_path, monkeypatch, killed_at):
    """cut_metrics' four writes (its journal, metrics.superseded.jsonl, metrics.jsonl, the journal removed): a
    kill before any of them, then the next start (from the same checkpoint), leaves each cut line in
    metrics.superseded.jsonl once and the kept ones in metrics.jsonl, as a start that was not killed does.
    Before the journal, a kill between the append and the rewrite appended the same lines again."""
    from megatron_mini import logger

    class Killed(BaseException):
        pass
    calls = []

    def once(real):
        def op(*args):
            calls.append(args[0])
            if len(calls) == killed_at + 1:
                raise Killed
            return real(*args)
        return op
    (tmp_path / "metrics.superseded.jsonl").write_text(_metrics_lines(9))     # an earlier branch's
    (tmp_path / "metrics.jsonl").write_text(_metrics_lines(5, 10, 15) + '{"step": 15, "lo')
    with monkeypatch.context() as m:
        m.setattr(logger, "atomic_write", once(logger.atomic_write))
        m.setattr(logger.os, "unlink", once(os.unlink))
        with pytest.raises(Killed):
            logger.cut_metrics(str(tmp_path), 5)
    assert logger.cut_metrics(str(tmp_path), 5) == (3 if killed_at < 3 else 0)
    assert (tmp_path / "metrics.jsonl").read_text() == _metrics_lines(5)
    assert (tmp_path / "metrics.superseded.jsonl").read_text() == (_metrics_lines(9, 10, 15) + '{"step": 15, "lo\n')
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "metrics.superseded.jsonl"]


def test_the_same_lines_superseded_twice_are_kept_twice(tmp_path):
    """Two attempts that logged the same lines past the checkpoint (evaluations are deterministic) and were
    both cut: metrics.superseded.jsonl holds them twice, once for each attempt."""
    from megatron_mini.logger import cut_metrics
    for _ in range(2):
        (tmp_path / "metrics.jsonl").write_text(_metrics_lines(5, 10))
        assert cut_metrics(str(tmp_path), 5) == 1
    assert (tmp_path / "metrics.superseded.jsonl").read_text() == _metrics_lines(10, 10)


def test_compare_runs_draws_the_norms_in_a_panel_of_their_own(tmp_path, monkeypatch):
    """Runs that logged grad_norm (an fp16 run's skipped steps: inf) and param_norm get a panel below the losses:
    the gradient's norm on a log axis, the weights' on its right axis, a line per run each; runs without either get
    none."""
    import matplotlib.pyplot as plt
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    fp16 = jsonl_run(tmp_path / "fp16", [(s, {"loss": 5.0 - s / 10, "grad_norm": math.inf if s == 2 else 1.0 + s,
                                              "param_norm": 40.0 + s}) for s in range(1, 6)])
    bf16 = jsonl_run(tmp_path / "bf16", [(s, {"loss": 5.0 - s / 9, "grad_norm": 2.0 + s}) for s in range(1, 6)])
    plain = jsonl_run(tmp_path / "plain", [(1, {"loss": 5.0}), (2, {"val_loss": 4.5})])
    assert compare_runs.main([fp16, bf16, "-o", str(tmp_path / "a.png"), "--smooth", "0"]) == 0
    assert compare_runs.main([plain, "-o", str(tmp_path / "b.png")]) == 0
    with_norms, without = figures
    assert len(without.axes) == 1                                       # (the losses alone)
    losses, grads, weights = with_norms.axes
    assert grads.get_yscale() == "log" and grads.get_ylabel() == "grad norm (EMA 0.0)"
    assert [list(line.get_ydata()) for line in grads.get_lines()] == [[2.0, 4.0, 5.0, 6.0], [3.0, 4.0, 5.0, 6.0, 7.0]]
    assert [list(line.get_ydata()) for line in weights.get_lines()] == [[41.0, 42.0, 43.0, 44.0, 45.0]]


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's /proc/self/status")
def test_cpu_peak_memory_is_the_peak_rss_on_linux_and_on_macos(monkeypatch):
    """A CPU rank's peak memory is its peak RSS, the kernel's VmHWM (/proc/self/status, kB): from getrusage's
    ru_maxrss in KiB on Linux, and in bytes on macOS (its getrusage(2)), where reading it as KiB gave 1024x. Within
    1% either way: Linux updates the high-water mark that getrusage reads lazily, where VmHWM takes the current RSS
    too; and a thread's exit records the mm's high-water mark in ru_maxrss from the kernel's batched per-CPU RSS
    counters, a few pages above what a later VmHWM may read (4 KiB over 0.83 GiB, once, in a pytest worker whose
    earlier tests' threads had ended).
    Linux's ru_maxrss also keeps the peak of the image this process replaced at exec (its launcher's, through
    vfork): under a launcher larger than pytest it read 3.0 GiB for a VmHWM of 0.24, so this process first holds
    more than that itself."""
    def status_kib(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))

    def vm_hwm_gib() -> float:
        return status_kib("VmHWM") / 2**20
    inherited = logger_module.resource.getrusage(logger_module.resource.RUSAGE_SELF).ru_maxrss   # KiB
    lift = (inherited - status_kib("VmRSS") + 2**15) * 1024 if inherited > status_kib("VmHWM") else 0
    if lift > 4 * 2**30:
        pytest.skip(f"launched by a process whose peak RSS, {inherited / 2**20:.1f} GiB, this one's ru_maxrss keeps")
    held = bytearray(lift)
    held[::4096] = b"\1" * len(range(0, lift, 4096))                     # (touched: resident)
    meter = Throughput(TrainConfig(), 1, torch.device("cpu"), "gloo", rank=0)
    before = vm_hwm_gib()
    peak = meter.peak_memory_gib()
    assert 0.99 * before <= peak <= 1.01 * vm_hwm_gib()
    macos = types.SimpleNamespace(ru_maxrss=int(before * 2**30))        # what macOS's getrusage reports: bytes
    monkeypatch.setattr(logger_module.resource, "getrusage", lambda who: macos)
    with monkeypatch.context() as m:
        m.setattr(sys, "platform", "darwin")
        assert meter.peak_memory_gib() == before
    del held


def test_a_start_that_evaluates_its_checkpoint_first_keeps_that_steps_train_row(tmp_path):
    """A run stopped at step 5 (its checkpoint owes step 5's evaluation), resumed (step 5 evaluated first, steps 6-7
    trained), killed, and resumed from step 5 again (evaluated first once more): read from its logged entries in
    order (wandb's segments), step 5 keeps the train metrics the first start logged, as metrics.jsonl, which each
    start cuts (cut_metrics), keeps them. Before, the second evaluation of step 5, a step below the last logged,
    replaced the whole row: step 5's loss was gone."""
    from megatron_mini.logger import cut_metrics
    run_dir, entries = str(tmp_path / "run"), []

    def start(logged, cut_at=None):
        if cut_at is not None:
            cut_metrics(run_dir, cut_at, evaluates_it=True)
        logger = RunLogger(run_dir, WandbConfig(mode="disabled"), {}, enabled=True)
        for step, metrics in logged:
            logger.log(step, metrics)
            entries.append((step, metrics))
        logger.finish()

    def trained(steps, offset):
        return [(s, {"loss": 5.0 / s + offset, "grad_norm": 1.0 + s + offset}) for s in steps]
    start([(0, {"val_loss": 6.0})] + trained(range(1, 6), 0.0))
    start([(5, {"val_loss": 4.5, "eval_loss/data/code": 5.5})] + trained(range(6, 8), 1.0), cut_at=5)
    start([(5, {"val_loss": 4.5, "eval_loss/data/code": 5.5})] + trained(range(6, 9), 2.0), cut_at=5)
    rows = compare_runs.merge_history(entries)
    assert rows == compare_runs.read_jsonl(os.path.join(run_dir, "metrics.jsonl"))
    assert rows[5] == {"step": 5, "loss": 1.0, "grad_norm": 6.0, "val_loss": 4.5, "eval_loss/data/code": 5.5}
    assert [row["step"] for row in rows] == list(range(9)) and rows[8]["loss"] == 5.0 / 8 + 2.0


def test_compare_runs_says_which_runs_train_other_tokens_a_step(tmp_path, capsys):
    """The gap vs ref is taken at the same step: a run whose steps train another batch than the reference's (gbs x
    seq_len, as the .hydra/config.yaml training writes says) gets a line saying the comparison is not after the
    same tokens; a run of the reference's batch, and a directory without the file, get none."""
    from omegaconf import OmegaConf
    specs = []
    for name, gbs, seq_len in (("ref", 32, 128), ("same", 32, 128), ("wide", 64, 128), ("long", 32, 256),
                               ("unknown", None, None)):
        specs.append(jsonl_run(tmp_path / name, [(s, {"loss": 5.0 - s / 10}) for s in range(1, 4)]))
        if gbs:
            cfg = TrainConfig(gbs=gbs)
            cfg.model.seq_len = seq_len
            os.makedirs(tmp_path / name / ".hydra")
            (tmp_path / name / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    assert compare_runs.main(specs + ["-o", str(tmp_path / "compare.png")]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "a step against" in line]
    assert notes == [f"{name}: {batch} a step against the reference's gbs 32 x seq_len 128: the gap vs ref and the "
                     f"curves compare them at the same step, not after the same tokens"
                     for name, batch in (("wide", "gbs 64 x seq_len 128"), ("long", "gbs 32 x seq_len 256"))]
