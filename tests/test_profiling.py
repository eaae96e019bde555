"""profile.*: torch.profiler over chosen steps of a run (megatron_mini.profiling.StepProfiler)."""
import collections
import gzip
import json
import logging
import os
import re
import time
import types

import pytest
import torch

from ranks import spawn
from harness import small_config, train_on_a_fake_clock, train_on_ranks
from megatron_mini.config import ConfigError, ProfileConfig, TrainConfig, validate
from megatron_mini.profiling import StepProfiler


def _ranges(path) -> list:
    """The names of the trace's record_function ranges ("user_annotation" events), in order of time."""
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    return [e["name"] for e in sorted(events, key=lambda e: e.get("ts", 0)) if e.get("cat") == "user_annotation"]


def _ops(path) -> collections.Counter:
    """The trace's CPU ops: {name: calls}."""
    with gzip.open(path, "rt") as f:
        return collections.Counter(e["name"] for e in json.load(f)["traceEvents"] if e.get("cat") == "cpu_op")


def _loop(profiler: StepProfiler, first: int, last: int, device: str = "cpu") -> None:
    """Steps first..last of a stand-in run: one matmul each, and after each an "evaluation" (a cumsum, 30 ms)."""
    x = torch.ones(64, 64, device=device)
    try:
        for step in range(first, last + 1):
            with profiler.step(step):
                x = (x @ x).clamp(max=1.0)
            torch.cumsum(x, 0)
            time.sleep(0.03)
    finally:
        profiler.close()


@pytest.mark.parametrize("start, steps, first, last, traced", [
    (3, 2, 0, 8, [3, 4]),           # step 2 warms the profiler up, unrecorded
    (1, 2, 0, 8, [1, 2]),           # no step before the first to warm up with
    (4, 3, 0, 5, [4, 5]),           # the run ends inside the window: what was traced is written
    (4, 2, 3, 8, [4, 5]),           # a resumed run whose first step is the window's
])
def test_the_profiler_traces_the_steps_it_is_given(tmp_path, start, steps, first, last, traced):
    """The trace holds a range "step N" for each step of the window the run reaches, and no other; its
    tables name the steps."""
    profiler = StepProfiler(ProfileConfig(start=start, steps=steps), str(tmp_path), 3, torch.device("cpu"), first,
                            last, logging.getLogger("test"))
    _loop(profiler, first + 1, last)
    where = tmp_path / "profile" / f"step_{traced[0]:06d}-{traced[-1]:06d}"
    assert sorted(os.listdir(where)) == ["rank0003.json.gz", "rank0003.txt"]
    assert [r for r in _ranges(where / "rank0003.json.gz") if r.startswith("step ")] == [f"step {s}" for s in traced]
    assert profiler.note == f"profile: this rank traces steps {start}-{traced[-1]} into {tmp_path}/profile/"
    text = (where / "rank0003.txt").read_text()
    assert text.startswith(f"profile of steps {traced[0]}-{traced[-1]} on rank 3:") and "aten::mm" in text
    ops = _ops(where / "rank0003.json.gz")           # what runs between the steps (an evaluation, a save) too,
    assert "aten::mm" in ops and "aten::cumsum" in ops and "aten::cumsum" in text    # and the header says so;
    assert ops["aten::cumsum"] == len(traced) - 1 + (start > first + 1)    # (after the warmup step too, not the last)
    between = re.search(r"ms a step \(wall, profiler on\); ([\d.]+) ms between them \(an evaluation, a save", text)
    assert (between is not None) == (len(traced) > 1) and (not between or float(between.group(1)) >= 30), text
    assert "ProfilerStep" not in text                # (the profiler's own ranges are no rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_profiler_traces_the_gpus_kernels(tmp_path):
    """On CUDA the trace holds the steps' kernels, and the tables are of CUDA kernels (GEMMs among them)."""
    profiler = StepProfiler(ProfileConfig(start=2, steps=2), str(tmp_path), 0, torch.device("cuda"), 0, 4,
                            logging.getLogger("test"))
    _loop(profiler, 1, 4, "cuda")
    where = tmp_path / "profile" / "step_000002-000003"
    text = (where / "rank0000.txt").read_text()
    assert "CUDA kernels busy" in text and re.search(r"\| GEMM \| [\d.]+ \|", text), text
    with gzip.open(where / "rank0000.json.gz", "rt") as f:
        assert any(e.get("cat") == "kernel" for e in json.load(f)["traceEvents"])


