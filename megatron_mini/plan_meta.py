"""Measuring one rank of a layout on the meta device (shapes and dtypes, no data), with a virtual mesh
(groups that record their calls and move nothing), by the project's own code: planner.py's figures.

- memory: the rank's chunks, GradBuffers and Optimizer built as training builds them (rank.build_rank);
  Optimizer.memory_bytes() gives the weights, fp32 main grads and optimizer state the run reports;
- activations: the bytes autograd saves (meter.SavedTensorMeter) over one forward of each layer kind,
  summed over the (chunk, microbatch) pairs in flight at the peak of the rank's schedule;
- backward: what one layer's forward and backward allocate on top of what it saves (meter.AllocationMeter: the
  gradients of the logits, the fp32 rows the word embedding's lookup adds into its main grad, a checkpoint's
  recomputed forward), at each backward of the rank's schedule on top of the saved tensors then in flight
  (_backward_extra: a block's or the head's with all of them held, the embedding's once its chunk's blocks have
  freed that microbatch's), less the activation peak, at the largest (no weight's gradient waits from one layer's
  backward to another's: each goes into its fp32 main grad, the tied word embedding's from both its uses);
- communication: the ledger (comm.py) of one forward + backward of each layer kind, times the
  microbatches, plus the schedule's pipeline sends of the engine's message shape and the once-per-step
  collectives (DP reduction, SP-parameter and embedding-group sums, norm, ZeRO gather, loss), recorded
  by running those very calls; and which of them a layer's backward runs beside a GEMM, of how many FLOPs
  (Ledger.overlaps);
- FLOPs: ModelConfig.layer_flops_per_token (the formula of the console's MFU; recomputation included);
- pipeline time: the schedule's dependency graph (schedules.ScheduleGraph) over all m microbatches timed at each
  chunk's own forward and backward costs (Planner.pipeline_ends).
Attention is measured as a fused (flash) kernel saves it (math_attention: on the CPU with dropout, as SDPA's
math path), and a dropout as a GPU's fused kernel saves its mask, in 1 byte (bool_dropout_masks: on the CPU in the
activations' dtype); the Triton kernels are planned as the torch ones.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
from collections import Counter
from dataclasses import dataclass, field
from unittest import mock

import numpy as np
import torch
import torch.nn.functional as F

from . import tensor_parallel
from .comm import Ledger
from .config import TrainConfig
from .data_parallel import GradBuffer
from .mesh import ParallelMesh
from .meter import AllocationMeter, SavedTensorMeter
from .model import ParallelContext, build_chunks, select_triton_ops, tp_ranks_may_round_apart
from .partition import blocks_in
from .pipeline import local_stage_layers
from .rank import DTYPES, build_rank, reduce_loss
from .rng import RNGTracker
from .schedules import ScheduleGraph, build_schedule, schedule_graph

META = torch.device("meta")


_sdpa = F.scaled_dot_product_attention


def _fused_on_meta(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
    """On meta, F.scaled_dot_product_attention runs its math fallback, which saves the [s, s] weights;
    a GPU runs a fused kernel that saves o and the log-sum-exp: that kernel's op has a meta version."""
    if q.device.type == "meta" and attn_mask is None:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal)[0]
    return _sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kwargs)


_dropout = F.dropout


def _fused_dropout_on_meta(input, p=0.5, training=True, inplace=False):
    """On meta (as on the CPU), F.dropout runs its composite, input x a mask of input's dtype, and saves that mask;
    on a GPU it runs native_dropout, which saves a bool mask: that op has a meta version."""
    if input.device.type == "meta" and training and 0 < p < 1 and not inplace:
        return torch.native_dropout(input, p, True)[0]
    return _dropout(input, p, training, inplace)


def _gemm_into_fp32_on_meta(out, a, b):
    """A GPU's one GEMM of 16-bit a, b into fp32 `out` (tensor_parallel's "addmm" way), on meta: it allocates
    nothing, as the GPU's does, and a meta tensor has no values to write, so nothing runs. (Its FLOPs are
    ModelConfig.layer_flops_per_token's, not counted here. No meta op stands in for it on every supported torch:
    mm takes out_dtype on meta from 2.10, and addmm with out_dtype raises on 2.11's, its decomposition taking
    out_dtype for beta.)"""


