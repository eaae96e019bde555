"""Pipeline schedules as data, and a process-free simulator that checks and times them.

A schedule is a plain list of `Action`s per pipeline rank: compute (`forward`, `backward` of
one local model chunk on one microbatch) and point-to-point communication (`send_act`,
`recv_act`, `send_grad`, `recv_grad`). `build_schedule` writes the lists (GPipe, 1F1B,
interleaved 1F1B), the engine (pipeline.py) runs them verbatim, and `simulate` runs all ranks
together without processes to prove them deadlock-free and measure bubble and memory (`check_actions` runs
the lists under the contract; `schedule_graph` reads what waits for what off them, and its ScheduleGraph times
them at any costs).

Layout: pp ranks with vpp chunks each; chunk c on rank r is virtual stage vs = c*pp + r.
Virtual stage 0 reads its input from data; the last one computes the loss.

Execution contract (the engine does exactly this, the simulator models exactly this):
* a maximal run of consecutive communication actions is one batch (`comm_batches`): posted
  together with torch.distributed.batch_isend_irecv in list order, and waited for as a whole;
* messages from rank a to rank b share one channel: the k-th send a->b is the k-th receive on
  b from a, whatever its kind, so both sides agree on (act|grad, virtual stage, microbatch);
* pp=1 has no communication at all: the lists hold only forward/backward, and the engine hands
  chunk c's output to chunk c+1 (and chunk c+1's input gradient back to chunk c) in-process.

Communication placement, one rule for every schedule: a rank's computes form steps (one compute
each, except that interleaved 1F1B runs a steady (forward, backward) pair as one step). Between
consecutive steps S and T a rank posts one batch: the sends of S's outputs, then the receives
posted there, act before grad. A send completes only once the peer has posted its receive, so each
receive is posted in the batch that runs at the same time as its send: rank r runs forward i while
rank 0 runs forward i + r, and backward j while rank pp-1 runs backward j + pp-1-r (i, j: indices in
`forward_order`, `backward_order`), or just before the compute that needs it, if that comes first.
For a message between neighbouring ranks that is T's receive (Megatron's send_forward_recv_backward
/ send_backward_recv_forward for 1F1B, send_forward_backward_recv_forward_backward for interleaved
1F1B). The chunk-to-chunk hand-over with vpp > 1 (the last rank's activation to rank 0, rank 0's
gradient to the last rank) arrives N - pp steps before it is needed (N = `microbatch_group`, pp
when m is a multiple of pp) and waits in the receiver's buffer. With pp=2 both directions of a step
share one batch. Interleaved 1F1B needs whole pairs: with one batch per compute the ranks wait on
each other's sends (at pp=2 their messages no longer match). `simulate` checks all of this for any layout.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import NamedTuple, Union

import numpy as np

from .errors import ConfigError

Costs = Union[float, list]      # a compute's cost: one number for all, or a [pp][vpp] table (simulate_actions)

KINDS = ("gpipe", "1f1b")       # config.Schedule, the choice a run makes, is built from these
COMPUTE_OPS = ("forward", "backward")
_CODES = {op: i for i, op in enumerate(COMPUTE_OPS + ("send_act", "send_grad", "recv_act", "recv_grad"))}


@dataclass(frozen=True, slots=True)
class Action:
    """One step of a rank's schedule. `peer` is the partner pp rank of a send/receive, -1 for compute."""
    op: str          # "forward" | "backward" | "send_act" | "recv_act" | "send_grad" | "recv_grad"
    chunk: int       # local chunk index on this rank (0..vpp-1)
    microbatch: int
    peer: int = -1

    @property
    def is_comm(self) -> bool:
        return self.op not in COMPUTE_OPS

    def __str__(self) -> str:
        arrow = "" if not self.is_comm else (f"->{self.peer}" if self.op.startswith("send") else f"<-{self.peer}")
        return f"{self.op}(c{self.chunk}, mb{self.microbatch}){arrow}"


# ----------------------------------------------------------------------------- schedules

