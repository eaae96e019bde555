"""The layout planner: which (tp, pp, vpp, dp, ZeRO, recompute, sp, embedding_stage) for this model on
this cluster. Every figure comes from the project's own code, run on the meta device (shapes and
dtypes, no data) with a virtual mesh (groups that record their calls and move nothing):

- memory per rank: a `Trainer` of that rank is built on meta; its `Optimizer.memory_bytes()` gives
  the weights, fp32 main grads and optimizer state (ZeRO-1 shards, bucket padding) the run reports;
  activations are the bytes autograd saves (meter.SavedTensorMeter) over one forward of each of the
  rank's model chunks, summed over the microbatches in flight at the peak of the rank's schedule;
- communication: the ledger (comm.py) of one forward + backward of each chunk, times the microbatches,
  plus the step's pipeline sends (the schedule's actions, the engine's message shape), DP reduction,
  embedding-group sum, gradient-norm and loss all-reduces, recorded by running those very calls;
- bubble: schedules.simulate (idle time is the same for any m >= 2 pp, so it runs at that m);
- FLOPs: torch's FLOP counter over the same forward + backward (recomputation included).

Predicted step time (a model, stated so it can be argued with): per pipeline rank,
    compute   = FLOPs / (peak TFLOP/s x efficiency)
    tp, pp    = TP/SP collectives and pipeline sends, on the critical path, over the link they use
                (ring all-reduce 2(n-1)/n B/bw, all-gather / reduce-scatter (n-1)/n B/bw, p2p B/bw)
    bubble    = (compute + tp + pp) x the simulated idle/busy ratio
    dp, emb   = the DP reduction (overlapped with the last microbatch's backward: what exceeds it),
                the ZeRO-1 parameter all-gather and the embedding-group sum (exposed)
    step      = the slowest rank's sum. A group's link is the node's (NVLink) when all its ranks share a
                node (rank = tp_rank + tp (dp_rank + dp pp_rank), gpus_per_node per node), else the network.
Attention is measured as the fused (flash) kernel saves it, as on a GPU; the Triton kernels are not planned.
"""
from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from unittest import mock
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from .comm import Ledger
from .config import ConfigError, TrainConfig, validate
from .hardware import GPUS, math_dtype
from .mesh import ParallelMesh
from .meter import SavedTensorMeter
from .model import ParallelContext, build_chunks
from .pipeline import local_stage_layers, partition_for
from .rng import RNGTracker
from .schedules import build_schedule, simulate
from .training import DTYPES, build_rank, reduce_loss

META = torch.device("meta")
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


@dataclass
class PlanConfig(TrainConfig):
    """A run's config (model, batch, precision, ...) and the cluster to lay it out on."""
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


def register_configs() -> None:
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="plan_config", node=PlanConfig)


# ----------------------------------------------------------------------------- measuring on meta
_sdpa = F.scaled_dot_product_attention


def _fused_on_meta(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
    """On meta, F.scaled_dot_product_attention runs its math fallback, which saves the [s, s] weights;
    a GPU runs a fused kernel that saves o and the log-sum-exp: that kernel's op has a meta version."""
    if q.device.type == "meta" and attn_mask is None:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal)[0]
    return _sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)


@dataclass
class Facts:
    """One microbatch through one layer or chunk (forward + backward), on one rank; additive."""
    activation_bytes: int = 0         # saved for backward after the forward
    flops: float = 0.0                # forward + backward (+ recomputation)
    ledger: dict = field(default_factory=dict)     # {(group, op): (calls, bytes)}

    def __add__(self, other: "Facts") -> "Facts":
        return Facts(self.activation_bytes + other.activation_bytes, self.flops + other.flops,
                     _merged(self.ledger, other.ledger))

    def __sub__(self, other: "Facts") -> "Facts":
        return Facts(self.activation_bytes - other.activation_bytes, self.flops - other.flops,
                     _merged(self.ledger, other.ledger, -1))


def _merged(a: dict, b: dict, sign: int = 1) -> dict:
    """The sum (or difference) of two ledgers {(group, op): (calls, bytes)}, without empty entries."""
    out = {k: (a.get(k, (0, 0))[0] + sign * b.get(k, (0, 0))[0], a.get(k, (0, 0))[1] + sign * b.get(k, (0, 0))[1])
           for k in a.keys() | b.keys()}
    return {k: v for k, v in out.items() if v != (0, 0)}