@dataclass
class Facts:
    """One microbatch through one layer or chunk (forward + backward), on one rank; additive."""
    activation_bytes: int = 0         # saved for backward after the forward
    flops: float = 0.0                # forward + backward (+ recomputation)
    ledger: dict = field(default_factory=dict)     # {(group, op): (calls, bytes)}
    overlaps: dict = field(default_factory=dict)   # {(group, op, bytes, FLOPs of the GEMM beside it): calls}
    backward_bytes: int = 0           # allocated on top of the saved tensors in one layer's forward + backward
                                      # (layers run one at a time: the largest, not a sum)

    def __add__(self, other: "Facts") -> "Facts":
        overlaps = Counter(self.overlaps) + Counter(other.overlaps)            # (drops zero counts)
        return Facts(self.activation_bytes + other.activation_bytes, self.flops + other.flops,
                     _merged(self.ledger, other.ledger), dict(sorted(overlaps.items())),
                     max(self.backward_bytes, other.backward_bytes))

    def __mul__(self, n: int) -> "Facts":
        return Facts(n * self.activation_bytes, n * self.flops,
                     {k: (n * c, n * b) for k, (c, b) in self.ledger.items()},
                     {k: n * c for k, c in self.overlaps.items() if n}, self.backward_bytes if n else 0)


def _merged(a: dict, b: dict) -> dict:
    """The sum of two ledgers {(group, op): (calls, bytes)}, without empty entries (a layer counted 0 times),
    in key order (a set's order follows the string hash, which differs between processes, and so would
    the order of the float sums over the ledger: spawned planner workers would differ in the last bit)."""
    zero = (0, 0)
    out = {k: (a.get(k, zero)[0] + b.get(k, zero)[0], a.get(k, zero)[1] + b.get(k, zero)[1])
           for k in sorted(a.keys() | b.keys())}
    return {k: v for k, v in out.items() if v != zero}


@dataclass
class RankFacts:
    """What one pipeline rank holds and moves in one training step."""
    pp_rank: int
    memory: dict                      # weights, grads, optimizer (bytes); activations (at the peak); backward
    in_flight: int                    # (chunk, microbatch) pairs alive at the activation peak
    flops: float                      # per step
    ledger: dict                      # per step {(group, op): (calls, bytes)}
    chunk_flops: tuple                # one microbatch through each of the rank's chunks
    overlaps: dict = field(default_factory=dict)   # per step: those of the ledger's calls run beside a GEMM

    @property
    def microbatch_flops(self) -> float:
        """One microbatch through the rank's chunks (the DP overlap window)."""
        return sum(self.chunk_flops)


@functools.lru_cache(maxsize=1)
def _graph(kind: str, pp: int, vpp: int, m: int) -> ScheduleGraph:
    """The dependency graph of every pipeline rank's build_schedule list (schedules.schedule_graph: the lists keep the
    execution contract, which tests/test_schedules checks), read by _schedule_shape and Planner.time_pipelines; the
    latest kept (planner.estimates takes the layouts of one schedule together)."""
    return schedule_graph([build_schedule(kind, pp, vpp, m, r) for r in range(pp)], vpp, m)


@functools.lru_cache(maxsize=256)
def _schedule_shape(kind: str, pp: int, vpp: int, m: int, rank: int) -> tuple:
    """(the distinct vectors of in-flight microbatches per chunk right after each forward of the rank's
    schedule; the distinct (chunk, such a vector) right before each backward, its own microbatch counted; both in
    the order they first occur; the pipeline sends and receives counted by direction): the activation peak of any
    per-chunk sizes is the largest dot product with one of the first vectors, the backward's peaks those with
    the second. With step[i, c] = +1 where compute i is a forward of chunk c, -1 a backward, the vectors are the
    rows of live = cumsum(step) (after each compute), and live - step before it."""
    graph = _graph(kind, pp, vpp, m)
    run = graph.runs[rank]                                     # the rank's computes in the engine's order
    forward, chunk = graph.op[run] == 0, graph.chunk[run]
    step = np.where(forward, 1, -1)[:, None] * (chunk[:, None] == np.arange(vpp))        # [computes, vpp]
    live = np.cumsum(step, axis=0)
    vectors = _first_rows(live[forward])
    backwards = _first_rows(np.column_stack([chunk, live - step])[~forward])
    sends = {op: n for op, n in zip(("send", "recv"), graph.messages[rank]) if n}
    return [tuple(v) for v in vectors], [(c, tuple(v)) for c, *v in backwards], sends