def check_schedule(kind: str, pp: int, vpp: int, num_microbatches: int) -> None:
    """Raise ConfigError with a one-paragraph message unless `kind` (a config.Schedule) can schedule
    this layout."""
    for name, value in (("pp", pp), ("vpp", vpp), ("num_microbatches", num_microbatches)):
        if value < 1:
            raise ConfigError(f"The pipeline schedule needs {name} >= 1, got {name}={value}.")
    if kind == "1f1b" and vpp > 1 and num_microbatches < pp:
        raise ConfigError(
            f"Interleaved 1F1B (pp={pp}, vpp={vpp}) sends microbatches through each model chunk in "
            f"groups of at least pp={pp}, so it needs at least {pp} microbatches per step (global batch "
            f"size / (micro batch size x dp)), but there are {num_microbatches}. Use {pp} or more "
            f"microbatches, or vpp=1, or schedule=gpipe.")


def microbatch_group(pp: int, num_microbatches: int) -> int:
    """N, how many microbatches go through a chunk before the next chunk takes them (Megatron's
    microbatch_group_size_per_vp_stage): the smallest N >= pp whose last group, m mod N, is empty or
    holds at least pp (a shorter one would wait for its own hand-over); m when m < pp. N = pp when m
    is a multiple of pp; with vpp > 1 it costs (vpp-1)(N-pp) more microbatches in flight on each rank."""
    m = num_microbatches
    return m if m < pp else next(n for n in range(pp, m + 1) if m % n == 0 or m % n >= pp)


def num_warmup(kind: str, pp: int, vpp: int, num_microbatches: int, rank: int) -> int:
    """How many forwards `rank` runs before its first backward."""
    total = num_microbatches * vpp
    if kind == "gpipe":
        return total
    if vpp == 1:
        return min(pp - rank - 1, num_microbatches)
    return min(2 * (pp - rank - 1) + (vpp - 1) * microbatch_group(pp, num_microbatches), total)


def forward_order(pp: int, vpp: int, num_microbatches: int) -> list[tuple[int, int]]:
    """(chunk, microbatch) in the order every rank runs its forwards, for all schedules.

    Groups of N = `microbatch_group` microbatches go through chunk 0, then chunk 1, ...; with vpp=1
    this is simply microbatch 0, 1, 2, ... A group of at least pp keeps the chunk-to-chunk hand-over
    (last rank to rank 0) ahead of where rank 0 needs it.
    """
    n = microbatch_group(pp, num_microbatches)
    return [(c, mb) for first in range(0, num_microbatches, n) for c in range(vpp)
            for mb in range(first, min(first + n, num_microbatches))]


def backward_order(pp: int, vpp: int, num_microbatches: int) -> list[tuple[int, int]]:
    """(chunk, microbatch) in the order every rank runs its backwards: as forward, chunks reversed."""
    return [(vpp - 1 - c, mb) for c, mb in forward_order(pp, vpp, num_microbatches)]


@functools.lru_cache(maxsize=4)
def _computes(pp: int, vpp: int, num_microbatches: int) -> tuple[tuple[Action, ...], tuple[Action, ...]]:
    """The forwards in `forward_order` and the backwards in `backward_order`: every rank's (built once for all)."""
    return (tuple(Action("forward", c, mb) for c, mb in forward_order(pp, vpp, num_microbatches)),
            tuple(Action("backward", c, mb) for c, mb in backward_order(pp, vpp, num_microbatches)))


def compute_steps(kind: str, pp: int, vpp: int, num_microbatches: int, rank: int) -> list[list[Action]]:
    """The forward/backward actions of `rank`, grouped into steps that share a communication batch.

    Order: warmup forwards, steady (forward, backward) pairs, cooldown backwards. Each compute is
    its own step, except that interleaved 1F1B runs a steady pair as one step (as Megatron does).
    """
    fwd, bwd = _computes(pp, vpp, num_microbatches)
    warmup = num_warmup(kind, pp, vpp, num_microbatches, rank)
    steady = [list(pair) for pair in zip(fwd[warmup:], bwd)]
    if kind == "gpipe" or vpp == 1:
        steady = [[a] for pair in steady for a in pair]
    return [[a] for a in fwd[:warmup]] + steady + [[a] for a in bwd[len(fwd) - warmup:]]