@dataclass
class RankFacts:
    """What one pipeline rank holds and moves in one training step."""
    pp_rank: int
    memory: dict                      # weights, grads, optimizer (bytes); activations (at the peak)
    in_flight: int                    # (chunk, microbatch) pairs alive at the activation peak
    flops: float                      # per step
    ledger: dict                      # per step {(group, op): (calls, bytes)}
    microbatch_flops: float           # one microbatch through the rank's chunks


@functools.lru_cache(maxsize=256)
def _schedule(kind: str, pp: int, vpp: int, m: int, rank: int) -> list:
    return build_schedule(kind, pp, vpp, m, rank)


class Planner:
    """Measures layouts on meta, caching what several layouts share: each layer's facts per (model, tp,
    sp, recompute, dtype, mbs), each rank's buffers per (model, tp, pp, vpp, embedding_stage, dp, ZeRO,
    dtype), each schedule's idle time per (kind, pp, vpp)."""

    def __init__(self):
        self._layers, self._chunks, self._ranks, self._idle = {}, {}, {}, {}

    def layer_facts(self, cfg: TrainConfig) -> dict:
        """Facts of one microbatch on TP rank 0 of cfg's layout: "embedding", "head", "first" (a block that
        starts a chunk: no pending residual) and "block" (one after another block, which also hands it
        the residual it has not added yet), measured as two blocks minus one."""
        def facts(name, layers, recompute):
            key = (name, cfg.tp, cfg.sp, recompute, cfg.precision.dtype, cfg.mbs, dataclasses.astuple(cfg.model))
            if key not in self._layers:
                mesh = ParallelMesh(cfg.tp, 1, 1, ledger=Ledger(), virtual_rank=0)
                self._layers[key] = self._measure(dataclasses.replace(cfg, recompute=recompute), mesh, layers)
            return self._layers[key]
        L = cfg.model.num_layers
        out = {"embedding": facts("embedding", (0, 1), "none"), "head": facts("head", (L + 1, L + 2), "none"),
               "first": facts("first", (1, 2), cfg.recompute)}
        out["block"] = facts("two", (1, 3), cfg.recompute) - out["first"] if L > 1 else out["first"]
        return out

    @staticmethod
    def _measure(cfg: TrainConfig, mesh: ParallelMesh, layers: tuple) -> Facts:
        """One microbatch forward + backward, on meta, of a chunk holding the layers [first, end)."""
        dtype = DTYPES[cfg.precision.dtype]
        with torch.random.fork_rng(devices=[]):
            ctx = ParallelContext(mesh.tp_group, RNGTracker(cfg.seed, 0, 0, META), cfg.sp, cfg.recompute)
            (chunk,) = build_chunks(cfg.model, ctx, [layers], cfg.seed, META)
        chunk.to(dtype).train()
        tokens = torch.zeros(cfg.mbs, cfg.model.seq_len, dtype=torch.long, device=META)
        s = cfg.model.seq_len // (cfg.tp if cfg.sp else 1)
        x = tokens if chunk.has_embedding else \
            torch.empty(s, cfg.mbs, cfg.model.hidden_size, dtype=dtype, device=META, requires_grad=True)
        meter = SavedTensorMeter(exclude=chunk.parameters())
        mesh.ledger.reset()
        with mock.patch.object(F, "scaled_dot_product_attention", _fused_on_meta), \
                FlopCounterMode(display=False) as flops:     # (patched: recompute calls it again in backward)
            with meter.hooks():
                out = chunk(x, tokens if chunk.has_head else None)
            saved = meter.live
            out.backward() if chunk.has_head else out.backward(torch.empty_like(out))
        return Facts(saved, flops.get_total_flops(), mesh.ledger.summary())

    def rank_state(self, cfg: TrainConfig, dp: int, pp_rank: int) -> tuple:
        """(memory bytes, the step's collectives with sequence parallelism, without) of a rank, from its
        GradBuffers and Optimizer built on meta (recompute and the schedule change neither)."""
        model_key = (cfg.tp, cfg.pp, cfg.vpp, cfg.embedding_stage, cfg.pipeline_first_blocks, cfg.pipeline_last_blocks,
                     dp, cfg.precision.dtype, pp_rank, dataclasses.astuple(cfg.model))
        key = model_key + (cfg.zero,)
        if key not in self._ranks:
            layout = dataclasses.replace(cfg, sp=cfg.tp > 1, recompute="none", kernels="torch", compile=False)
            mesh = ParallelMesh(cfg.tp, cfg.pp, dp, ledger=Ledger(), virtual_rank=cfg.tp * dp * pp_rank)
            with torch.random.fork_rng(devices=[]):
                chunks, buffers, optimizer = build_rank(layout, mesh, RNGTracker(cfg.seed, 0, 0, META), META,
                                                        self._chunks.get(model_key))
            self._chunks[model_key] = chunks
            mesh.ledger.reset()
            for buf in buffers:                       # the once-per-step collectives, by running them
                buf.finish_grad_sync()
            optimizer.finalize_grads()
            optimizer.reduce_norm_stats(torch.zeros(2, device=META))
            for buf in buffers:
                buf.all_gather_params()
            reduce_loss(mesh, torch.zeros((), device=META), False, META)
            with_sp = mesh.ledger.summary()
            without_sp = {k: v for k, v in with_sp.items() if k != ("tp", "all_reduce")}   # the SP-parameter sum
            self._ranks[key] = optimizer.memory_bytes(), with_sp, without_sp
        return self._ranks[key]

    def measure_rank(self, cfg: TrainConfig, dp: int, pp_rank: int) -> RankFacts:
        """One training step of pipeline rank `pp_rank` of cfg's layout (TP rank 0, DP rank 0)."""
        memory, with_sp, without_sp = self.rank_state(cfg, dp, pp_rank)
        layers, L = self.layer_facts(cfg), cfg.model.num_layers
        def kind(i: int, first: int) -> str:
            return "embedding" if i == 0 else "head" if i == L + 1 else "first" if i == max(first, 1) else "block"
        chunks = [sum((layers[kind(i, a)] for i in range(a, b)), Facts()) for a, b in local_stage_layers(cfg, pp_rank)]
        act_bytes = (cfg.model.seq_len // (cfg.tp if cfg.sp else 1)) * cfg.mbs * cfg.model.hidden_size \
            * DTYPES[cfg.precision.dtype].itemsize               # the engine's p2p message (its act_shape)
        sends = Counter()
        live = peak = peak_pairs = pairs = 0
        for a in _schedule(cfg.schedule, cfg.pp, cfg.vpp, cfg.num_microbatches(dp), pp_rank):
            if a.op == "forward":                                   # the actions in the engine's order
                live, pairs = live + chunks[a.chunk].activation_bytes, pairs + 1
                if live > peak:
                    peak, peak_pairs = live, pairs
            elif a.op == "backward":
                live, pairs = live - chunks[a.chunk].activation_bytes, pairs - 1
            else:
                sends[a.op.split("_")[0]] += 1
        m = cfg.num_microbatches(dp)                                # each chunk runs every microbatch once
        ledger = {key: (m * calls, m * nbytes) for key, (calls, nbytes) in sum(chunks, Facts()).ledger.items()}
        ledger = _merged(ledger, {("pp", op): (n, n * act_bytes) for op, n in sends.items()})
        ledger = _merged(ledger, with_sp if cfg.sp else without_sp)
        flops = sum(c.flops for c in chunks)
        return RankFacts(pp_rank, {**memory, "activations": peak}, peak_pairs, m * flops, ledger, flops)

    def bubble(self, cfg: TrainConfig, m: int) -> float:
        """The simulator's idle / busy time of cfg's schedule for m microbatches: its idle time is the
        same for every m >= 2 pp, so it is simulated at that m (or at m when smaller)."""
        small = min(m, 2 * cfg.pp)
        key = (cfg.schedule, cfg.pp, cfg.vpp, small)
        if key not in self._idle:
            sim = simulate(cfg.schedule, cfg.pp, cfg.vpp, small)
            self._idle[key] = (sim.makespan - sim.busy) * small / sim.busy     # idle, in microbatches of work
        return self._idle[key] / m


# ----------------------------------------------------------------------------- the layouts
@dataclass
class Estimate:
    """One layout's predicted memory and step time (see the module doc)."""
    cfg: TrainConfig
    dp: int
    ranks: list                     # RankFacts of the distinct pipeline ranks (first, second, last)
    bubble: float                   # idle / busy of the schedule
    times: dict                     # seconds per step of the slowest rank: compute, tp, pp, bubble, dp, emb
    step_s: float
    memory_gib: float               # the largest rank's total
    fits: bool

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
        return " ".join(args)


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(base: PlanConfig) -> tuple[list, Counter]:
    """Every layout of base's model on base.cluster that validate() accepts, and the reasons the others
    were refused (counted): tp within a node, pp, vpp (up to 8), dp = gpus / (tp pp), ZeRO when dp > 1,
    recompute, sp when tp > 1, and each embedding_stage where it changes the split."""
    c, valid, refused = base.cluster, [], Counter()
    for tp in _divisors(c.gpus):
        if tp > c.gpus_per_node:
            refused["tp larger than a node"] += 1
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


_REASONS = [("not divisible by tp", "a width (heads, MLP, vocabulary) not divisible by tp"),
            ("Cannot split the model evenly", "the blocks do not split evenly over pp x vpp stages"),
            ("Interleaved 1F1B", "interleaving needs the microbatches to be a multiple of pp"),
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


def _link_gbps(cluster: ClusterConfig, span: int) -> float:
    """Ranks within `span` consecutive global ranks share a node when span <= gpus_per_node (aligned)."""
    return cluster.intra_node_gbps if span <= cluster.gpus_per_node else cluster.inter_node_gbps


def _comm_s(cfg: TrainConfig, cluster: ClusterConfig, dp: int, ledger: dict) -> dict:
    """Seconds per step of each group's traffic, by the span of ranks the group covers."""
    spans = {"tp": cfg.tp, "dp": cfg.tp * dp, "pp": cfg.tp * dp * cfg.pp, "emb": cfg.tp * dp * cfg.pp,
             "mp": cfg.tp * dp * cfg.pp, "world": cfg.tp * dp * cfg.pp}
    sizes = {"tp": cfg.tp, "dp": dp, "pp": 2, "emb": 2, "mp": cfg.tp * cfg.pp, "world": cfg.tp * dp * cfg.pp}
    out = Counter()
    for (group, op), (calls, nbytes) in ledger.items():
        out[group] += _collective_s(op, nbytes, sizes[group], _link_gbps(cluster, spans[group]))
    return out


def estimate(planner: Planner, cfg: TrainConfig, cluster: ClusterConfig) -> Estimate:
    """Memory of the largest rank and the predicted step time of cfg's layout (see the module doc)."""
    dp = cluster.gpus // (cfg.tp * cfg.pp)
    gpu = GPUS[cluster.gpu]
    peak = gpu.tflops[math_dtype(cfg.precision.dtype, cfg.precision.tf32)] * 1e12 * cluster.efficiency
    m = cfg.num_microbatches(dp)
    bubble = planner.bubble(cfg, m)
    ranks = [planner.measure_rank(cfg, dp, r) for r in sorted({0, min(1, cfg.pp - 1), cfg.pp - 1})]
    times = None
    for rank in ranks:
        comm = _comm_s(cfg, cluster, dp, rank.ledger)
        compute = rank.flops / peak
        pipe = compute + comm["tp"] + max(comm["pp"] / 2, 0.0)       # sends and receives overlap (duplex)
        last_backward = (2 / 3) * rank.microbatch_flops / peak         # what the DP reduction overlaps with
        t = {"compute": compute, "tp": comm["tp"], "pp": comm["pp"] / 2, "bubble": pipe * bubble,
             "dp": max(comm["dp"] - last_backward, 0.0), "emb": comm["emb"] + comm["mp"] + comm["world"]}
        if times is None or sum(t.values()) > sum(times.values()):
            times = t
    capacity = cluster.memory_gib or gpu.memory_gib
    memory = max(sum(r.memory.values()) for r in ranks) / GiB
    return Estimate(cfg, dp, ranks, bubble, times, sum(times.values()), memory, memory <= capacity)


# ----------------------------------------------------------------------------- the whole plan
@dataclass
class Plan:
    base: PlanConfig
    estimates: list                 # Estimate of every valid layout, fastest first among those that fit
    refused: Counter                # why the other layouts were not valid, counted

    @property
    def fitting(self) -> list:
        return [e for e in self.estimates if e.fits]


def plan(base: PlanConfig, planner: Planner | None = None) -> Plan:
    """Estimate every valid layout of base's model on base.cluster; those that fit first, by step time."""
    planner = planner or Planner()
    valid, refused = layouts(base)
    estimates = [estimate(planner, cfg, base.cluster) for cfg in valid]
    estimates.sort(key=lambda e: (not e.fits, e.step_s))
    return Plan(base, estimates, refused)


def model_bytes(base: TrainConfig, planner: Planner | None = None) -> dict:
    """The whole model's weights (in the run's dtype) and its fp32 master weights and Adam moments, as
    the optimizer allocates them on one rank holding everything (what a checkpoint of the run stores)."""
    one = dataclasses.replace(base, tp=1, pp=1, vpp=1, sp=False, zero=0, embedding_stage="none",
                              pipeline_first_blocks=0, pipeline_last_blocks=0)
    memory = (planner or Planner()).rank_state(one, 1, 0)[0]
    return {"weights": memory["weights"], "optimizer": memory["optimizer"]}