def _first_rows(a: np.ndarray) -> list:
    """The distinct rows of the 2-d array a in the order they first occur, as lists."""
    _, first = np.unique(a, axis=0, return_index=True)
    return a[np.sort(first)].tolist()


def bool_dropout_masks(cfg: TrainConfig) -> bool:
    """Whether cfg's dropouts save 1-byte masks: off the CPU (ATen's dropout takes the fused native_dropout on a GPU);
    on the CPU each saves its mask in the activations' dtype."""
    return cfg.device != "cpu" and cfg.model.dropout > 0


def math_attention(cfg: TrainConfig) -> bool:
    """Whether cfg's attention runs SDPA's math path, which saves the [s, s] weights and dropout mask: on
    the CPU with dropout (torch's CPU flash kernel takes none), unless the Triton flash attention runs.
    Elsewhere it is planned as a fused kernel."""
    cpu = torch.device("cpu")
    return cfg.device == "cpu" and cfg.model.dropout > 0 and \
        not select_triton_ops(cfg.kernels, cfg.model, cpu, cfg.tp, cfg.precision.dtype, cfg.mbs).attention


@contextlib.contextmanager
def _older_objects_frozen():
    """Within, the objects made before are set aside from the garbage collector (gc.freeze), so that a
    gc.collect() walks only what was made since: 2 ms, where a full pass over a process that imported torch
    took 0.17 s. Left as it is where something froze objects already (training, after its first step)."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def measure_layer(cfg: TrainConfig, layers: tuple, residual: bool) -> Facts:
    """Facts (bytes saved for backward, bytes allocated on top of them, ledger, overlaps; no FLOPs) of one
    microbatch forward + backward of the layer `layers[0]`, on meta, its gradients going into fp32 main grads as
    in training (a GPU's GEMM adds the weights' into them); a block or the head gets a pending residual r when
    `residual` (as every block but a chunk's first, and the head after a block). The CPU stream is restored after
    (recomputation sets it; the GPUs' are not touched)."""
    sdpa = _sdpa if math_attention(cfg) else _fused_on_meta
    with _older_objects_frozen(), torch.random.fork_rng(devices=[]), \
            mock.patch.object(F, "scaled_dot_product_attention", sdpa), \
            mock.patch.object(F, "dropout", _fused_dropout_on_meta if bool_dropout_masks(cfg) else _dropout), \
            mock.patch.object(tensor_parallel, "gemm_into_fp32", lambda device, dtype: "addmm"), \
            mock.patch.dict(tensor_parallel.GEMM_INTO_FP32, addmm=_gemm_into_fp32_on_meta), \
            mock.patch.object(tensor_parallel, "_ones_row", tensor_parallel._ones_row.__wrapped__):   # (uncached:
        # what a process measured before does not change what it measures)
        mesh = ParallelMesh(cfg.tp, 1, 1, ledger=Ledger(), virtual_rank=0)
        dtype = DTYPES[cfg.precision.dtype]
        ctx = ParallelContext(mesh.tp_group, RNGTracker(cfg.seed, 0, META), cfg.sp, cfg.recompute)
        (chunk,) = build_chunks(cfg.model, ctx, [layers], cfg.seed, META)
        layer = chunk.layers[0]
        # (kept for its hooks, which move each gradient into a main grad; at dp = 1, never synced, its buckets
        # change nothing measured)
        buffer = GradBuffer(list(chunk.named_global_parameters()), mesh, dtype, zero=False,  # noqa: F841
                            bucket_numel=cfg.ddp_bucket_numel)
        tokens = torch.zeros(cfg.mbs, cfg.model.seq_len, dtype=torch.long, device=META)

        def activation():
            s = cfg.model.seq_len // (cfg.tp if cfg.sp else 1)
            return torch.empty(s, cfg.mbs, cfg.model.hidden_size, dtype=dtype, device=META, requires_grad=True)
        args = (tokens,) if chunk.has_embedding else \
            (activation(), tokens, activation() if residual else None) if chunk.has_head else \
            (activation(), activation() if residual else None)
        meter, allocated = SavedTensorMeter(exclude=chunk.parameters()), AllocationMeter()
        with meter.hooks(), allocated:
            out = layer(*args)
        saved = meter.live
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if o is not None]
        gc.collect()              # (what the forward left in reference cycles: counted alike with the collector off)
        with allocated:
            torch.autograd.backward(outs, [torch.empty_like(o) for o in outs])     # (recompute calls sdpa again)
    return Facts(saved, 0.0, mesh.ledger.summary(), mesh.ledger.overlaps(), max(allocated.peak - saved, 0))


def _chunk_facts(cfg: TrainConfig, layers: dict, stages: list) -> list:
    """Facts of one microbatch through each chunk [a, b) of `stages`, from Planner.layer_facts: embedding,
    blocks (the first, the rest), head."""
    end = cfg.model.num_layers + 2
    return [layers["embedding"] * (a == 0) + layers["first"] * (n > 0) + layers["block"] * max(n - 1, 0)
            + layers["head"] * (b == end) for a, b in stages for n in [blocks_in(cfg.model.num_layers, a, b)]]


def _backward_extra(cfg: TrainConfig, layers: dict, stages: list, chunks: list) -> list:
    """Per chunk [a, b) of `stages` (`chunks`: their Facts), what its backward allocates on top of the saved tensors
    alive when it starts (every (chunk, microbatch) in flight, its own microbatch included): the head's, which runs
    with all of those held; the largest of its blocks', which run once the head (if the chunk has it) has freed
    what this microbatch saved for it; the embedding's, which runs last, once the chunk's blocks have freed what
    this microbatch saved for them (the fp32 rows it adds into the word embedding's main grad on top of the others
    in flight: an own embedding stage, or the first chunk's after its blocks)."""
    L, emb, head = cfg.model.num_layers, layers["embedding"], layers["head"]
    out = []
    for (a, b), chunk in zip(stages, chunks):
        n, freed = blocks_in(L, a, b), head.activation_bytes * (b == L + 2)
        extra = max([layers["first"].backward_bytes - freed] * (n > 0)
                    + [layers["block"].backward_bytes - freed] * (n > 1) + [head.backward_bytes] * (b == L + 2) + [0])
        if a == 0:
            extra = max(extra, emb.activation_bytes + emb.backward_bytes - chunk.activation_bytes)
        out.append(extra)
    return out


class Planner:
    """Measures layouts on meta, caching what several layouts share: each layer's facts per (model, tp,
    sp, recompute, dtype, mbs), each rank's buffers per (model, tp, pp, vpp, embedding_stage, dp, ZeRO,
    ddp_bucket_numel, dtype; its chunks the same for any ZeRO and buckets), each schedule's ends per (kind, pp, vpp,
    m) and costs (its dependency graph: _graph)."""

    def __init__(self, layers: dict | None = None):
        self.layers = dict(layers or {})          # what layer_facts measured, to hand to another Planner
        self._chunks, self._ranks, self._ends = {}, {}, {}

    def layer_jobs(self, cfg: TrainConfig) -> list:
        """[(kind, key, measure_layer's arguments)] of cfg's layer kinds: "embedding", "head", "first" (a
        block that starts a chunk: no pending residual) and "block" (one after another block, which hands it
        the residual it has not added yet; so does the head, which follows a block wherever it shares a chunk with
        one: an upper bound where it does not). Each measured once per key (model, tp, sp, recompute of the
        blocks, dtype, mbs, how attention and dropout save)."""
        L = cfg.model.num_layers
        kinds = [("embedding", 0, 1, False), ("first", 1, 2, False), ("block", 1, 2, True),
                 ("head", L + 1, L + 2, True)]
        model, saves = dataclasses.astuple(cfg.model), (math_attention(cfg), bool_dropout_masks(cfg))
        return [(name, (name, cfg.tp, cfg.sp, "none" if name in ("embedding", "head") else cfg.recompute,
                        cfg.precision.dtype, cfg.mbs, model, *saves),
                 (cfg, (first, end), residual)) for name, first, end, residual in kinds]

    def layer_facts(self, cfg: TrainConfig) -> dict:
        """{kind: Facts of one microbatch through it} (layer_jobs) on TP rank 0 of cfg's layout.
        FLOPs are ModelConfig's (per token, over the tokens, over tp)."""
        flops = cfg.model.layer_flops_per_token(cfg.recompute)
        tokens = cfg.mbs * cfg.model.seq_len / cfg.tp
        out = {}
        for name, key, job in self.layer_jobs(cfg):
            if key not in self.layers:
                self.layers[key] = measure_layer(*job)
            kind = "block" if name == "first" else name
            out[name] = dataclasses.replace(self.layers[key], flops=tokens * flops[kind])
        return out

    def rank_state(self, cfg: TrainConfig, dp: int, pp_rank: int) -> tuple:
        """(memory bytes, the step's collectives with sequence parallelism, without) of a rank, from its
        GradBuffers and Optimizer built on meta (recompute and the schedule change neither)."""
        model_key = (cfg.tp, cfg.pp, cfg.vpp, cfg.embedding_stage, cfg.pipeline_first_blocks, cfg.pipeline_last_blocks,
                     dp, cfg.precision.dtype, dataclasses.astuple(cfg.model))
        key = model_key + (pp_rank, cfg.zero, cfg.ddp_bucket_numel, cfg.gbs)  # (the loss all-reduce: a loss per sample)
        if key not in self._ranks:
            if model_key not in self._chunks:         # each rank's chunks of the latest model layout: built without
                self._chunks = {model_key: {}}        # ZeRO, used again with it (layouts() enumerates that after)
            layout = dataclasses.replace(cfg, sp=cfg.tp > 1, recompute="none", kernels="torch", compile=False)
            mesh = ParallelMesh(cfg.tp, cfg.pp, dp, ledger=Ledger(), virtual_rank=cfg.tp * dp * pp_rank)
            chunks, buffers, optimizer = build_rank(layout, mesh, RNGTracker(cfg.seed, 0, META), META,
                                                    self._chunks[model_key].get(pp_rank))
            self._chunks[model_key][pp_rank] = chunks
            mesh.ledger.reset()
            for buf in buffers:                       # the once-per-step collectives, by running them
                buf.finish_grad_sync()
            optimizer.finalize_grads()
            optimizer.reduce_norm_stats(torch.zeros(2, device=META))
            for buf in buffers:
                buf.start_param_gather()
            reduce_loss(mesh, torch.zeros(cfg.num_microbatches(dp), cfg.mbs, device=META), None, META)
            with_sp = mesh.ledger.summary()
            without_sp = {k: v for k, v in with_sp.items() if k != ("tp", "all_reduce")}   # the SP-parameter sum
            self._ranks[key] = optimizer.memory_bytes(), with_sp, without_sp
        return self._ranks[key]

    def _peak(self, cfg: TrainConfig, dp: int, pp_rank: int, chunks: list) -> tuple:
        """(activation bytes, (chunk, microbatch) pairs in flight) at the peak of the rank's schedule."""
        vectors, _, _ = _schedule_shape(cfg.schedule, cfg.pp, cfg.vpp, cfg.num_microbatches(dp), pp_rank)
        sizes, peak = [c.activation_bytes for c in chunks], (0, 0)
        for v in vectors:
            live = sum(n * b for n, b in zip(v, sizes))
            if live > peak[0]:
                peak = live, sum(v)
        return peak

    def stage_speakers(self, cfg: TrainConfig, dp: int) -> list:
        """Per pipeline rank, the rank that speaks for it: of each stage shape (the embedding, block count and
        head of each of the rank's chunks), the rank with the largest activation peak (the first of a tie). Ranks
        of one shape differ only in the microbatches in flight: the first and the last rank, alone with their
        embedding and head, have shapes of their own, so the others send, receive and compute alike."""
        layers, best, shapes, chunks = self.layer_facts(cfg), {}, [], {}
        for r in range(cfg.pp):
            mine = local_stage_layers(cfg, r)
            L = cfg.model.num_layers
            shape = tuple((a == 0, blocks_in(L, a, b), b == L + 2) for a, b in mine)
            if shape not in chunks:                   # (what a shape's chunks hold: the same Facts)
                chunks[shape] = _chunk_facts(cfg, layers, mine)
            peak = self._peak(cfg, dp, r, chunks[shape])[0]
            if shape not in best or peak > best[shape][0]:
                best[shape] = (peak, r)
            shapes.append(shape)
        return [best[shape][1] for shape in shapes]

    def measure_rank(self, cfg: TrainConfig, dp: int, pp_rank: int) -> RankFacts:
        """One training step of pipeline rank `pp_rank` of cfg's layout (TP rank 0, DP rank 0)."""
        memory, with_sp, without_sp = self.rank_state(cfg, dp, pp_rank)
        layers = self.layer_facts(cfg)
        stages = local_stage_layers(cfg, pp_rank)
        chunks = _chunk_facts(cfg, layers, stages)
        act_bytes = (cfg.model.seq_len // (cfg.tp if cfg.sp else 1)) * cfg.mbs * cfg.model.hidden_size \
            * DTYPES[cfg.precision.dtype].itemsize               # the engine's p2p message (its act_shape)
        _, backwards, sends = _schedule_shape(cfg.schedule, cfg.pp, cfg.vpp, cfg.num_microbatches(dp), pp_rank)
        peak, peak_pairs = self._peak(cfg, dp, pp_rank, chunks)
        sizes, extra = [c.activation_bytes for c in chunks], _backward_extra(cfg, layers, stages, chunks)
        backward = max([sum(n * b for n, b in zip(v, sizes)) + extra[c] - peak for c, v in backwards] + [0])
        m = cfg.num_microbatches(dp)                                # each chunk runs every microbatch once
        step = sum(chunks, Facts()) * m
        ledger = _merged(step.ledger, {("pp", op): (n, n * act_bytes) for op, n in sends.items()})
        # (with sp, or where the TP ranks average the replicated gradients: the same all-reduce of the same tensors)
        ledger = _merged(ledger, with_sp if cfg.sp or tp_ranks_may_round_apart(cfg.kernels, cfg.tp, cfg.sp)
                         else without_sp)
        flops = tuple(c.flops for c in chunks)
        return RankFacts(pp_rank, {**memory, "activations": peak, "backward": backward},
                         peak_pairs, m * sum(flops), ledger, flops, step.overlaps)

    def pipeline_ends(self, cfg: TrainConfig, m: int, forward: list, backward: list) -> list:
        """Per pipeline rank, the simulated time from the first forward of cfg's schedule over m microbatches to
        the rank's last compute (SimResult.ends), a compute of chunk c on rank r costing forward[r][c] and
        backward[r][c] ([pp][vpp] tables; see schedules.simulate_actions). All m microbatches are simulated: two
        stages of close paces can take turns setting it late (a lighter one that starts later first, the heaviest
        after), so a line through the ends at fewer microbatches can fall short, even of the heaviest rank's own busy
        time (pp = 4, vpp = 2, m = 64: 3.7% short). The schedule's dependency graph (_graph), which does not depend
        on the costs, is read off its lists once per (kind, pp, vpp, m) and timed once per set of costs (layouts
        that differ only in ZeRO have the same), or ahead at many (time_pipelines)."""
        self.time_pipelines([(cfg, m, forward, backward)])
        return self._ends[_ends_key(cfg, m, forward, backward)]

    def time_pipelines(self, pipelines: list) -> None:
        """pipeline_ends of each (cfg, m, forward, backward) of `pipelines`, kept for when it is asked for: those of
        one schedule (kind, pp, vpp, m) timed at all their costs in one pass over its graph (ScheduleGraph.rank_ends),
        the schedules one after another (_graph keeps the latest)."""
        todo = {}                                 # schedule -> {the key of its ends: the costs}
        for cfg, m, forward, backward in pipelines:
            key = _ends_key(cfg, m, forward, backward)
            if key not in self._ends:
                todo.setdefault(key[:4], {})[key] = (forward, backward)
        for schedule, tables in todo.items():
            self._ends.update(zip(tables, _graph(*schedule).rank_ends(list(tables.values()))))


def _ends_key(cfg: TrainConfig, m: int, forward: list, backward: list) -> tuple:
    """(kind, pp, vpp, m, the forward costs, the backward costs): what a pipeline's ends depend on."""
    return cfg.schedule, cfg.pp, cfg.vpp, m, tuple(map(tuple, forward)), tuple(map(tuple, backward))


def planned_memory(cfg: TrainConfig, dp: int) -> list:
    """[{weights, grads, optimizer, activations, backward} bytes] of every pipeline rank of cfg's layout, by pp rank
    (the first TP and DP rank of a stage speaks for it): what tools/plan.py predicts for the layout."""
    planner = Planner()
    return [planner.measure_rank(cfg, dp, r).memory for r in range(cfg.pp)]