def _send_output(a: Action, pp: int, vpp: int, rank: int) -> list[Action]:
    """The send of compute `a`'s result to the neighbouring virtual stage (none at the ends, none for pp=1)."""
    vs = a.chunk * pp + rank
    if pp == 1 or (a.op == "forward" and vs == pp * vpp - 1) or (a.op == "backward" and vs == 0):
        return []
    if a.op == "forward":
        return [Action("send_act", a.chunk, a.microbatch, (rank + 1) % pp)]
    return [Action("send_grad", a.chunk, a.microbatch, (rank - 1) % pp)]


def _receive_input(a: Action, pp: int, vpp: int, rank: int) -> list[Action]:
    """The receive that compute `a` needs first (none at the ends, none for pp=1)."""
    vs = a.chunk * pp + rank
    if pp == 1 or (a.op == "forward" and vs == 0) or (a.op == "backward" and vs == pp * vpp - 1):
        return []
    if a.op == "forward":
        return [Action("recv_act", a.chunk, a.microbatch, (rank - 1) % pp)]
    return [Action("recv_grad", a.chunk, a.microbatch, (rank + 1) % pp)]


def _posted_receives(pp: int, vpp: int, num_microbatches: int, rank: int,
                     steps: list[list[Action]]) -> dict[int, list[Action]]:
    """{b: the receives `rank` posts in the batch after step b (b = -1: before the first step)}: each in
    the batch that runs with its send (the module docstring), act before grad."""
    index = step_of = {}
    if rank in (0, pp - 1):                 # (the ranks that receive a chunk-to-chunk hand-over)
        index = {a: i for order in _computes(pp, vpp, num_microbatches) for i, a in enumerate(order)}
        step_of = {(a.op, index[a]): t for t, step in enumerate(steps) for a in step}
    posted: dict[int, list[Action]] = {}
    for t, step in enumerate(steps):
        for a in step:
            for r in _receive_input(a, pp, vpp, rank):
                b = t - 1
                if (r.op, rank) in (("recv_act", 0), ("recv_grad", pp - 1)):   # a chunk-to-chunk hand-over
                    sender = Action(a.op, a.chunk - 1 if a.op == "forward" else a.chunk + 1, a.microbatch)
                    b = min(b, step_of.get((a.op, index[sender] + pp - 1), b))
                posted.setdefault(b, []).append(r)
    return {b: sorted(rs, key=lambda r: r.op != "recv_act") for b, rs in posted.items()}


def build_schedule(kind: str, pp: int, vpp: int, num_microbatches: int, rank: int) -> list[Action]:
    """The full action list of pipeline rank `rank` (see the module docstring for the contract).

    kind "gpipe": all forwards, then all backwards (orders: `forward_order`, `backward_order`).
    kind "1f1b": 1F1B for vpp=1, interleaved 1F1B (Narayanan et al. 2021) for vpp > 1.
    Both reach the bubble (pp-1)/(vpp*m) for every m >= pp.
    """
    check_schedule(kind, pp, vpp, num_microbatches)
    if not 0 <= rank < pp:
        raise ValueError(f"rank {rank} is not a pipeline rank of pp={pp}")
    steps = compute_steps(kind, pp, vpp, num_microbatches, rank)
    posted = _posted_receives(pp, vpp, num_microbatches, rank, steps)
    actions = posted.get(-1, [])
    for t, step in enumerate(steps):
        actions += step
        actions += [s for a in step for s in _send_output(a, pp, vpp, rank)]
        actions += posted.get(t, [])
    return actions