def test_a_run_stopped_inside_the_window_counts_what_ran_after_its_last_step(tmp_path):
    """A run that stops inside the window during the "evaluation" after its step 4 (a stop cuts it short; the
    run closes the profiler before its save): the trace holds that evaluation, and the header counts it as
    time between the steps (both evaluations, 30 ms each)."""
    profiler = StepProfiler(ProfileConfig(start=3, steps=3), str(tmp_path), 0, torch.device("cpu"), 0, 8,
                            logging.getLogger("test"))
    _loop(profiler, 1, 4)
    where = tmp_path / "profile" / "step_000003-000004"
    assert _ops(where / "rank0000.json.gz")["aten::cumsum"] == 3             # (after steps 2, 3 and 4)
    text = (where / "rank0000.txt").read_text()
    between = re.search(r"ms a step \(wall, profiler on\); ([\d.]+) ms between them \(an evaluation, a save", text)
    assert between is not None and float(between.group(1)) >= 60, text


def test_a_step_that_raises_inside_the_window_is_said_apart(tmp_path):
    """A run whose step 5 raises (a non-finite loss) after 0.3 s and 50 matmuls writes the trace of the steps it
    ran: its header counts the step that raised with the time between the steps, and says so; its tables' shares
    of the wall time, that step's ops among them, stay within 100%."""
    profiler = StepProfiler(ProfileConfig(start=3, steps=3), str(tmp_path), 0, torch.device("cpu"), 0, 8,
                            logging.getLogger("test"))
    x = torch.ones(64, 64)
    with pytest.raises(FloatingPointError):
        try:
            for step in range(1, 6):
                with profiler.step(step):
                    for _ in range(50 if step == 5 else 1):
                        x = (x @ x).clamp(max=1.0)
                    if step == 5:
                        time.sleep(0.3)
                        raise FloatingPointError("the training loss is nan")
                time.sleep(0.03)
        finally:
            profiler.close()
    text = (tmp_path / "profile" / "step_000003-000004" / "rank0000.txt").read_text()
    between = re.search(r"ms a step \(wall, profiler on\); ([\d.]+) ms between them and in step 5, which raised "
                        r"\(their ops are in the trace and the tables too\)", text)
    assert between is not None and float(between.group(1)) >= 330, text
    shares = [float(row.rsplit("|", 2)[1]) for row in text.splitlines() if row.startswith("| aten::")]
    assert shares and max(shares) <= 100, text


@pytest.mark.parametrize("ranks", [None, [1]])
def test_a_run_resumed_past_the_window_traces_nothing(tmp_path, ranks):
    """Every rank says so, those not chosen too (rank 0's console line promised rank 1's trace)."""
    profiler = StepProfiler(ProfileConfig(start=3, ranks=ranks), str(tmp_path), 0, torch.device("cpu"), 5, 8,
                            logging.getLogger("test"))
    _loop(profiler, 6, 8)
    assert profiler.note == "profile: this run starts after step 5, past profile.start=3: nothing is profiled"
    assert not (tmp_path / "profile").exists()


def test_a_trace_that_is_cut_short_is_a_warning_and_leaves_nothing(tmp_path, monkeypatch, caplog):
    """torch's export that fails (its disk full) prints a line and raises nothing, leaving a truncated file: the
    trace is checked, the warning logged, no file left, and the steps go on."""
    from torch.profiler import profile

    def cut_short(self, path, *args, **kwargs):
        with open(path, "w") as f:
            f.write('{"traceEvents": [')
    monkeypatch.setattr(profile, "export_chrome_trace", cut_short)
    profiler = StepProfiler(ProfileConfig(start=2), str(tmp_path), 0, torch.device("cpu"), 0, 5,
                            logging.getLogger("test"))
    with caplog.at_level(logging.INFO, logger="test"):
        _loop(profiler, 1, 5)
    assert "warning: rank 0 could not write its profile" in caplog.text and "is cut short" in caplog.text
    assert os.listdir(tmp_path / "profile" / "step_000002-000003") == []


def test_profile_ranks_must_name_ranks_of_the_run():
    for ranks, fact in (([], "profile.ranks=[] names no rank"), ([0, 4, 9], "names ranks 4, 9, but this run's ranks "
                                                                           "are 0 to 3")):
        with pytest.raises(ConfigError, match=re.escape(fact)):
            validate(TrainConfig(profile=ProfileConfig(start=1, ranks=ranks)), 4)


