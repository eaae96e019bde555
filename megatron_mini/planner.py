"""The layout planner: which (tp, pp, vpp, dp, ZeRO, recompute, sp, embedding_stage) for this model on
this cluster. `layouts` enumerates every layout validate() accepts (and counts why the others are
refused); `estimate` predicts each one's memory per rank and step time from what plan_meta.py measures
with the project's own code on the meta device; `plan` ranks those that fit.

Predicted step time (a model, stated so it can be argued with): per pipeline rank,
    compute   = FLOPs / (peak TFLOP/s x efficiency)
    tp, pp    = TP/SP collectives and pipeline sends, on the critical path, over the link they use
                (ring all-reduce 2(n-1)/n B/bw, all-gather / reduce-scatter (n-1)/n B/bw, p2p B/bw;
                sends and receives overlap, so half the pipeline traffic counts). A collective that a
                column-parallel linear's backward runs beside a GEMM (dx's all-reduce beside dW's; with
                sp the input gathered again beside dx's, dx's reduce-scatter beside dW's) counts only for
                the time it outlasts that GEMM at the compute rate above. A lower bound of what is
                exposed: on a GPU the collective's kernels take SMs from the GEMM (Megatron runs with
                CUDA_DEVICE_MAX_CONNECTIONS=1 so that they are scheduled first)
    pipeline  = the rank's end: the schedule simulated with each stage's own costs, from the first forward to
                the rank's last compute (schedules.ScheduleGraph; Planner.pipeline_ends): a microbatch through
                chunk c of rank r costs the chunk's FLOPs at the compute rate plus the rank's (tp + pp) / (m vpp),
                a third of it forward, two thirds backward; an embedding or head stage of its own, nearly idle,
                then delays the fill and the drain by its own little time, and a heavy stage sets the pace of
                the steady state
    bubble    = step - (compute + tp + pp + dp + emb) of the heaviest rank, the one with the most of them (no step
                is shorter than its work): what the pipeline adds to it. With equal stages, the busy time
                (compute + tp + pp) x the schedule's idle ratio, (p - 1) / (m vpp) for 1F1B, as Megatron counts it
    dp        = the DP reduction beyond the last microbatch's backward, which it overlaps (less, when the
                DP group is inside a node and so shares NVLink with TP, the TP time that backward hides
                behind its GEMMs: the link carries one at a time), plus ZeRO-1's
                weight all-gather beyond the first microbatch's forward, which it overlaps (each layer
                waits only for its own weights; the first layer's are exposed, not counted here, and with
                compile at tp = 1 a chunk's blocks are one graph that waits for all their weights at once)
    emb       = the embedding-group sum, the norm and loss all-reduces (exposed)
    step      = the largest pipeline + dp + emb of a pipeline rank (one rank of each stage shape is measured and
                speaks for the ranks of that shape: Planner.stage_speakers), told as the heaviest rank's compute,
                tp, pp, dp and emb, and the bubble, which add up to it (step_breakdown).
                A group's link is the node's (NVLink) when each of its groups lies in one node, else the
                network: with rank = tp_rank + tp (dp_rank + dp pp_rank), a group spanning S consecutive
                ranks starts at a multiple of S, so all lie in one node iff S divides gpus_per_node (or the
                cluster is one node). TP stays in a node: tp must divide gpus_per_node.
"""
from __future__ import annotations

import dataclasses
import gc
import importlib
import itertools
import math
import multiprocessing
import os
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

import torch

from .config import ConfigError, TrainConfig, validate
from .hardware import GPUS, table_peak
from .pipeline import partition_for
from .plan_meta import Planner, RankFacts, measure_layer

GiB = 2 ** 30