def comm_batches(actions: list[Action]) -> list[Union[Action, tuple[Action, ...]]]:
    """Split a rank's list into compute actions and batches (tuples) of consecutive communication."""
    steps: list[Union[Action, tuple[Action, ...]]] = []
    for a in actions:
        if a.is_comm and steps and isinstance(steps[-1], tuple):
            steps[-1] += (a,)
        else:
            steps.append((a,) if a.is_comm else a)
    return steps


# ----------------------------------------------------------------------------- simulator

class ScheduleError(RuntimeError):
    """A schedule that deadlocks, mismatches messages, or computes something out of order."""


class Slot(NamedTuple):
    """One compute action on a rank's timeline."""
    start: float
    end: float
    op: str
    chunk: int
    microbatch: int


@dataclass
class SimResult:
    """What `simulate` found. `actions[r]` is the list it validated: the order the engine must run on rank r."""
    actions: list[list[Action]]
    timelines: list[list[Slot]]      # per rank, compute slots in execution order
    peak_in_flight: list[int]        # per rank, max (chunk, mb) forwarded but not yet backwarded
    makespan: float
    busy: float                      # compute time of the busiest rank

    @property
    def bubble(self) -> float:
        """Idle time over compute time."""
        return (self.makespan - self.busy) / self.busy

    @property
    def ends(self) -> list[float]:
        """Per rank, when its last compute ends (its sends after it are free)."""
        return [timeline[-1].end for timeline in self.timelines]


def simulate(kind: str, pp: int, vpp: int, num_microbatches: int,
             forward_cost: Costs = 1.0, backward_cost: Costs = 2.0) -> SimResult:
    """Build every rank's schedule and run them together (see `simulate_actions`)."""
    actions = [build_schedule(kind, pp, vpp, num_microbatches, r) for r in range(pp)]
    return simulate_actions(actions, vpp, num_microbatches, forward_cost, backward_cost)


def simulate_actions(actions: list[list[Action]], vpp: int, num_microbatches: int,
                     forward_cost: Costs = 1.0, backward_cost: Costs = 2.0) -> SimResult:
    """Run the action lists of all pp = len(actions) ranks under the execution contract.

    A compute costs, per microbatch, forward_cost / vpp and backward_cost / vpp where they are numbers (every
    chunk alike), or forward_cost[r][c] and backward_cost[r][c] for chunk c of rank r where they are [pp][vpp]
    tables (stages of their own sizes); communication is free but rendezvous: a batch completes when each of its
    ops has met the peer's matching op. Raises ScheduleError on deadlock, a message mismatch, a bad peer, compute
    without its input, or a (chunk, microbatch) not run exactly once forward and once backward on every rank
    (check_actions), then times the lists' ScheduleGraph.
    """
    check_actions(actions, vpp, num_microbatches)
    return schedule_graph(actions, vpp, num_microbatches).simulate(actions, forward_cost, backward_cost)


def check_actions(actions: list[list[Action]], vpp: int, num_microbatches: int) -> None:
    """Run the lists under the execution contract in no time and raise ScheduleError where they break it (see
    `simulate_actions`)."""
    _Simulator(actions, vpp, num_microbatches).run()