def test_a_profiled_run_traces_its_ranks_steps_and_schedule_and_trains_the_same(small_data, tmp_path):
    """pp=2 on two ranks, profile.start=3 steps=2 on rank 1 only: rank 1 writes the trace of steps 3 and 4, whose
    ranges are the steps and, within them, the actions of its pipeline schedule (its receives from stage 0
    among them); rank 0 writes none; the losses are those of the same run unprofiled, to the bit."""
    plain = train_on_ranks(2, small_config(small_data, tmp_path / "plain", pp=2, steps=6))
    traced = train_on_ranks(2, small_config(small_data, tmp_path / "run", pp=2, steps=6, **{
        "profile.start": 3, "profile.steps": 2, "profile.ranks": [1]}))
    assert traced["loss"] == plain["loss"]
    where = tmp_path / "run" / "profile" / "step_000003-000004"
    assert sorted(os.listdir(where)) == ["rank0001.json.gz", "rank0001.txt"]
    ranges = _ranges(where / "rank0001.json.gz")
    assert [r for r in ranges if r.startswith("step ")] == ["step 3", "step 4"]
    assert ranges.count("forward(c0, mb0)") == ranges.count("backward(c0, mb7)") == 2      # (8 microbatches)
    assert any(r.startswith("recv_act(c0, mb0)<-0") for r in ranges), ranges
    log = (tmp_path / "run" / "logs" / "rank0001.log").read_text()
    assert f"profile: steps 3-4 of rank 1 in {where}/rank0001.json.gz" in log
    log = (tmp_path / "run" / "logs" / "rank0000.log").read_text()
    assert f"profile: rank 1 traces steps 3-4 into {tmp_path / 'run' / 'profile'}/ (not this one)" in log


def test_step_lines_leave_out_the_profilers_own_time(small_data, tmp_path):
    """Each step line's tokens/s is its steps' own: the profiler's start and stop, and the writing of its trace and
    tables after the window's last step (seconds: that step's line showed 1/40 of a tiny model's rate), are not
    charged to the step."""
    cfg = small_config(small_data, tmp_path, steps=4, log_interval=1, **{"profile.start": 2, "profile.steps": 2})
    spawn(1, train_on_a_fake_clock, cfg, init_group=False)
    assert sorted(os.listdir(tmp_path / "profile" / "step_000002-000003")) == ["rank0000.json.gz", "rank0000.txt"]
    rates = [r["tokens_per_s"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())]
    assert rates == [cfg.gbs * cfg.model.seq_len / 1.0] * cfg.steps


def test_the_gpus_ranges_are_no_kernels():
    """On CUDA each record_function range ("step 4", "forward(c0, mb0)") comes back as a device event as long as the
    kernels it spans (kineto's gpu_user_annotation): the kernels' table and busy sum leave them out, as torch's own
    table sums its "Self CUDA time total" (before, they were the top "kernels": here 2.3 ms busy for 0.9 ms of them)."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent
    from megatron_mini.profiling import busy

    def event(i, name, start, end, annotation=False):
        return FunctionEvent(id=i, name=name, thread=7, start_us=start, end_us=end, use_device="cuda", stack=[],
                             device_type=DeviceType.CUDA, is_user_annotation=annotation)
    events = EventList([event(1, "step 4", 0, 1000, True), event(2, "forward(c0, mb0)", 0, 400, True),
                        event(3, "sm90_xmma_gemm", 10, 710), event(4, "ncclDevKernel_AllReduce", 800, 1000)],
                       use_device="cuda")
    events._build_tree()
    kernels = busy(types.SimpleNamespace(key_averages=events.key_averages), cuda=True)
    assert kernels == [("sm90_xmma_gemm", 1, 0.7), ("ncclDevKernel_AllReduce", 1, 0.2)]
    total = re.search(r"Self CUDA time total: ([\d.]+)us", events.key_averages().table()).group(1)
    assert sum(ms for _, _, ms in kernels) == pytest.approx(float(total) / 1e3, rel=1e-12)


def test_a_cpu_profiles_busy_time_is_its_ops_not_the_time_between_them(tmp_path):
    """On a CPU a record_function range's self time is the host's between its ops (Python's): the header's busy time
    and the tables are the ops' alone. Before, they had the ranges too ("step 2" a row of the table), so a CPU was
    always as busy as the wall time (a step that slept 50 ms beside one small matmul, 100% busy)."""
    profiler = StepProfiler(ProfileConfig(start=2, steps=2), str(tmp_path), 0, torch.device("cpu"), 0, 4,
                            logging.getLogger("test"))
    x = torch.ones(64, 64)
    try:
        for step in range(1, 5):
            with profiler.step(step):
                x = (x @ x).clamp(max=1.0)
                time.sleep(0.05)
    finally:
        profiler.close()
    text = (tmp_path / "profile" / "step_000002-000003" / "rank0000.txt").read_text()
    wall, ops = map(float, re.match(r"profile of steps 2-3 on rank 0: ([\d.]+) ms a step \(wall, profiler on\); "
                                    r"CPU ops busy ([\d.]+) ms a step", text).groups())
    assert wall >= 50 and ops < 25, text
    assert "aten::mm" in text and "| step 2 |" not in text, text