@dataclass
class ClusterConfig:
    """The machines: a GPU of hardware.GPUS, how many, how many per node, the links (GB/s per GPU, one
    direction) inside a node and between nodes, and the fraction of the dense peak the matmuls reach."""
    name: str = "a100-80gb"
    gpu: str = "a100-80gb"
    gpus: int = 8
    gpus_per_node: int = 8
    intra_node_gbps: float = 300.0
    inter_node_gbps: float = 25.0
    efficiency: float = 0.5
    memory_gib: float = 0.0          # 0: the GPU's
    reserve_gib: float = 3.0         # what a layout may not use: the driver's share (an "80 GB" A100 offers
                                     # 79.3 GiB), the CUDA context, NCCL's buffers, the allocator's slack

    @property
    def capacity_gib(self) -> float:
        """Memory per GPU a layout may fill: memory_gib (or the GPU's) less reserve_gib."""
        return (self.memory_gib or GPUS[self.gpu].memory_gib) - self.reserve_gib

    def check(self) -> None:
        """One ConfigError for a value that cannot describe a cluster."""
        for f in dataclasses.fields(self):      # nan passes every comparison below, inf fits everything
            if isinstance(f.default, float) and not math.isfinite(getattr(self, f.name)):
                raise ConfigError(f"cluster.{f.name}={getattr(self, f.name)} must be a finite number.")
        if self.gpu not in GPUS:
            raise ConfigError(f"cluster.gpu={self.gpu!r}: choose one of {', '.join(GPUS)} (megatron_mini/hardware.py).")
        for key in ("gpus", "gpus_per_node", "intra_node_gbps", "inter_node_gbps", "efficiency"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"cluster.{key}={getattr(self, key)} must be > 0.")
        if self.efficiency > 1:
            raise ConfigError(f"cluster.efficiency={self.efficiency} must be in (0, 1].")
        if self.memory_gib < 0:
            raise ConfigError(f"cluster.memory_gib={self.memory_gib} must be >= 0 (0: the GPU's).")
        if self.reserve_gib < 0 or self.capacity_gib <= 0:
            raise ConfigError(f"cluster.reserve_gib={self.reserve_gib} must be >= 0 and below the GPU's memory.")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ConfigError(f"cluster.gpus={self.gpus} is not a whole number of nodes of {self.gpus_per_node}.")