def schedule_graph(actions: list[list[Action]], vpp: int, num_microbatches: int) -> ScheduleGraph:
    """What waits for what in these action lists (a ScheduleGraph: time it at any costs), read off the lists with
    array operations, without running them. Number rank r's computes 0, 1, ... in its order: a message between its
    computes i and i + 1 is posted after compute i (-1: before the first) and its batch is waited for by compute
    i + 1 (by none after the last). The k-th send from rank a to rank b meets b's k-th receive from a, so the compute
    that waits for one side's batch waits for the compute after which the other side was posted; besides its rank's
    previous compute, that is all a compute waits for. The lists must keep the contract (check_actions:
    build_schedule's do, as the tests check); a channel whose sends and receives differ in number, or computes that
    wait for each other in a circle (a deadlock), raise ScheduleError; nothing else is checked."""
    computes, peaks, messages, first = [], [], [], 0
    posts = {}       # (src, dst, is_send) -> that side's messages: (the compute before the post, the one after the
                     # batch), numbered over all ranks (rank r's i-th compute is first + i), -1: none
    for r, acts in enumerate(actions):
        op, chunk, mb, peer = (np.array(column, dtype=np.int64) for column in (       # (a list per field: the
            [_CODES[a.op] for a in acts], [a.chunk for a in acts],                       # fastest way in)
            [a.microbatch for a in acts], [a.peer for a in acts]))
        compute, send = op < _CODES["send_act"], (op >= _CODES["send_act"]) & (op < _CODES["recv_act"])
        receive, count = ~compute & ~send, int(compute.sum())
        before = np.cumsum(compute) - 1                   # per action, the rank's last compute before it (-1: none)
        for is_send, side in ((True, send), (False, receive)):
            for q in np.unique(peer[side]).tolist():
                i = before[side & (peer == q)]
                posts[(r, q, True) if is_send else (q, r, False)] = (
                    np.where(i >= 0, first + i, -1), np.where(i + 1 < count, first + i + 1, -1))
        peaks.append(int(np.cumsum(np.where(op[compute] == 0, 1, -1)).max(initial=0)))   # forwarded, not backwarded
        messages.append((int(send.sum()), int(receive.sum())))
        computes.append(np.column_stack([np.full(count, r), op[compute], chunk[compute], mb[compute]]))
        first += count
    waits = [np.zeros((0, 2), dtype=np.int64)]            # (waiter, waited for)
    for src, dst in {(src, dst) for src, dst, _ in posts}:
        none = (np.zeros(0, dtype=np.int64),) * 2
        (send_after, send_waiter), (recv_after, recv_waiter) = (posts.get((src, dst, s), none) for s in (True, False))
        if len(send_after) != len(recv_after):
            raise ScheduleError(f"Rank {src} sends rank {dst} {len(send_after)} messages and rank {dst} receives "
                                f"{len(recv_after)} (check_actions says which).")
        waits += [np.column_stack([recv_waiter, send_after]), np.column_stack([send_waiter, recv_after])]
    waits = np.concatenate(waits)
    return ScheduleGraph(vpp, num_microbatches, np.concatenate(computes), waits[(waits >= 0).all(axis=1)], peaks,
                         messages)


