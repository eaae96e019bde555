"""Pipeline schedules as data: built, simulated (no processes), checked, and drawn."""
import dataclasses
import importlib.util
import itertools
import os
import random
import re

import pytest

from megatron_mini import schedules
from megatron_mini.config import ConfigError, TrainConfig, validate
from megatron_mini.schedules import (
    Action, ScheduleError, build_schedule, check_schedule, comm_batches, schedule_graph, simulate, simulate_actions,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def valid_microbatches(kind, pp, vpp):
    """A spread of microbatch counts (fewer than, equal to, more than and not a multiple of pp) the
    schedule accepts."""
    ms = sorted({1, 2, pp - 1, pp, pp + 1, 2 * pp - 1, 2 * pp, 2 * pp + 1, 3 * pp} - {0})
    return [m for m in ms if not (kind == "1f1b" and vpp > 1 and m < pp)]


def expected_bubble(kind, pp, vpp, m):
    return (pp - 1) / (vpp * m) if vpp > 1 else (pp - 1) / m


@pytest.mark.parametrize("vpp", [1, 2, 3, 4])
@pytest.mark.parametrize("pp", range(1, 9))
@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_grid(kind, pp, vpp):
    """Every layout simulates without deadlock or mismatch, runs each (chunk, mb) once each way, hits its bubble."""
    for m in valid_microbatches(kind, pp, vpp):
        res = simulate(kind, pp, vpp, m)          # raises ScheduleError on deadlock / mismatch / order
        for rank, (actions, timeline) in enumerate(zip(res.actions, res.timelines)):
            assert actions == build_schedule(kind, pp, vpp, m, rank)
            for op, cost in (("forward", 1.0 / vpp), ("backward", 2.0 / vpp)):
                runs = [(s.chunk, s.microbatch) for s in timeline if s.op == op]
                assert sorted(runs) == [(c, mb) for c in range(vpp) for mb in range(m)]
                assert all(abs(s.end - s.start - cost) < 1e-12 for s in timeline if s.op == op)
            assert all(a.end <= b.start + 1e-12 for a, b in zip(timeline, timeline[1:]))
            if pp == 1:
                assert all(not a.is_comm for a in actions)
        # bubble: exact for every m >= pp; GPipe with vpp > 1 and m < pp waits for its hand-overs
        if kind == "gpipe" and vpp > 1 and m < pp:
            assert res.bubble >= expected_bubble(kind, pp, vpp, m) - 1e-9
        else:
            assert res.bubble == pytest.approx(expected_bubble(kind, pp, vpp, m), abs=1e-9)
        if kind == "gpipe":
            assert res.peak_in_flight == [m * vpp] * pp
        elif vpp == 1:
            assert res.peak_in_flight == [min(pp - r, m) for r in range(pp)]
            assert all(peak <= pp - r for r, peak in enumerate(res.peak_in_flight))


@pytest.mark.parametrize("pp,vpp,m,n", [(1, 3, 2, 1), (2, 2, 4, 2), (4, 1, 8, 4), (4, 2, 4, 4), (4, 2, 8, 4),
                                        (3, 4, 9, 3), (8, 2, 16, 8), (2, 2, 3, 3), (4, 2, 9, 5), (4, 3, 6, 6),
                                        (3, 2, 10, 5)])
def test_warmup_counts(pp, vpp, m, n):
    """Warmup forwards: pp-r-1 for 1F1B, 2(pp-r-1) + (vpp-1)N for interleaved, capped at m*vpp, where N is
    the microbatch group (pp when m is a multiple of pp)."""
    for rank in range(pp):
        warmup = min(pp - rank - 1, m) if vpp == 1 else min(2 * (pp - rank - 1) + (vpp - 1) * n, m * vpp)
        ops = [a.op for a in build_schedule("1f1b", pp, vpp, m, rank) if not a.is_comm]
        # then the steady state starts with a forward (if any are left) before the first backward
        assert ops.index("backward") == warmup + (warmup < m * vpp)
        assert ops[:warmup] == ["forward"] * warmup


def test_interleaved_order():
    """Microbatches go through chunk 0 in groups of pp, then chunk 1; backward visits chunks in reverse."""
    acts = [a for a in build_schedule("1f1b", 2, 2, 4, 0) if not a.is_comm]
    fwd = [(a.chunk, a.microbatch) for a in acts if a.op == "forward"]
    bwd = [(a.chunk, a.microbatch) for a in acts if a.op == "backward"]
    assert fwd == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    assert bwd == [(1, 0), (1, 1), (0, 0), (0, 1), (1, 2), (1, 3), (0, 2), (0, 3)]


@pytest.mark.parametrize("pp", [2, 3, 4, 6])
def test_microbatch_groups(pp):
    """Every m >= pp splits into groups of N, the last one shorter only if it still holds pp (a shorter one
    would wait for its own hand-over), with N the smallest such group from pp up; N = pp for multiples."""
    for m in range(pp, 5 * pp):
        fwd = schedules.forward_order(pp, 2, m)
        runs = [len(list(g)) for c, g in itertools.groupby(fwd, key=lambda x: x[0]) if c == 0]
        assert sum(runs) == m and min(runs) >= pp and set(runs[:-1]) <= {runs[0]}
        assert runs[0] == schedules.microbatch_group(pp, m)
        smaller = [n for n in range(pp, runs[0]) if m % n == 0 or m % n >= pp]
        assert not smaller and (runs[0] == pp) == (m % pp == 0)


@pytest.mark.parametrize("pp,m", [(2, 5), (3, 8), (4, 10)])
def test_hand_over_waits_in_the_buffer(monkeypatch, pp, m):
    """With N > pp the last rank sends rank 0 a chunk's activation N - pp steps before rank 0 runs the next
    chunk on it (and rank 0 sends the last rank a gradient early): each receive is posted with its send.
    Posted just before the compute that needs it instead, the messages no longer match (pp=2) or the sends
    stall their ranks and deadlock."""
    n = schedules.microbatch_group(pp, m)
    assert n > pp
    first = build_schedule("1f1b", pp, 2, m, 0)
    recv, fwd = _index(first, "recv_act", 1, 0), _index(first, "forward", 1, 0)
    assert [a.op for a in first[recv:fwd]].count("forward") == n - pp
    assert simulate("1f1b", pp, 2, m).bubble == pytest.approx((pp - 1) / (2 * m))

    def just_in_time(pp, vpp, m, rank, steps):
        return {t - 1: [r for a in step for r in schedules._receive_input(a, pp, vpp, rank)]
                for t, step in enumerate(steps)}
    monkeypatch.setattr(schedules, "_posted_receives", just_in_time)
    with pytest.raises(ScheduleError, match="deadlocks|does not match"):
        simulate("1f1b", pp, 2, m)


def test_comm_grouping():
    """1F1B steady state: send_act + recv_grad share a batch, as do send_grad + recv_act; ends need no comm."""
    steps = comm_batches(build_schedule("1f1b", 4, 1, 8, 1))
    after = {}
    for prev, step in zip(steps, steps[1:]):
        if isinstance(step, tuple) and isinstance(prev, Action):
            after.setdefault(prev.op, set()).add(tuple(a.op for a in step))
    assert ("send_act", "recv_grad") in after["forward"]
    assert ("send_grad", "recv_act") in after["backward"]
    first = build_schedule("1f1b", 4, 1, 8, 0)
    assert not any(a.op in ("recv_act", "send_grad") for a in first)
    last = build_schedule("1f1b", 4, 1, 8, 3)
    assert not any(a.op in ("send_act", "recv_grad") for a in last)
    assert all(len(s) <= 4 for s in comm_batches(build_schedule("1f1b", 2, 3, 4, 0)) if isinstance(s, tuple))


# ------------------------------------------------------------------ the simulator catches broken schedules

def _lists(kind="1f1b", pp=4, vpp=1, m=4):
    return [build_schedule(kind, pp, vpp, m, r) for r in range(pp)]


def _index(actions, op, chunk=0, microbatch=0):
    return actions.index(next(a for a in actions if (a.op, a.chunk, a.microbatch) == (op, chunk, microbatch)))


def test_swapped_receives_mismatch():
    lists = _lists()
    i, j = _index(lists[1], "recv_act", 0, 1), _index(lists[1], "recv_act", 0, 2)
    lists[1][i], lists[1][j] = lists[1][j], lists[1][i]
    with pytest.raises(ScheduleError, match="does not match"):
        simulate_actions(lists, 1, 4)


def test_dropped_send_deadlocks():
    lists = _lists(vpp=2, m=4)
    del lists[0][_index(lists[0], "send_act", 1, 3)]      # the last message from rank 0 to rank 1
    with pytest.raises(ScheduleError,
                       match=r"deadlocks: .*rank 1 waits in batch \[.*recv_act\(c1, mb3\)<-0 \(unmatched\)"):
        simulate_actions(lists, 2, 4)


def test_wrong_peer_is_caught():
    lists = _lists()
    i = _index(lists[1], "send_act", 0, 0)
    lists[1][i] = dataclasses.replace(lists[1][i], peer=0)
    with pytest.raises(ScheduleError, match="lives on rank 2"):
        simulate_actions(lists, 1, 4)


def test_backward_before_forward_is_caught():
    lists = _lists(pp=1, vpp=2, m=2)
    lists[0].insert(0, lists[0].pop(_index(lists[0], "backward", 1, 0)))
    with pytest.raises(ScheduleError, match="before its forward"):
        simulate_actions(lists, 2, 2)


def test_compute_without_its_input_is_caught():
    lists = _lists(pp=2, m=2)
    del lists[0][_index(lists[0], "send_act", 0, 0)]
    del lists[1][_index(lists[1], "recv_act", 0, 0)]
    with pytest.raises(ScheduleError, match=r"rank 1, forward\(c0, mb0\): its input act was not received"):
        simulate_actions(lists, 1, 2)


def test_missing_and_repeated_compute_are_caught():
    lists = _lists(pp=1, m=3)
    del lists[0][_index(lists[0], "backward", 0, 2)]
    with pytest.raises(ScheduleError, match="2 of its 3"):
        simulate_actions(lists, 1, 3)
    lists = _lists(pp=1, m=3)
    lists[0].append(Action("forward", 0, 1))
    with pytest.raises(ScheduleError, match="runs twice"):
        simulate_actions(lists, 1, 3)


def test_sends_and_computes_that_cannot_be_are_caught():
    """The simulator's own refusals (it is what every schedule is checked with: a check that never fires checks
    nothing): a send of a result before the compute that makes it, a send past the last virtual stage, a compute
    of a microbatch the step does not have, an op no schedule has."""
    lists = _lists(pp=2, m=2)
    lists[0].insert(0, lists[0].pop(_index(lists[0], "send_act", 0, 0)))
    with pytest.raises(ScheduleError, match=r"rank 0, send_act\(c0, mb0\)->1: sends a result that was not computed"):
        simulate_actions(lists, 1, 2)
    lists = _lists(pp=2, m=2)
    lists[1].insert(_index(lists[1], "forward", 0, 0) + 1, Action("send_act", 0, 0, peer=0))
    with pytest.raises(ScheduleError, match="virtual stage 1 has no neighbour to exchange act with"):
        simulate_actions(lists, 1, 2)
    lists = _lists(pp=1, m=2)
    lists[0].append(Action("forward", 0, 2))
    with pytest.raises(ScheduleError, match=r"rank 0, forward\(c0, mb2\): no such chunk or microbatch"):
        simulate_actions(lists, 1, 2)
    lists = _lists(pp=2, m=2)
    lists[0].insert(0, Action("send_loss", 0, 0, peer=1))
    with pytest.raises(ScheduleError, match="unknown op"):
        simulate_actions(lists, 1, 2)


@pytest.mark.parametrize("pp", [2, 4])
def test_one_batch_per_compute_fails_interleaved(monkeypatch, pp):
    """Why interleaved 1F1B batches the comm of a whole (forward, backward) pair: with one batch per compute,
    pp=2's messages no longer match and pp=4 waits so long that its bubble is worse than 1F1B's without
    interleaving."""
    assert simulate("1f1b", pp, 2, 2 * pp).bubble == pytest.approx((pp - 1) / (2 * 2 * pp))
    pairs = schedules.compute_steps
    monkeypatch.setattr(schedules, "compute_steps", lambda *args: [[a] for step in pairs(*args) for a in step])
    if pp == 2:
        with pytest.raises(ScheduleError, match="does not match"):
            simulate("1f1b", pp, 2, 2 * pp)
    else:
        assert simulate("1f1b", pp, 2, 2 * pp).bubble > (pp - 1) / (2 * pp)


# ------------------------------------------------------------------ configuration errors

def test_check_schedule_rejects_bad_combinations():
    with pytest.raises(ConfigError, match="at least 4 microbatches per step.*but there are 3"):
        check_schedule("1f1b", 4, 2, 3)
    with pytest.raises(ConfigError, match="schedule='zb': choose one of gpipe, 1f1b"):
        validate(TrainConfig(schedule="zb"), 1)          # the choice itself is config.Schedule's
    with pytest.raises(ConfigError, match="num_microbatches >= 1"):
        build_schedule("gpipe", 2, 1, 0, 0)
    with pytest.raises(ConfigError, match="vpp >= 1"):
        check_schedule("1f1b", 2, 0, 4)
    check_schedule("1f1b", 4, 2, 6)     # interleaving takes any m >= pp; plain 1F1B and GPipe any m
    check_schedule("1f1b", 4, 1, 3)
    check_schedule("gpipe", 4, 2, 3)


# ------------------------------------------------------------------ the Gantt-chart tool

def test_plot_tool(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("plot_schedule", os.path.join(REPO, "tools", "plot_schedule.py"))
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "cmp.png"
    assert tool.main(["--pp", "2", "--microbatches", "4", "--compare", "-o", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "interleaved 1F1B panel uses vpp=2" in printed
    bubbles = [float(x) for x in re.findall(r"bubble fraction ([0-9.]+)", printed)]
    expected = [simulate("gpipe", 2, 1, 4).bubble, simulate("1f1b", 2, 1, 4).bubble, simulate("1f1b", 2, 2, 4).bubble]
    assert bubbles == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx([1 / 4, 1 / 4, 1 / 8])


@pytest.mark.parametrize("kind, pp, vpp, m", [("gpipe", 4, 2, 2), ("gpipe", 4, 3, 1), ("gpipe", 4, 2, 4),
                                             ("1f1b", 4, 1, 2), ("1f1b", 4, 2, 6), ("gpipe", 3, 1, 1)])
def test_plot_tool_says_why_a_bubble_is_above_the_textbook(kind, pp, vpp, m, tmp_path, capsys):
    """The bubble the tool states is the simulator's, next to (p-1)/(v m); where it is above that (GPipe with vpp > 1
    and m < pp: rank 0 waits for the last rank's hand-over) it says why (it stated 1.25 against "textbook 3/4"
    and nothing more), and where they are equal it adds nothing."""
    import plot_schedule as tool

    assert tool.main(["--pp", str(pp), "--vpp", str(vpp), "-m", str(m), "--schedule", kind,
                      "-o", str(tmp_path / "s.png")]) == 0
    printed = capsys.readouterr().out
    stated = float(re.search(r"bubble fraction ([0-9.]+)", printed).group(1))
    assert stated == pytest.approx(simulate(kind, pp, vpp, m).bubble, abs=1e-6)
    above = stated > (pp - 1) / (vpp * m) + 1e-6
    assert above == (kind == "gpipe" and vpp > 1 and m < pp)
    assert ("above it: with m=" in printed) == above, printed


@pytest.mark.parametrize("vpp", [2, 4, 6])
def test_plot_tool_gives_each_chunk_its_own_grey(vpp, tmp_path, monkeypatch):
    """The strip under a block says its model chunk: every chunk's strips one colour, no two chunks the same, and
    the legend names every chunk (with vpp > 4 the four greys repeated: chunk 4 was drawn as chunk 0, and the
    legend stopped at chunk 3)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex
    import plot_schedule as tool

    result = simulate("1f1b", 2, vpp, 2)
    fig, ax = plt.subplots()
    tool.draw(ax, result, "1f1b", 2, vpp, 2)
    slots = [slot for timeline in result.timelines for slot in timeline]
    strips = ax.patches[1::2]                                   # each slot draws its block, then its strip
    assert len(ax.patches) == 2 * len(slots)
    greys = {}
    for slot, strip in zip(slots, strips):
        assert strip.get_height() < 0.2 and strip.get_x() == slot.start
        greys.setdefault(slot.chunk, set()).add(to_hex(strip.get_facecolor()))
    plt.close(fig)
    assert sorted(greys) == list(range(vpp)) and all(len(g) == 1 for g in greys.values()), greys
    assert len({g for (g,) in greys.values()}) == vpp, greys
    figures = []
    monkeypatch.setattr(tool.plt, "close", figures.append)     # (keeps the figure plot() draws)
    tool.plot([("1f1b", 2, vpp, 2)], str(tmp_path / "s.png"))
    (legend,) = figures[0].legends
    labels = {text.get_text(): to_hex(patch.get_facecolor()) for text, patch in zip(legend.get_texts(),
                                                                                    legend.get_patches())}
    assert {label: grey for label, grey in labels.items() if label.startswith("chunk ")} == {
        f"chunk {c}": grey for c, (grey,) in greys.items()}


@pytest.mark.parametrize("works, m, expected", [
    # 2 stages, the last heavier: stage 1 runs back to back from the first forward of stage 0 (fill)
    # to the last backward of stage 0 (drain): f0 + m W1 + b0
    ((1.0, 3.0), 5, 1.0 + 5 * 3.0),
    # 2 stages, the first heavier (stage 1's round trip fits in its forward): stage 0 never waits, m W0
    ((3.0, 1.0), 5, 5 * 3.0),
    # 3 stages, the middle heaviest, the ends' round trips within its forward: f0 + m W1 + b0
    ((0.3, 3.0, 0.6), 4, 0.3 + 4 * 3.0),
    # pp=4 with an own embedding and head stage: W0 + W1 + m W2, a bubble of (pp-3)/m of a block stage
    ((0.01, 3.0, 3.0, 0.01), 8, 0.01 + 3.0 + 8 * 3.0),
])
def test_uneven_stages_1f1b_makespan_by_hand(works, m, expected):
    """1F1B with stages of their own costs (W per microbatch: W/3 forward, 2W/3 backward): the makespan is the
    fill before the pacing stage's first forward, its m microbatches back to back, and the drain after its last
    backward, derived by hand for each case."""
    forward, backward = [[w / 3] for w in works], [[2 * w / 3] for w in works]
    assert simulate("1f1b", len(works), 1, m, forward, backward).makespan == pytest.approx(expected, rel=1e-12)


def test_per_chunk_costs_of_equal_chunks_are_the_scalar_costs():
    """A [pp][vpp] table of equal costs times the schedule as the scalars do (cost / vpp per chunk)."""
    table = simulate("1f1b", 4, 2, 8, [[0.5] * 2] * 4, [[1.0] * 2] * 4)
    assert table.makespan == simulate("1f1b", 4, 2, 8).makespan and table.busy == simulate("1f1b", 4, 2, 8).busy
    with pytest.raises(ValueError, match=r"\[pp=4\]\[vpp=2\]"):
        simulate("1f1b", 4, 2, 8, [[0.5]] * 4, [[1.0]] * 4)


def _contract_timing(actions, forward, backward):
    """The execution contract timed event by event, written apart from schedules.py (a reference for its
    ScheduleGraph): the ranks take turns, each running its list in order as far as it can; a compute starts when
    the rank's previous step ended and lasts its [rank][chunk] cost; a batch of consecutive messages is posted when
    the rank reaches it and completes when every message's other side (the k-th message from src to dst) has been
    posted too, at the latest of those posts. Returns per rank its computes' (start, end) and its peak of
    (chunk, microbatch) forwarded but not yet backwarded."""
    pp = len(actions)
    posted = {}                                  # (src, dst, k, is_send) -> when it was posted
    clock, pos, peak = [0.0] * pp, [0] * pp, [0] * pp
    sent = [dict() for _ in range(pp)]           # per rank, per channel, its messages so far
    batch = [None] * pp                          # per rank, the messages of the batch it waits in
    slots, live = [[] for _ in range(pp)], [0] * pp
    while any(pos[r] < len(actions[r]) or batch[r] for r in range(pp)):
        moved = False
        for r in range(pp):
            while True:
                if batch[r] is not None:                          # waiting in a batch: every other side posted?
                    others = [(src, dst, k, not is_send) for src, dst, k, is_send in batch[r]]
                    if not all(o in posted for o in others):
                        break
                    clock[r] = max([clock[r]] + [posted[o] for o in others])
                    batch[r] = None
                elif pos[r] == len(actions[r]):
                    break
                elif not actions[r][pos[r]].is_comm:
                    a = actions[r][pos[r]]
                    cost = (forward if a.op == "forward" else backward)[r][a.chunk]
                    slots[r].append((clock[r], clock[r] + cost))
                    clock[r] += cost
                    live[r] += 1 if a.op == "forward" else -1
                    peak[r] = max(peak[r], live[r])
                    pos[r] += 1
                else:                                             # post the batch, the run of messages from here
                    batch[r] = []
                    while pos[r] < len(actions[r]) and actions[r][pos[r]].is_comm:
                        a = actions[r][pos[r]]
                        is_send = a.op.startswith("send")
                        channel = (r, a.peer) if is_send else (a.peer, r)
                        k = sent[r][channel] = sent[r].get(channel, -1) + 1
                        posted[(*channel, k, is_send)] = clock[r]
                        batch[r].append((*channel, k, is_send))
                        pos[r] += 1
                moved = True
        assert moved, "deadlock"
    return slots, peak


def _dataflow_makespan(actions, forward, backward):
    """The makespan with sends that never wait for their receiver: each rank runs its computes in order, each when
    the rank is free and its input is there (the forward of the virtual stage before, the backward of the one
    after, same microbatch)."""
    pp = len(actions)
    todo = [[a for a in acts if not a.is_comm] for acts in actions]
    done, free, pos = {}, [0.0] * pp, [0] * pp
    while any(pos[r] < len(todo[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while pos[r] < len(todo[r]):
                a = todo[r][pos[r]]
                vs = a.chunk * pp + r
                source = (a.op, vs - 1 if a.op == "forward" else vs + 1, a.microbatch)
                needs = [source] if 0 <= source[1] < len(forward[0]) * pp else []
                if not all(n in done for n in needs):
                    break
                cost = (forward if a.op == "forward" else backward)[r][a.chunk]
                done[a.op, vs, a.microbatch] = free[r] = max([free[r]] + [done[n] for n in needs]) + cost
                pos[r] += 1
                moved = True
        assert moved, "deadlock"
    return max(free)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp", range(2, 9))
def test_timing_is_the_contract_event_by_event(kind, pp):
    """simulate_actions (ScheduleGraph's longest paths) against the contract timed event by event
    (_contract_timing) at random per-chunk costs, vpp 1..4, m below, at, not a multiple of and several times pp:
    every compute's start and end, each rank's end, the makespan, the busiest rank's busy time and the peaks. The
    makespan is at least the dataflow one (sends that never wait), and with equal stages it is that exactly."""
    rng = random.Random(pp)
    for vpp in range(1, 5):
        for m in sorted({pp - 1, pp + 1, 2 * pp + 3, 3 * pp} - {0}):
            if kind == "1f1b" and vpp > 1 and m < pp:
                continue
            actions = [build_schedule(kind, pp, vpp, m, r) for r in range(pp)]
            forward = [[rng.uniform(0.05, 1.0) for _ in range(vpp)] for _ in range(pp)]
            backward = [[rng.uniform(0.05, 2.0) for _ in range(vpp)] for _ in range(pp)]
            res = simulate_actions(actions, vpp, m, forward, backward)
            slots, peaks = _contract_timing(actions, forward, backward)
            where = (kind, pp, vpp, m)
            assert [len(t) for t in res.timelines] == [len(s) for s in slots], where
            assert [x for t in res.timelines for s in t for x in (s.start, s.end)] == pytest.approx(
                [x for s in slots for slot in s for x in slot], rel=1e-12, abs=1e-12), where
            assert res.ends == pytest.approx([s[-1][1] for s in slots], rel=1e-12), where
            assert res.makespan == pytest.approx(max(s[-1][1] for s in slots), rel=1e-12), where
            assert res.busy == pytest.approx(max(sum(e - s for s, e in rank) for rank in slots), rel=1e-12), where
            assert res.peak_in_flight == peaks, where
            assert res.makespan >= _dataflow_makespan(actions, forward, backward) * (1 - 1e-12), where
            equal = simulate_actions(actions, vpp, m, [[1.0 / vpp] * vpp] * pp, [[2.0 / vpp] * vpp] * pp)
            assert equal.makespan == pytest.approx(
                _dataflow_makespan(actions, [[1.0 / vpp] * vpp] * pp, [[2.0 / vpp] * vpp] * pp), rel=1e-12), where


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp, vpp, m", [(2, 3, 17), (3, 4, 25), (5, 2, 41), (7, 3, 30), (8, 1, 67), (8, 4, 64)])
def test_graph_read_off_the_lists_is_the_contract_at_many_microbatches(kind, pp, vpp, m):
    """schedule_graph reads what waits for what off the lists with array operations and finds its levels in sweeps
    (the planner's path: no check_actions); at many microbatches (several groups, m not a multiple of pp) and
    random per-chunk costs, every compute's start and end are the contract's timed event by event
    (_contract_timing), to the bit: both take the latest of the same ends and add the same cost. So are each rank's
    ends of three cost tables timed in one pass (rank_ends)."""
    rng = random.Random(pp * 100 + m)
    actions = [build_schedule(kind, pp, vpp, m, r) for r in range(pp)]
    tables = [([[rng.uniform(0.05, 1.0) for _ in range(vpp)] for _ in range(pp)],
               [[rng.uniform(0.05, 2.0) for _ in range(vpp)] for _ in range(pp)]) for _ in range(3)]
    graph = schedule_graph(actions, vpp, m)
    for (forward, backward), ends in zip(tables, graph.rank_ends(tables)):
        res = graph.simulate(actions, forward, backward)
        slots, peaks = _contract_timing(actions, forward, backward)
        assert [[(s.start, s.end) for s in t] for t in res.timelines] == slots
        assert ends == [s[-1][1] for s in slots]
        assert res.peak_in_flight == peaks


def test_graph_refuses_lists_it_cannot_time():
    """schedule_graph checks nothing but what it cannot do without: a channel whose sends and receives differ in
    number (a message without its other side), and computes that wait for each other in a circle (a deadlock)."""
    lists = _lists(vpp=2, m=4)
    del lists[0][_index(lists[0], "send_act", 1, 3)]
    with pytest.raises(ScheduleError, match="Rank 0 sends rank 1 7 messages and rank 1 receives 8"):
        schedule_graph(lists, 2, 4)
    lists = _lists(pp=2, m=2)        # rank 0 sends its activations after its first backward, which waits for them
    sends = [a for a in lists[0] if a.op == "send_act"]
    lists[0] = [a for a in lists[0] if a.op != "send_act"]
    at = _index(lists[0], "backward", 0, 0) + 1
    lists[0][at:at] = sends
    with pytest.raises(ScheduleError, match="deadlocks"):
        simulate_actions(lists, 1, 2)
    with pytest.raises(ScheduleError, match="deadlocks: computes wait for each other in a circle"):
        schedule_graph(lists, 1, 2)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp", [12, 16, 24])
def test_lists_keep_the_contract_at_the_plans_pipeline_depths(kind, pp):
    """The planner times build_schedule's lists with schedule_graph and never runs the checker on them; at the pp its
    plans reach (12 to 24: BLOOM, GPT-3), vpp 1..3 and m = pp, not a multiple of pp (a group N > pp) and 2 pp + 1,
    check_actions accepts the lists, and every compute's start and end are the contract's timed event by event
    (_contract_timing), to the bit, at random per-chunk costs and at costs with an own embedding and head stage
    (chunk 0 of rank 0 and the last chunk of the last rank almost free); each rank's end of both tables timed in one
    pass (rank_ends) too."""
    rng = random.Random(pp)
    for vpp, ms in ((1, (pp, 2 * pp + 1)), (2, (pp, pp + pp // 2 + 1)), (3, (pp + pp // 2 + 1, 2 * pp + 1))):
        for m in ms:
            actions = [build_schedule(kind, pp, vpp, m, r) for r in range(pp)]
            schedules.check_actions(actions, vpp, m)
            graph = schedule_graph(actions, vpp, m)
            random_costs = ([[rng.uniform(0.05, 1.0) for _ in range(vpp)] for _ in range(pp)],
                            [[rng.uniform(0.05, 2.0) for _ in range(vpp)] for _ in range(pp)])
            own = [[[0.01 if (r, c) in ((0, 0), (pp - 1, vpp - 1)) else scale / vpp for c in range(vpp)]
                    for r in range(pp)] for scale in (1.0, 2.0)]
            tables = [random_costs, tuple(own)]
            for (forward, backward), ends in zip(tables, graph.rank_ends(tables)):
                slots, peaks = _contract_timing(actions, forward, backward)
                res = graph.simulate(actions, forward, backward)
                assert [[(s.start, s.end) for s in t] for t in res.timelines] == slots, (kind, pp, vpp, m)
                assert ends == [s[-1][1] for s in slots], (kind, pp, vpp, m)
                assert res.peak_in_flight == peaks, (kind, pp, vpp, m)


def test_graph_keeps_no_action_lists():
    """The planner caches schedule graphs (plan_meta._graph) and times them at costs only: nothing reachable from a
    ScheduleGraph is an Action (the lists of pp = 24, vpp = 3, m = 512 are 219k Actions: the graph and
    they hold 17.8 MB, the graph alone 7.1 MB); simulate takes the lists, which its SimResult keeps."""
    actions = _lists(pp=4, vpp=2, m=8)
    graph = schedule_graph(actions, 2, 8)
    seen, todo = set(), [graph]
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        assert not isinstance(o, Action), o
        todo += list(vars(o).values()) if hasattr(o, "__dict__") else list(o) if isinstance(o, (list, tuple)) else []
    assert graph.simulate(actions, 1.0, 2.0).actions is actions


def test_graph_of_a_batch_of_many_messages_stays_narrow():
    """A compute waits for at most one compute of each other rank (the latest: the rest end before it), so a valid
    list that posts all of a rank's sends in one batch (GPipe, rank 0's m activations after its last forward) keeps
    the graph's preds [n, pp] (they were [n, 1 + m]: 194 MB at pp = 4, m = 1024) and times it as the contract."""
    pp, m = 4, 64
    lists = _lists("gpipe", pp=pp, m=m)
    sends = [a for a in lists[0] if a.op == "send_act"]
    lists[0] = [a for a in lists[0] if a.op != "send_act"]
    at = _index(lists[0], "forward", 0, m - 1) + 1
    lists[0][at:at] = sends
    schedules.check_actions(lists, 1, m)
    graph = schedule_graph(lists, 1, m)
    assert graph.preds.shape[1] <= pp
    forward, backward = [[0.5 + 0.1 * r] for r in range(pp)], [[1.0 + 0.3 * r] for r in range(pp)]
    slots, _ = _contract_timing(lists, forward, backward)
    assert [[(s.start, s.end) for s in t] for t in graph.simulate(lists, forward, backward).timelines] == slots