@dataclass
class PlanConfig(TrainConfig):
    """A run's config (model, batch, precision, ...) and the cluster to lay it out on."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="plan_config", node=PlanConfig)


# ----------------------------------------------------------------------------- the layouts
@dataclass
class Estimate:
    """One layout's predicted memory and step time (see the module doc)."""
    cfg: TrainConfig
    dp: int
    ranks: list                     # RankFacts of one pipeline rank per stage shape (Planner.stage_speakers)
    heaviest: int                   # the pp rank whose work bounds the step (step_breakdown)
    bubble: float                   # the bubble over that rank's busy time (compute + tp + pp)
    times: dict                     # seconds per step: that rank's compute, tp, pp, dp, emb, and the bubble
    step_s: float
    memory_gib: float               # the largest rank's total
    fits: bool
    mfu: float                      # model FLOPs per second per GPU over the dense peak

    @property
    def worst(self) -> RankFacts:
        return max(self.ranks, key=lambda r: sum(r.memory.values()))

    @property
    def tokens_per_s(self) -> float:
        return self.cfg.gbs * self.cfg.model.seq_len / self.step_s

    def layout_args(self) -> str:
        c = self.cfg
        args = [f"tp={c.tp}", f"pp={c.pp}"]
        args += [f"vpp={c.vpp}"] if c.vpp > 1 else []
        args += ["sp=true"] if c.sp else []
        args += [f"zero={c.zero}"] if c.zero else []
        args += [f"recompute={c.recompute}"] if c.recompute != "none" else []
        args += [f"embedding_stage={c.embedding_stage}"] if c.embedding_stage != "none" else []
        args += [f"schedule={c.schedule}"] if c.schedule != "1f1b" else []
        args += [f"pipeline_first_blocks={c.pipeline_first_blocks}"] if c.pipeline_first_blocks else []
        args += [f"pipeline_last_blocks={c.pipeline_last_blocks}"] if c.pipeline_last_blocks else []
        return " ".join(args)


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(base: PlanConfig) -> tuple[list, Counter]:
    """Every layout of base's model on base.cluster that validate() accepts, and the reasons the others
    were refused (counted): tp whose groups lie in a node (in_node), pp, vpp (up to 8), dp = gpus / (tp pp),
    ZeRO when dp > 1, recompute, sp when tp > 1, and each embedding_stage where it changes the split."""
    c, valid, refused = base.cluster, [], Counter()
    for tp in _divisors(c.gpus):
        if not in_node(c, tp):
            refused["tp not dividing the GPUs of a node (TP across nodes)"] += 1
            continue
        for pp in _divisors(c.gpus // tp):
            dp = c.gpus // (tp * pp)
            for vpp in range(1, 9) if pp > 1 else (1,):
                splits = set()
                for stage in ("none", "layer", "own"):
                    layout = dataclasses.replace(base, tp=tp, pp=pp, vpp=vpp, embedding_stage=stage, sp=False,
                                                 zero=0, recompute="none", pipeline_first_blocks=0,
                                                 pipeline_last_blocks=0)
                    try:
                        validate(layout, c.gpus)
                    except ConfigError as e:
                        refused[_reason(str(e))] += 1
                        continue
                    split = tuple(partition_for(layout))
                    if split in splits:
                        continue                 # the same split as another embedding_stage
                    splits.add(split)
                    for zero in (0, 1) if dp > 1 else (0,):
                        for recompute in ("none", "selective", "full"):
                            for sp in (False, True) if tp > 1 else (False,):
                                cfg = dataclasses.replace(layout, zero=zero, recompute=recompute, sp=sp)
                                try:
                                    validate(cfg, c.gpus)
                                    valid.append(cfg)
                                except ConfigError as e:
                                    refused[_reason(str(e))] += 1
    return valid, refused


_REASONS = [("rampup_batch_size=", "a rampup_batch_size batch not divisible by mbs x dp, or of too few microbatches"),
            ("not divisible by tp", "a width (heads, vocabulary) not divisible by tp"),
            ("Cannot split the model evenly", "the blocks do not split evenly over pp x vpp stages"),
            ("Interleaved 1F1B", "interleaving needs at least pp microbatches"),
            ("is not divisible by mbs x dp", "gbs not divisible by mbs x dp"),
            ("Sequence parallelism needs", "the sequence not divisible by tp (sp)"),
            ("embedding_stage=own needs", "own embedding/head stages need pp x vpp >= 3")]


def _reason(message: str) -> str:
    return next((short for key, short in _REASONS if key in message), message.split(":")[0][:80])


# ----------------------------------------------------------------------------- predicting a step
def _collective_s(op: str, nbytes: float, n: int, gbps: float) -> float:
    """Seconds of one ring collective over n ranks moving `nbytes` as the ledger counts them."""
    if op == "all_reduce":
        return 2 * (n - 1) / n * nbytes / (gbps * 1e9)
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n * nbytes / (gbps * 1e9)
    return nbytes / (gbps * 1e9)                            # send / recv


def in_node(cluster: ClusterConfig, span: int) -> bool:
    """Whether every group of `span` consecutive global ranks, starting at a multiple of span, lies in one
    node: span divides gpus_per_node, or the cluster is one node."""
    return cluster.gpus <= cluster.gpus_per_node or cluster.gpus_per_node % span == 0


def _link_gbps(cluster: ClusterConfig, span: int) -> float:
    """The link of groups spanning `span` consecutive global ranks: NVLink when they lie in a node."""
    return cluster.intra_node_gbps if in_node(cluster, span) else cluster.inter_node_gbps


def _comm_s(cfg: TrainConfig, cluster: ClusterConfig, dp: int, rank: RankFacts, flops_per_s: float) -> dict:
    """Seconds per step of each group's exposed traffic, by the span of ranks the group covers: the rank's
    ledger, less, for each collective run beside a GEMM, the part of it that the GEMM's time hides (that
    part under "hidden:<group>"). ZeRO-1's weight all-gather (the DP group's only all-gather) is apart,
    under "zero"."""
    spans = {"tp": cfg.tp, "dp": cfg.tp * dp, "pp": cfg.tp * dp * cfg.pp, "emb": cfg.tp * dp * cfg.pp,
             "mp": cfg.tp * dp * cfg.pp, "world": cfg.tp * dp * cfg.pp}
    sizes = {"tp": cfg.tp, "dp": dp, "pp": 2, "emb": 2, "mp": cfg.tp * cfg.pp, "world": cfg.tp * dp * cfg.pp}

    def seconds(group: str, op: str, nbytes: float) -> float:
        return _collective_s(op, nbytes, sizes[group], _link_gbps(cluster, spans[group]))
    out = Counter()
    for (group, op), (calls, nbytes) in rank.ledger.items():
        out["zero" if (group, op) == ("dp", "all_gather") else group] += seconds(group, op, nbytes)
    for (group, op, nbytes, flops), calls in rank.overlaps.items():
        hidden = calls * min(seconds(group, op, nbytes), flops / flops_per_s)
        out[group] -= hidden
        out[f"hidden:{group}"] += hidden
    return out


def estimate(planner: Planner, cfg: TrainConfig, cluster: ClusterConfig) -> Estimate:
    """Memory of the largest rank and the predicted step time of cfg's layout (see the module doc)."""
    return estimates(planner, [cfg], cluster)[0]


def estimates(planner: Planner, cfgs: list, cluster: ClusterConfig) -> list:
    """[estimate(planner, cfg, cluster) for cfg in cfgs], with the pipelines of each run of layouts of one schedule
    (kind, pp, vpp, m) timed together: the run's ranks and costs measured first, then its pipelines at all their
    costs in one pass (Planner.time_pipelines: a pass costs about as much for ten tables as for one), then the steps.
    """
    def schedule(cfg: TrainConfig) -> tuple:
        return cfg.schedule, cfg.pp, cfg.vpp, cfg.num_microbatches(cluster.gpus // (cfg.tp * cfg.pp))
    found = []
    for _, run in itertools.groupby(cfgs, key=schedule):
        run = [(cfg, _measure(planner, cfg, cluster)) for cfg in run]
        planner.time_pipelines([(cfg, x.m, x.forward, x.backward) for cfg, x in run])
        found += [_finish(planner, cfg, cluster, x) for cfg, x in run]
    return found


@dataclass
class _Measured:
    """What a layout's estimate measures before its pipeline is timed."""
    dp: int
    m: int                          # microbatches per step
    peak: float                     # FLOP/s at the cluster's efficiency
    speakers: list                  # per pp rank, the rank that speaks for it (Planner.stage_speakers)
    ranks: list                     # RankFacts of the speakers
    terms: dict                     # per speaker, its compute, tp, pp, dp and emb seconds per step
    forward: list                   # [pp][vpp] seconds of a microbatch through each chunk, forward and backward
    backward: list


def _measure(planner: Planner, cfg: TrainConfig, cluster: ClusterConfig) -> _Measured:
    """cfg's ranks, their terms and its chunks' costs (see the module doc)."""
    dp = cluster.gpus // (cfg.tp * cfg.pp)
    dense = table_peak(cluster.gpu, cfg.precision.dtype, cfg.precision.tf32, cfg.precision.peak_tflops)  # as MFU's
    peak = dense * 1e12 * cluster.efficiency
    m = cfg.num_microbatches(dp)
    speakers = planner.stage_speakers(cfg, dp)
    ranks = [planner.measure_rank(cfg, dp, r) for r in sorted(set(speakers))]
    terms, chunk_s = {}, {}
    for rank in ranks:
        comm = _comm_s(cfg, cluster, dp, rank, peak)
        pp = comm["pp"] / 2                                            # sends and receives overlap (duplex)
        last_backward = (2 / 3) * rank.microbatch_flops / peak         # what the DP reduction overlaps with
        if in_node(cluster, cfg.tp * dp):                              # ... on the link the TP overlaps use
            last_backward = max(last_backward - comm["hidden:tp"] / m, 0.0)
        first_forward = (1 / 3) * rank.microbatch_flops / peak         # ... and ZeRO-1's weight all-gather
        terms[rank.pp_rank] = {"compute": rank.flops / peak, "tp": comm["tp"], "pp": pp,
                               "dp": max(comm["dp"] - last_backward, 0.0) + max(comm["zero"] - first_forward, 0.0),
                               "emb": comm["emb"] + comm["mp"] + comm["world"]}
        chunk_s[rank.pp_rank] = [f / peak + (comm["tp"] + pp) / (m * cfg.vpp) for f in rank.chunk_flops]
    costs = [chunk_s[r] for r in speakers]                             # per microbatch, by pp rank and chunk
    return _Measured(dp, m, peak, speakers, ranks, terms, [[c / 3 for c in row] for row in costs],
                     [[2 * c / 3 for c in row] for row in costs])


def _finish(planner: Planner, cfg: TrainConfig, cluster: ClusterConfig, x: _Measured) -> Estimate:
    """cfg's estimate from what _measure found and its pipeline's ends (see the module doc)."""
    ends = planner.pipeline_ends(cfg, x.m, x.forward, x.backward)
    heaviest, times = step_breakdown(ends, [x.terms[r] for r in x.speakers])
    bubble = times["bubble"] / (times["compute"] + times["tp"] + times["pp"])
    memory = max(sum(r.memory.values()) for r in x.ranks) / GiB
    step = sum(times.values())
    flops = cfg.model.flops_per_token() * cfg.gbs * cfg.model.seq_len              # per step
    mfu = flops / step / cluster.gpus / (x.peak / cluster.efficiency)
    return Estimate(cfg, x.dp, x.ranks, heaviest, bubble, times, step, memory, memory <= cluster.capacity_gib, mfu)


def step_breakdown(ends: list, terms: list) -> tuple[int, dict]:
    """The step of a pipeline whose rank r ends its last compute at ends[r] (the simulated pipeline, from the first
    forward) and has its own terms[r] = {compute, tp, pp, dp, emb} (seconds per step), told as the heaviest rank
    sees it: step = max over r of ends[r] + dp[r] + emb[r]; the heaviest rank h is the one whose own work
    compute + tp + pp + dp + emb is the largest (the rank that bounds the step: no step is shorter), and
    bubble = step - h's work, the time the pipeline adds to it. Returns (h, h's terms and the bubble), which add up
    to the step. With equal stages the bubble is the busy time (compute + tp + pp) x the schedule's idle ratio,
    (p - 1) / (m v) for 1F1B; a light stage of its own (an embedding or head stage) adds only its own little time
    to the fill and the drain."""
    step = max(end + t["dp"] + t["emb"] for end, t in zip(ends, terms))
    heaviest = max(range(len(terms)), key=lambda r: sum(terms[r][k] for k in ("compute", "tp", "pp", "dp", "emb")))
    t = terms[heaviest]
    bubble = max(step - (t["compute"] + t["tp"] + t["pp"] + t["dp"] + t["emb"]), 0.0)    # (>= 0 but for rounding)
    return heaviest, {"compute": t["compute"], "tp": t["tp"], "pp": t["pp"], "bubble": bubble, "dp": t["dp"],
                      "emb": t["emb"]}


# ----------------------------------------------------------------------------- the whole plan
@dataclass
class Plan:
    base: PlanConfig
    estimates: list                 # Estimate of every valid layout, fastest first among those that fit
    refused: Counter                # why the other layouts were not valid, counted
    planner: Planner                # with what it measured (to estimate more layouts cheaply)

    @property
    def fitting(self) -> list:
        return [e for e in self.estimates if e.fits]


def plan(base: PlanConfig, workers: int | None = None) -> Plan:
    """Estimate every valid layout of base's model on base.cluster; those that fit first, by step time.
    With many layouts the work (a meta forward of each layer kind, a meta build of each distinct rank)
    is shared among `workers` processes (default: the CPU count, up to 8)."""
    base.cluster.check()
    planner = Planner()
    valid, refused = layouts(base)
    workers = min(workers or os.cpu_count() or 1, 8, max(len(valid) // 16, 1))
    if workers == 1:
        found = estimates(planner, valid, base.cluster)
    else:
        method = start_method()
        if method == "fork":   # autograd's first backward imports torch._dynamo (1.1 s of CPU): once, not per worker
            importlib.import_module("torch._dynamo")
        context = multiprocessing.get_context(method)
        with ProcessPoolExecutor(workers, mp_context=context, initializer=gc.disable) as pool:   # short-lived
            found = _in_processes(pool, planner, valid, base.cluster, workers)
    found.sort(key=lambda e: (not e.fits, e.step_s))
    return Plan(base, found, refused, planner)


def start_method() -> str:
    """How plan() starts its workers. fork, the quickest, only on a CPU-only Linux machine and from a process of one
    thread (the OS's count: Python's and torch's threads, such as the OpenMP pool `import torch` starts unless
    OMP_NUM_THREADS=1): a child forked from a process of several (a notebook's kernel, pytest-xdist's worker) may
    wait forever on a lock that another thread held at the fork, of which Python 3.12+ warns. Where a GPU is
    visible autograd's first backward starts a thread per device, after which torch refuses autograd in a forked
    child (seen on an H100 in pytest). Elsewhere forkserver: children forked from a server process of one thread;
    spawn where there is no forkserver (Windows). A Linux without /proc (a bare chroot) cannot count: forkserver."""
    if sys.platform == "linux" and not torch.cuda.is_available() and _os_threads() == 1:
        return "fork"
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def _os_threads() -> int | None:
    """The threads of this process as Linux counts them, None where /proc is not mounted."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return None


def _in_processes(pool: ProcessPoolExecutor, planner: Planner, cfgs: list, cluster: ClusterConfig,
                  workers: int) -> list:
    """[estimate(cfg) for cfg in cfgs] in the pool's processes: first the layer kinds (dealt out), then the
    layouts (in shares of about equal work); the layers measured come back into `planner`."""
    jobs = list({key: job for cfg in cfgs for _, key, job in planner.layer_jobs(cfg)
                 if key not in planner.layers}.items())
    for measured in pool.map(_measure_layers, [jobs[w::workers] for w in range(workers)]):
        planner.layers.update(measured)
    shares = _shares(cfgs, workers)
    parts = pool.map(_estimates, [planner.layers] * workers, [[cfgs[i] for i in share] for share in shares],
                     [cluster] * workers)
    by_index = {i: e for share, part in zip(shares, parts) for i, e in zip(share, part)}
    return [by_index[i] for i in range(len(cfgs))]


def _measure_layers(jobs: list) -> dict:
    return {key: measure_layer(*job) for key, job in jobs}


def _estimates(layers: dict, cfgs: list, cluster: ClusterConfig) -> list:
    """Estimates of `cfgs` by a Planner that knows `layers` (a worker's share of plan())."""
    return estimates(Planner(layers), cfgs, cluster)


def _shares(cfgs: list, workers: int) -> list:
    """Indices of cfgs in `workers` shares of about equal work: layouts of one (tp, pp, vpp) share their schedule's
    dependency graph (the microbatch count is the global batch over dp = gpus / (tp pp)), and those that differ only
    in ZeRO, recompute and sp their rank builds, so they stay together; a group costs its blocks per rank."""
    groups = {}
    for i, c in enumerate(cfgs):
        groups.setdefault((c.tp, c.pp, c.vpp), []).append(i)
    def cost(members: list) -> float:                # rank builds (one per split and ZeRO setting) of ~ L / pp blocks
        c = cfgs[members[0]]
        return len({(cfgs[i].embedding_stage, cfgs[i].zero) for i in members}) * (1 + c.model.num_layers / c.pp)
    shares, load = [[] for _ in range(workers)], [0.0] * workers
    for members in sorted(groups.values(), key=cost, reverse=True):     # longest first, to the least loaded
        w = load.index(min(load))
        shares[w] += members
        load[w] += cost(members)
    return shares


def model_bytes(base: TrainConfig, planner: Planner | None = None) -> dict:
    """The whole model's weights (in the run's dtype) and its fp32 master weights and Adam moments, as
    the optimizer allocates them on one rank holding everything (what a checkpoint of the run stores)."""
    one = dataclasses.replace(base, tp=1, pp=1, vpp=1, sp=False, zero=0, embedding_stage="none",
                              pipeline_first_blocks=0, pipeline_last_blocks=0)
    memory = (planner or Planner()).rank_state(one, 1, 0)[0]
    return {"weights": memory["weights"], "optimizer": memory["optimizer"]}