class ScheduleGraph:
    """What waits for what under the execution contract, whatever the costs. A rank posts a batch when the
    compute before it ends (at 0 when none does), and the batch completes when each peer has posted the
    matching side; so a compute starts when the last of its predecessors ends: the rank's previous compute, and
    for each message of the batch just before it, the compute after which the peer posted its side. Its end is
    that start + its cost: the longest path to it. The computes fall into levels (level 0 waits for none, level
    i + 1 for some of level i and none later), so timing the schedule at a set of costs is one numpy pass per
    level, not a simulation."""

    def __init__(self, vpp: int, m: int, computes: np.ndarray, waits: np.ndarray, peaks: list, messages: list):
        """computes: [n, 4] (rank, op index in COMPUTE_OPS, chunk, microbatch), rank after rank, each rank's in its
        order; waits: [e, 2] (a compute, one of another rank's that it waits for), numbered as in computes; peaks
        (SimResult.peak_in_flight) and messages (the sends and the receives) per rank, one entry per rank. It keeps
        no action list (the planner caches graphs; simulate takes the lists it was read off)."""
        self.pp, self.vpp, self.m, self.peak_in_flight, self.messages = len(peaks), vpp, m, peaks, messages
        rank, op, chunk, mb = computes.T
        n = len(computes)
        first = np.searchsorted(rank, np.arange(self.pp + 1))          # rank r's computes: first[r]:first[r + 1]
        local = np.arange(n) - first[rank]                             # each compute's place on its rank
        # of another rank's computes a compute waits for, the latest ends last (a rank's ends rise along its run):
        # keep it alone, so a compute has at most pp - 1 (a batch of many messages to one peer would widen preds)
        key = waits[:, 0] * self.pp + rank[waits[:, 1]]
        waits, key = waits[np.lexsort((waits[:, 1], key))], np.sort(key)
        last = np.ones(len(key), dtype=bool)                           # the last of each (waiter, rank)
        last[:-1] = key[1:] != key[:-1]
        waits = waits[last]                                            # (sorted by waiter)
        # preds: [n, 1 + the most a compute waits for on other ranks], its rank's previous compute first; n: none
        column = np.arange(len(waits)) - np.searchsorted(waits[:, 0], waits[:, 0])   # its place among its waiter's
        preds = np.full((n, 1 + column.max(initial=-1) + 1), n)
        preds[:, 0] = np.where(local > 0, np.arange(n) - 1, n)
        preds[waits[:, 0], 1 + column] = waits[:, 1]
        level = _levels(preds, first, local)
        # a compute's position: by level, each rank's computes still in its order; position n (none) ends at 0
        order = np.argsort(level, kind="stable")
        position = np.empty(n + 1, dtype=np.int64)
        position[order], position[-1] = np.arange(n), n
        self.preds = position[preds[order]]                        # [computes, 1 + width], by position
        bounds = np.cumsum(np.bincount(level)).tolist()
        self.levels = list(zip([0, *bounds[:-1]], bounds))        # the positions of each level, a range
        self.cost_index = ((op * self.pp + rank) * vpp + chunk)[order]    # into a cost_table, flattened
        self.op, self.chunk, self.microbatch = op[order], chunk[order], mb[order]
        self.runs = [position[a:b] for a, b in zip(first[:-1], first[1:])]   # per rank, in its order

    def cost_table(self, forward: Costs, backward: Costs) -> np.ndarray:
        """[2, pp, vpp]: per microbatch, each chunk's forward and backward cost (simulate_actions' rule)."""
        tables = []
        for c in (forward, backward):
            try:
                t = np.full((self.pp, self.vpp), c / self.vpp) if np.ndim(c) == 0 else np.asarray(c, dtype=float)
            except ValueError:
                t = None
            if t is None or t.shape != (self.pp, self.vpp):
                raise ValueError(f"per-chunk costs must be [pp={self.pp}][vpp={self.vpp}] tables")
            tables.append(t)
        return np.stack(tables)

    def ends(self, costs: np.ndarray) -> np.ndarray:
        """The end of every compute (by position, then the padding's 0) at a cost_table, or at K of them stacked
        ([K, 2, pp, vpp] -> [n + 1, K]: one pass for all, each column the numbers it has alone): the longest paths to
        them, level by level; a compute starts at ends[self.preds].max(axis=1)."""
        cost = np.moveaxis(costs.reshape(*costs.shape[:-3], -1)[..., self.cost_index], -1, 0)    # [n] or [n, K]
        end = np.zeros((len(cost) + 1, *cost.shape[1:]))
        for a, b in self.levels:
            end[a:b] = end[self.preds[a:b]].max(axis=1) + cost[a:b]
        return end

    def rank_ends(self, tables: list) -> list[list[float]]:
        """For each (forward, backward) of `tables`, per rank, when its last compute ends (SimResult.ends): all in
        one pass over the levels."""
        end = self.ends(np.stack([self.cost_table(forward, backward) for forward, backward in tables]))
        return end[[run[-1] for run in self.runs]].T.tolist()

    def simulate(self, actions: list, forward: Costs, backward: Costs) -> SimResult:
        """The SimResult of the schedule at these costs; `actions`, the lists the graph was read off, become its
        actions."""
        costs = self.cost_table(forward, backward)
        end = self.ends(costs)
        start = end[self.preds].max(axis=1)
        timelines = [[Slot(float(start[k]), float(end[k]), COMPUTE_OPS[self.op[k]], int(self.chunk[k]),
                           int(self.microbatch[k])) for k in run] for run in self.runs]
        busy = max(self.m * sum(f + b for f, b in zip(fs, bs)) for fs, bs in zip(*costs.tolist()))   # busiest rank
        return SimResult(actions, timelines, self.peak_in_flight, float(end.max()), busy)


def _levels(preds: np.ndarray, first: np.ndarray, local: np.ndarray) -> np.ndarray:
    """Each compute's level, the most computes on a chain of waits before it (preds as in ScheduleGraph.__init__,
    rank r's computes first[r]:first[r + 1], local their places on it), by longest-path updates in sweeps over the
    ranks, 0 to pp - 1 and back: a rank's levels become 1 + the largest of each compute's predecessors' (none's:
    -1), then level_i >= level_(i-1) + 1 along its run at once (a running maximum of level_i - i). From each run's
    0, 1, 2, ... the levels only rise and never pass the longest chain, so they stop on it when a sweep changes
    nothing: after a few sweeps for build_schedule's lists, whose chains run down the ranks and back (fill, drain).
    Computes that wait for each other in a circle rise without end: ScheduleError once a level passes n."""
    n, pp = len(preds), len(first) - 1
    level = np.append(local, -1)                                      # (level[n]: none's)
    changed = True
    while changed:
        changed = False
        for r in [*range(pp), *reversed(range(pp))]:
            a, b = first[r], first[r + 1]
            lifted = level[preds[a:b, 0]]
            for column in preds[a:b, 1:].T:
                np.maximum(lifted, level[column], out=lifted)
            lifted += 1 - local[a:b]
            np.maximum.accumulate(lifted, out=lifted)
            lifted += local[a:b]
            if not np.array_equal(lifted, level[a:b]):
                level[a:b], changed = lifted, True
        if level.max() >= n:
            raise ScheduleError("Schedule deadlocks: computes wait for each other in a circle (check_actions "
                                "says where).")
    return level[:n]


@dataclass
class _RankState:
    pos: int = 0                     # index of the next step (compute action or batch)
    posted: bool = False             # whether the current batch was posted
    inputs: set = field(default_factory=set)       # (kind, vs, mb) received or handed over locally
    forwarded: set = field(default_factory=set)    # (chunk, mb)
    backwarded: set = field(default_factory=set)


class _Simulator:
    """Runs the action lists of all ranks under the execution contract, in no time, and checks them."""

    def __init__(self, actions, vpp, m):
        self.actions, self.pp, self.vpp, self.m = actions, len(actions), vpp, m
        self.ranks = [_RankState() for _ in actions]
        self.steps = [[s if isinstance(s, Action) else [self._message(a, r) for a in s]
                       for s in comm_batches(acts)] for r, acts in enumerate(actions)]
        self._number_messages()
        self.posted = {}             # (channel, k, is_send) -> (message, rank)
        self.matched = set()         # (channel, k) of the messages whose two sides were posted

    def fail(self, rank: int, action: Action, why: str):
        raise ScheduleError(f"rank {rank}, {action}: {why}")

    def _message(self, a: Action, rank: int) -> dict:
        """Channel and identity of a send/receive; checks that it names the right peer."""
        if a.op not in ("send_act", "recv_act", "send_grad", "recv_grad"):
            self.fail(rank, a, "unknown op")
        vs, is_send = a.chunk * self.pp + rank, a.op.startswith("send")
        kind, step = ("act", 1) if a.op.endswith("act") else ("grad", -1)
        peer_vs = vs + step if is_send else vs - step
        if self.pp == 1 or not 0 <= peer_vs < self.pp * self.vpp:
            self.fail(rank, a, f"virtual stage {vs} has no neighbour to exchange {kind} with")
        if a.peer != peer_vs % self.pp:
            self.fail(rank, a, f"virtual stage {peer_vs} lives on rank {peer_vs % self.pp}, not {a.peer}")
        channel = (rank, a.peer) if is_send else (a.peer, rank)
        return {"action": a, "channel": channel, "is_send": is_send,
                "key": (kind, peer_vs if is_send else vs, a.microbatch)}

    def _number_messages(self):
        """Give each send/receive its position k on its channel (the k-th message src->dst)."""
        for rank_steps in self.steps:
            count = {}
            for msg in (m for s in rank_steps if isinstance(s, list) for m in s):
                msg["k"] = count.get(msg["channel"], 0)
                count[msg["channel"]] = msg["k"] + 1

    def run(self) -> None:
        progress = True
        while progress:
            progress = any([self._advance(r) for r in range(self.pp)])
        stuck = [r for r in range(self.pp) if self.ranks[r].pos < len(self.steps[r])]
        if stuck:
            raise ScheduleError("Schedule deadlocks: " + "; ".join(self._waiting(r) for r in stuck) + ".")
        for r, st in enumerate(self.ranks):
            for name, done in (("forward", st.forwarded), ("backward", st.backwarded)):
                if len(done) != self.vpp * self.m:
                    raise ScheduleError(f"rank {r} runs {len(done)} of its {self.vpp * self.m} "
                                        f"(chunk, microbatch) {name}s")

    def _advance(self, r: int) -> bool:
        """Run rank r as far as it can go; True if it moved."""
        st, moved = self.ranks[r], False
        while st.pos < len(self.steps[r]):
            step = self.steps[r][st.pos]
            if isinstance(step, Action):
                self._compute(r, step)
            else:
                if not st.posted:
                    self._post(r, step)
                    moved = True
                if not all((m["channel"], m["k"]) in self.matched for m in step):
                    return moved
                st.posted = False
            st.pos += 1
            moved = True
        return moved

    def _compute(self, r: int, a: Action):
        st, vs, mb = self.ranks[r], a.chunk * self.pp + r, a.microbatch
        if not (0 <= a.chunk < self.vpp and 0 <= mb < self.m):
            self.fail(r, a, "no such chunk or microbatch")
        forward = a.op == "forward"
        done = st.forwarded if forward else st.backwarded
        if (a.chunk, mb) in done:
            self.fail(r, a, "runs twice")
        if not forward and (a.chunk, mb) not in st.forwarded:
            self.fail(r, a, "backward before its forward")
        from_data_or_loss = vs == 0 if forward else vs == self.pp * self.vpp - 1
        if not from_data_or_loss and ("act" if forward else "grad", vs, mb) not in st.inputs:
            self.fail(r, a, f"its input {'act' if forward else 'grad'} was not received")
        done.add((a.chunk, mb))
        if self.pp == 1:             # the next (previous) chunk is local: hand the result over in-process
            st.inputs.add(("act", vs + 1, mb) if forward else ("grad", vs - 1, mb))

    def _post(self, r: int, batch: list[dict]):
        st = self.ranks[r]
        st.posted = True
        for msg in batch:
            a = msg["action"]
            if msg["is_send"] and (a.chunk, a.microbatch) not in (
                    st.forwarded if a.op == "send_act" else st.backwarded):
                self.fail(r, a, "sends a result that was not computed yet")
            mine = self.posted[msg["channel"], msg["k"], msg["is_send"]] = (msg, r)
            other = self.posted.get((msg["channel"], msg["k"], not msg["is_send"]))
            if other is not None:
                self._match(*((mine, other) if msg["is_send"] else (other, mine)))

    def _match(self, send, recv):
        (s, src), (d, dst) = send, recv
        if s["key"] != d["key"]:
            raise ScheduleError(
                f"Message #{s['k']} from rank {src} to rank {dst} does not match: rank {src} sends "
                f"{s['action']} = {s['key'][0]} for virtual stage {s['key'][1]}, microbatch {s['key'][2]}, "
                f"but rank {dst} receives it as {d['action']} = {d['key'][0]} for virtual stage "
                f"{d['key'][1]}, microbatch {d['key'][2]}.")
        self.ranks[dst].inputs.add(d["key"])
        self.matched.add((s["channel"], s["k"]))

    def _waiting(self, r: int) -> str:
        step = self.steps[r][self.ranks[r].pos]
        ops = ", ".join(f"{m['action']}" + ("" if (m["channel"], m["k"]) in self.matched else " (unmatched)")
                        for m in step)
        return f"rank {r} waits in batch [{ops}]"
