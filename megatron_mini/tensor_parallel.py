"""Tensor and sequence parallelism (Shoeybi et al. 2019; Korthikanti et al. 2022).

Conjugate autograd mappings over the TP group (`mesh.tp_group`), each a no-op at tp=1:

    copy_to_tensor_parallel_region              f: identity        / all-reduce
    reduce_from_tensor_parallel_region          g: all-reduce      / identity
    gather_from_tensor_parallel_region          all-gather last    / split last dim
    scatter_to_sequence_parallel_region         split seq dim 0    / all-gather seq
    gather_from_sequence_parallel_region        all-gather seq     / reduce-scatter seq
    reduce_scatter_to_sequence_parallel_region  reduce-scatter seq / all-gather seq

The column-parallel linears fuse f (and, with sp, the sequence gather) into the linear (`_Linear`), so
that its backward's collective runs beside a GEMM: the model calls f and scatter_to_sequence only
through that fusion, and the tests check the fusion against them.

Activations are `[s, b, h]`; with sequence parallelism `[s/tp, b, h]` between blocks.
Every parameter carries a `ParamSpec` (how it is split over TP, how it is initialised) so
its full, layout-independent value can be built from (seed, global name) and sliced.
"""
from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import comm
from .comm import Group


# ----------------------------------------------------------------------------- mappings
def _split(x: torch.Tensor, group: Group, dim: int) -> torch.Tensor:
    return x.chunk(group.size, dim=dim)[group.rank].contiguous()


def _identity(x, group):
    return x


def _sum_in_place(x, group):
    comm.all_reduce(x, group)  # consumes x: g's callers pass a fresh matmul output
    return x


def _sum_copy(x, group):
    return _sum_in_place(x.clone(), group)  # autograd may share f's incoming gradient with another branch


def eager(fn):
    """`fn`, always run eagerly: under torch.compile (compile=true) a call is a graph break, as with
    torch.compiler.disable(fn), made on the first compiled call (importing the compiler costs seconds)."""
    disabled = []

    @functools.wraps(fn)
    def call(*args):
        if not torch.compiler.is_compiling():
            return fn(*args)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args)
    return call


def _conjugate(name: str, forward, backward):
    """A mapping over the TP group: `forward` in the forward pass, its conjugate `backward` in backward."""
    class Mapping(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            ctx.group = group
            return forward(x, group)

        @staticmethod
        def backward(ctx, grad):
            return backward(grad, ctx.group), None

    Mapping.__name__ = name

    @eager
    def communicate(x: torch.Tensor, group: Group) -> torch.Tensor:
        return Mapping.apply(x, group)

    def apply(x: torch.Tensor, group: Group) -> torch.Tensor:
        return x if group.size == 1 else communicate(x, group)
    apply.__name__ = apply.__qualname__ = name
    apply.__doc__ = f"{forward.__name__} forward / {backward.__name__} backward over the TP group."
    return apply


def _split_last(x, group):
    return _split(x, group, -1)


def _gather_last(x, group):
    return comm.all_gather(x, group, dim=x.dim() - 1)


def _split_sequence(x, group):
    return _split(x, group, 0)


def _gather_sequence(x, group):
    return comm.all_gather(x, group, dim=0)


def _reduce_scatter_sequence(x, group):
    return comm.reduce_scatter(x, group, dim=0)


copy_to_tensor_parallel_region = _conjugate("copy_to_tensor_parallel_region", _identity, _sum_copy)
reduce_from_tensor_parallel_region = _conjugate("reduce_from_tensor_parallel_region", _sum_in_place, _identity)
gather_from_tensor_parallel_region = _conjugate("gather_from_tensor_parallel_region", _gather_last, _split_last)
scatter_to_sequence_parallel_region = _conjugate("scatter_to_sequence_parallel_region",
                                                 _split_sequence, _gather_sequence)
gather_from_sequence_parallel_region = _conjugate("gather_from_sequence_parallel_region",
                                                  _gather_sequence, _reduce_scatter_sequence)
reduce_scatter_to_sequence_parallel_region = _conjugate("reduce_scatter_to_sequence_parallel_region",
                                                        _reduce_scatter_sequence, _gather_sequence)


# ----------------------------------------------------------------------------- parameters
@dataclass
class ParamSpec:
    """How a parameter relates to its full (tp=1) value.

    tp_dim: the dim split over TP (None: replicated). tp_groups: the full tensor is
    `tp_groups` blocks along tp_dim, each split over TP (3 for fused QKV: [q; k; v]).
    init: "normal" (std), "zeros" or "ones". sequence_parallel: replicated but sees only a
    sequence shard, so its gradient is summed over TP. tied: the word embedding, which the
    output layer shares: with pp > 1 the first and last stage each hold it, and its gradient is
    summed over the embedding group. copy: this is the output layer's copy on the last stage
    (counted once in the gradient norm, under the embedding's own name).
    """
    init: str = "normal"
    std: float = 0.02
    tp_dim: int | None = None
    tp_groups: int = 1
    sequence_parallel: bool = False
    no_weight_decay: bool = False
    tied: bool = False
    copy: bool = False


def new_param(local_shape, spec: ParamSpec, dtype=torch.float32, device=None) -> nn.Parameter:
    p = nn.Parameter(torch.empty(local_shape, dtype=dtype, device=device))
    p.spec = spec
    return p


def full_shape(p: nn.Parameter, tp: int) -> tuple:
    shape = list(p.shape)
    if p.spec.tp_dim is not None:
        shape[p.spec.tp_dim] *= tp
    return tuple(shape)


def init_full(name: str, shape: tuple, spec: ParamSpec, seed: int) -> torch.Tensor:
    """The full fp32 value of parameter `name`: a function of (seed, name) alone."""
    if spec.init == "zeros":
        return torch.zeros(shape)
    if spec.init == "ones":
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen) * spec.std


def shard(full: torch.Tensor, spec: ParamSpec, tp: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's slice of a full tensor."""
    if spec.tp_dim is None or tp == 1:
        return full
    blocks = full.chunk(spec.tp_groups, dim=spec.tp_dim)
    return torch.cat([b.chunk(tp, dim=spec.tp_dim)[tp_rank] for b in blocks], dim=spec.tp_dim)


def unshard(shards: list, spec: ParamSpec) -> torch.Tensor:
    """Inverse of `shard`: the full tensor from every TP rank's slice (rank order)."""
    if spec.tp_dim is None or len(shards) == 1:
        return shards[0]
    g, d = spec.tp_groups, spec.tp_dim
    per_rank = [s.chunk(g, dim=d) for s in shards]
    return torch.cat([torch.cat([blocks[i] for blocks in per_rank], dim=d) for i in range(g)], dim=d)


# ----------------------------------------------------------------------------- layers
def _addmm_fp32_out(out, a, b):
    torch.addmm(out, a, b, out_dtype=out.dtype, out=out)


def _mm_fp32_then_add(out, a, b):
    out.add_(torch.mm(a, b, out_dtype=out.dtype))


def _mm_then_add(out, a, b):
    out.add_(a @ b)


GEMM_INTO_FP32 = {"addmm": _addmm_fp32_out, "mm": _mm_fp32_then_add, "cast": _mm_then_add}


@functools.lru_cache(maxsize=None)
def gemm_into_fp32(device_type: str, dtype: torch.dtype) -> str:
    """How this torch adds a product of two `dtype` matrices into an fp32 tensor on `device_type`:
    "addmm" (one GEMM with an fp32 output that adds into it: CUDA, with pytorch#167931, Nov 2025), "mm"
    (an fp32-output GEMM, then an add: CUDA from torch 2.8, where addmm still wants self in the inputs'
    dtype), or "cast" (a product in `dtype`, then an add: the CPU, older torch). Probed once."""
    a = torch.ones(16, 16, dtype=dtype, device=device_type)
    for way in ("addmm", "mm"):
        out = torch.ones(16, 16, dtype=torch.float32, device=device_type)   # (a way that overwrites gives 16)
        try:
            GEMM_INTO_FP32[way](out, a, a)
        except (TypeError, RuntimeError, NotImplementedError):
            continue
        if torch.equal(out, torch.full_like(out, 17.0)):
            return way
    return "cast"


def accumulate_matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b with `out` fp32 and a, b in the model dtype: one GEMM with an fp32 output that adds
    into `out` where torch has it (no 16-bit product, no separate add; gemm_into_fp32), else the
    nearest this torch offers."""
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    else:
        GEMM_INTO_FP32[gemm_into_fp32(a.device.type, a.dtype)](out, a, b)


def _param_grads(dy, x, weight, bias, fused: bool, needs: tuple, wgrad_ready: bool):
    """The gradients of W [out, in] and b [out] in y = x W^T + b, from dy [..., out] and x [..., in]:
    added into their fp32 main grads (`fused`: main_grad_W += dy^T x in one GEMM, main_grad_b += the fp32
    sum of dy over tokens; each parameter then calls `main_grad_ready()`, set by the GradBuffer, where
    AccumulateGrad's hook would have, W only with `wgrad_ready`) and (None, None) returned, or returned to
    autograd."""
    dy2 = dy.reshape(-1, dy.shape[-1])
    if not fused:
        dw = dy2.t() @ x.reshape(-1, x.shape[-1]) if needs[1] else None      # (x is None when W needs none)
        return dw, (dy2.sum(0) if bias is not None and needs[2] else None)
    accumulate_matmul(weight.main_grad, dy2.t(), x.reshape(-1, x.shape[-1]))
    if wgrad_ready:
        weight.main_grad_ready()
    if bias is not None:
        _bias_grad_into_main(bias, dy2)
    return None, None


@functools.lru_cache(maxsize=8)
def _ones_row(tokens: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.ones(1, tokens, dtype=dtype, device=device)


def _bias_grad_into_main(bias, dy2) -> None:
    """main_grad_b += the fp32 sum of dy [tokens, out] over tokens (no 16-bit .grad rounded first). Where
    this torch adds a 16-bit product straight into fp32 (gemm_into_fp32 "addmm"), the sum is the GEMM
    1^T dy into the main grad: on an H100 1.2-1.9x faster than a reduction then an add (docs/benchmarks.md,
    the eager glue probe); elsewhere the fp32 reduction and the add."""
    if dy2.dtype != torch.float32 and gemm_into_fp32(dy2.device.type, dy2.dtype) == "addmm":
        accumulate_matmul(bias.main_grad.view(1, -1), _ones_row(dy2.shape[0], dy2.dtype, dy2.device), dy2)
    else:
        bias.main_grad.add_(dy2.sum(0, dtype=torch.float32))
    bias.main_grad_ready()


class _AddBias(torch.autograd.Function):
    """y = x + b, x [..., out], b [out], with b's gradient added straight into its fp32 main grad, as
    `_Linear` does for the bias it applies: a row-parallel linear at tp > 1 adds its bias after g (or the
    reduce-scatter), outside the linear, and this keeps that gradient in fp32 as at tp = 1."""

    @staticmethod
    def forward(ctx, x, bias):
        ctx.bias = bias
        return x + bias

    @staticmethod
    def backward(ctx, dy):
        _bias_grad_into_main(ctx.bias, dy.reshape(-1, dy.shape[-1]))
        return dy, None


def add_bias(x, bias):
    """x + b; under autograd, with an fp32 main grad for b (training), through `_AddBias` (eager only, as
    `linear`)."""
    if _fused_here(bias, None):
        return _AddBias.apply(x, bias)
    return x + bias


class _AddPositions(torch.autograd.Function):
    """y = x + P[first:first + s] broadcast over the batch, x [s, b, h], P [positions, h], with P's gradient
    (dy summed over the batch in fp32, [s, h]) added straight into rows first .. first + s - 1 of its fp32
    main grad, as `_AddBias` does for a bias."""

    @staticmethod
    def forward(ctx, x, table, first):
        ctx.table, ctx.first = table, first
        return x + table[first:first + x.shape[0]].unsqueeze(1)

    @staticmethod
    def backward(ctx, dy):
        ctx.table.main_grad[ctx.first:ctx.first + dy.shape[0]].add_(dy.sum(1, dtype=torch.float32))
        ctx.table.main_grad_ready()
        return dy, None, None


def add_position_embeddings(x, table, first: int = 0):
    """x [s, b, h] + table[first:first + s] (position embeddings [positions, h]); with an fp32 main grad for the
    table (training), through `_AddPositions` (eager only, as `linear`)."""
    if _fused_here(table, None):
        return _AddPositions.apply(x, table, first)
    return x + table[first:first + x.shape[0]].unsqueeze(1)


class _Embedding(torch.autograd.Function):
    """y = W[ids], ids [...] -> [..., h], W [V, h], with W's gradient added straight into its fp32 main grad:
    the rows of dy, in fp32, summed at their ids in an order that does not vary from run to run (`_add_rows`).
    No [V, h] gradient in the model's dtype is formed (autograd's embedding backward forms one, a
    vocabulary-sized zero fill and, on a CPU, sums repeated ids in that dtype). The lookup is the table's last
    use in the backward (the tied output layer's at pp = 1 comes before it): it says W's gradient is in."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight          # the Parameter itself, which holds the main grad
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        _add_rows(ctx.weight.main_grad, ids.reshape(-1), dy.reshape(-1, dy.shape[-1]).float())
        ctx.weight.main_grad_ready()
        return None, None


def _add_rows(table, ids, rows) -> None:
    """table[ids[i]] += rows[i] for every i, ids [n], rows [n, h], repeated ids summed in the same order on every
    run: on a CPU index_add_ (in the order of ids; index_put_ with accumulate adds fp32 rows with atomics across
    threads there, in any order: 20 different sums in 20 runs of 4096 rows of 50 ids on 4 threads), elsewhere
    index_put_ with accumulate (sorted by id on CUDA, where index_add_ is the one that uses atomics)."""
    if table.device.type == "cpu":
        table.index_add_(0, ids, rows)
    else:
        table.index_put_((ids,), rows, accumulate=True)


def embedding(ids, weight):
    """W[ids]: F.embedding, through `_Embedding` under autograd with an fp32 main grad for W (eager only, as
    `linear`)."""
    if _fused_here(weight, None):
        return _Embedding.apply(ids, weight)
    return F.embedding(ids, weight)


class _Linear(torch.autograd.Function):
    """y = x W^T + b, x [..., in], W [out, in], b [out] or None, with Megatron's fusions of its backward:

    - tensor parallelism (`group`, the TP group of a column-parallel linear): the TP mapping before the
      linear is fused into it, so that its backward's collective runs while a GEMM does.
      - Without sequence parallelism that mapping is f: x is the full [s, b, in], and the backward
        all-reduces dx = dy W over TP while it computes dW (Megatron's async dgrad all-reduce).
      - With `sequence_parallel`, x is this rank's sequence shard [s/tp, b, in]. The forward all-gathers
        it to [s, b, in] and saves the shard only; the backward gathers it again for dW while it computes
        dx, then reduce-scatters dx to [s/tp, b, in] while it computes dW (Korthikanti et al. 2022,
        section 4.2.2). The gathered input, tp times the shard, is never kept from the forward to the
        backward: the cost is one more all-gather per backward (under full recompute, the recomputed
        forward's gather makes it two).
      Each such collective records the FLOPs of the GEMM it runs beside (comm.Ledger, for the planner).
    - gradient-accumulation fusion (`fused`): W's and b's gradients go straight into their fp32 main
      grads (`_param_grads`), which then say they are in (W with `wgrad_ready`); otherwise they are returned to
      autograd.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, group, sequence_parallel, fused, wgrad_ready):
        ctx.save_for_backward(x if weight.requires_grad else None)     # x is for dW alone
        ctx.weight, ctx.bias = weight, bias    # the Parameters themselves (a recompute's unpacked copy has no
                                               # main_grad)
        ctx.group, ctx.sequence_parallel, ctx.fused, ctx.wgrad_ready = group, sequence_parallel, fused, wgrad_ready
        return F.linear(comm.all_gather(x, group) if sequence_parallel else x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        (x,), weight, group = ctx.saved_tensors, ctx.weight, ctx.group
        need_dx, need_dw = ctx.needs_input_grad[:2]
        gemm = 2 * dy.numel() * weight.shape[1]          # FLOPs of dx = dy W, and of dW = dy^T x
        gathering = reducing = None
        if ctx.sequence_parallel and need_dw:     # the whole input again, gathered while dx's GEMM runs
            local, x = x.contiguous(), x.new_empty((group.size * x.shape[0],) + x.shape[1:])
            gathering = comm.all_gather_into(x, local, group, async_op=True, beside_flops=gemm * need_dx)
        dx = dy @ weight if need_dx else None
        if gathering is not None:
            gathering.wait()
        if group is not None and dx is not None:  # dx summed over the ranks (sp: this rank's shard kept), beside dW
            if ctx.sequence_parallel:
                full, dx = dx, dx.new_empty((dx.shape[0] // group.size,) + dx.shape[1:])
                reducing = comm.reduce_scatter_into(dx, full, group, async_op=True, beside_flops=gemm * need_dw)
            else:
                reducing = comm.all_reduce(dx, group, async_op=True, beside_flops=gemm * need_dw)
        dw, db = _param_grads(dy, x, weight, ctx.bias, ctx.fused, ctx.needs_input_grad, ctx.wgrad_ready)
        if reducing is not None:
            reducing.wait()
        return dx, dw, db, None, None, None, None


def _fuses_wgrad(weight, bias) -> bool:
    """Whether W's and b's gradients can go straight into fp32 main grads (training under a GradBuffer)."""
    return weight.requires_grad and hasattr(weight, "main_grad") and (bias is None or hasattr(bias, "main_grad"))


def linear(x, weight, bias=None, wgrad_ready: bool = True):
    """y = x W^T + b, x [..., in] -> [..., out], on this rank alone. The gradient-accumulation fusion
    (`_Linear`) applies when the parameters have fp32 main grads; it says W's gradient is in with
    `wgrad_ready`, which a weight used again later in the backward (the tied output layer's at pp = 1, the
    embedding's lookup table) leaves to that use. The fused linear is eager-only: under
    torch.compile (compile=true) the linear stays in the block's graph (a graph break per linear costs more
    host time than the fusion saves) and AccumulateGrad's hook moves the 16-bit .grad into the main grad.
    Otherwise (no grad, or no main grads) it is F.linear."""
    if _fused_here(weight, bias):
        return _Linear.apply(x, weight, bias, None, False, True, wgrad_ready)
    return F.linear(x, weight, bias)


def _fused_here(weight, bias) -> bool:
    """Whether this call fuses the gradient accumulation: under autograd, eager (not being compiled), with
    fp32 main grads (`_fuses_wgrad`)."""
    return torch.is_grad_enabled() and _fuses_wgrad(weight, bias) and not torch.compiler.is_compiling()


@eager
def _tensor_parallel_linear(x, weight, bias, group, sequence_parallel, fused, wgrad_ready):
    return _Linear.apply(x, weight, bias, group, sequence_parallel, fused, wgrad_ready)


def column_parallel_linear(x, weight, bias, tp_group: Group, sequence_parallel: bool, wgrad_ready: bool = True):
    """[s(/tp), b, in] -> [s, b, out/tp]: f (or, with sp, an all-gather of the sequence), then x W_i^T + b_i.
    At tp > 1 under autograd the mapping is fused into the linear (`_Linear`), whose backward runs the
    mapping's collective beside its GEMMs. Under torch.compile that runs eagerly, a graph break where the
    mapping was one, now with the linear on its eager side (inductor no longer fuses fc1's bias into the
    GELU there). Without autograd f is the identity. The gradient-accumulation fusion, `wgrad_ready`: see
    `linear`."""
    if tp_group.size == 1:
        return linear(x, weight, bias, wgrad_ready)
    if torch.is_grad_enabled():
        return _tensor_parallel_linear(x, weight, bias, tp_group, sequence_parallel, _fuses_wgrad(weight, bias),
                                       wgrad_ready)
    return F.linear(gather_from_sequence_parallel_region(x, tp_group) if sequence_parallel else x, weight, bias)


def _per_rank(size: int, tp_group: Group, what: str) -> int:
    if size % tp_group.size:
        raise ValueError(f"{what} {size} is not divisible by tp={tp_group.size}")
    return size // tp_group.size


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A [out, in] split along out: rank i holds A_i [out/tp, in] and returns its
    slice of Y [s, b, out/tp] (what the row-parallel linear after it takes)."""

    def __init__(self, in_features, out_features, tp_group: Group, *, sequence_parallel=False,
                 std=0.02, tp_groups=1, dtype=torch.float32, device=None):
        super().__init__()
        out = _per_rank(out_features, tp_group, "out_features")
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = new_param((out, in_features), ParamSpec("normal", std, tp_dim=0, tp_groups=tp_groups),
                                dtype, device)
        self.bias = new_param((out,), ParamSpec("zeros", tp_dim=0, tp_groups=tp_groups, no_weight_decay=True),
                              dtype, device)

    def forward(self, x):
        return column_parallel_linear(x, self.weight, self.bias, self.tp_group, self.sequence_parallel)


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A [out, in] split along in: rank i computes X_i A_i^T from its slice X_i
    [s, b, in/tp], then g (or a reduce-scatter of the sequence), then adds b once (`add_bias`)."""

    def __init__(self, in_features, out_features, tp_group: Group, *, sequence_parallel=False,
                 std=0.02, dtype=torch.float32, device=None):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = new_param((out_features, _per_rank(in_features, tp_group, "in_features")),
                                ParamSpec("normal", std, tp_dim=1), dtype, device)
        self.bias = new_param((out_features,), ParamSpec("zeros", sequence_parallel=sequence_parallel,
                                                          no_weight_decay=True), dtype, device)

    def forward(self, x):
        if self.tp_group.size == 1:
            return linear(x, self.weight, self.bias)
        y = linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tensor_parallel_region(y, self.tp_group)
        return add_bias(y, self.bias)


class VocabParallelEmbedding(nn.Module):
    """ids [s, b] -> [s, b, h] (or [s/tp, b, h] with sp); rank i owns rows [i*V/tp, (i+1)*V/tp). Ids must
    lie in [0, V): at tp > 1 an id past the end gives a zero row where tp = 1 raises (the data's ids are
    checked against the vocabulary as every batch is read: dataset.get_batch)."""

    def __init__(self, num_embeddings, dim, tp_group: Group, *, sequence_parallel=False, std=0.02, tied=False,
                 dtype=torch.float32, device=None):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.per_rank = _per_rank(num_embeddings, tp_group, "num_embeddings")
        self.start = tp_group.rank * self.per_rank
        self.weight = new_param((self.per_rank, dim), ParamSpec("normal", std, tp_dim=0, tied=tied), dtype, device)

    def forward(self, ids):
        if self.tp_group.size == 1:
            return embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        y = embedding(local.masked_fill(outside, 0), self.weight)
        y = y.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        return reduce_from_tensor_parallel_region(y, self.tp_group)


# ----------------------------------------------------------------------------- cross entropy
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from vocab-sharded logits [s, b, V/tp] without gathering the vocabulary.

    loss = logsumexp(x) - (1-a) x_t - (a/V) sum_j x_j over the V real (unpadded) classes,
    which is F.cross_entropy(x, t, label_smoothing=a). Forward: two all-reduces, the max [s, b], then
    the sum-exp and the target logit (and, with a > 0, the logit sum) stacked, [2 (3), s, b].
    Backward, local: dx_j = p_j - (1-a) [j = t] - a/V on real classes, 0 on padding, written over the
    saved probabilities (one backward per forward, as Megatron's). Targets must lie in [0, V): there is no
    ignore_index, and a target past the end gives a wrong loss at tp > 1 where tp = 1 raises.
    """

    @staticmethod
    def forward(ctx, logits, target, tp_group, vocab_size, label_smoothing):
        x = logits.float()
        per_rank = x.shape[-1]
        start = tp_group.rank * per_rank
        padded = torch.arange(start, start + per_rank, device=x.device) >= vocab_size
        if start + per_rank > vocab_size:                  # this slice holds padding rows
            x = x.masked_fill(padded, float("-inf"))
        x_max = x.max(dim=-1).values
        comm.all_reduce(x_max, tp_group, op=torch.distributed.ReduceOp.MAX)
        x = x - x_max.unsqueeze(-1)

        local_t = target - start
        in_shard = (local_t >= 0) & (local_t < per_rank)
        x_t = torch.gather(x, -1, local_t.clamp(0, per_rank - 1).unsqueeze(-1)).squeeze(-1)
        exp = x.exp()
        sums = [exp.sum(-1), x_t.masked_fill(~in_shard, 0.0)]
        if label_smoothing:
            sums.append(x.masked_fill(padded, 0.0).sum(-1))
        sums = torch.stack(sums)
        comm.all_reduce(sums, tp_group)
        log_z, x_t = sums[0].log(), sums[1]
        loss = log_z - (1 - label_smoothing) * x_t
        if label_smoothing:
            loss -= label_smoothing * sums[2] / vocab_size
        exp.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(exp, local_t, in_shard, padded)
        ctx.label_smoothing, ctx.vocab_size, ctx.dtype = label_smoothing, vocab_size, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        probs, local_t, in_shard, padded = ctx.saved_tensors
        a = ctx.label_smoothing
        grad = probs
        if a:
            grad.sub_((~padded).float() * (a / ctx.vocab_size))
        target = local_t.clamp(0, grad.shape[-1] - 1).unsqueeze(-1)        # only in-shard targets subtract
        grad.scatter_add_(-1, target, in_shard.unsqueeze(-1).to(grad.dtype) * -(1.0 - a))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.dtype), None, None, None, None


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """The same loss and gradient through the Triton kernels of kernels/cross_entropy.py (its docstring
    states the math): the forward reads the logits once for each row's max m, sum-exp s, target logit and
    logit sum, shifted by m; the backward reads them again and writes dx. What is saved is the logits
    themselves and (M, log S) [2, s*b]. Over TP ranks the stats combine to the row's max M (an all-reduce)
    and S = sum_r s_r exp(m_r - M), with the shifted target logit and logit sum (a second): the torch
    path's two all-reduces, of its sizes."""

    @staticmethod
    def forward(ctx, logits, target, tp_group, vocab_size, label_smoothing):
        from .kernels import as_rows
        from .kernels.cross_entropy import row_stats
        per_rank = logits.shape[-1]
        start = tp_group.rank * per_rank
        rows = as_rows(logits, per_rank)
        local_t = (target - start).reshape(-1).contiguous()
        n_valid = min(per_rank, vocab_size - start)        # <= 0: this shard is all padding
        m, s, dt, xs = row_stats(rows, local_t, n_valid, label_smoothing > 0)
        if tp_group.size > 1:
            m_all = m.clone()
            comm.all_reduce(m_all, tp_group, op=torch.distributed.ReduceOp.MAX)
            shift = m - m_all                               # this shard's max against the row's
            in_shard = (local_t >= 0) & (local_t < n_valid)
            # (the target's shard alone shifts dt: selected, as a shard of -inf logits elsewhere has shift -inf,
            # and -inf * 0 is NaN)
            parts = [s * shift.exp(), dt + torch.where(in_shard, shift, 0.0)] + \
                ([xs + n_valid * shift] if label_smoothing else [])
            sums = torch.stack(parts) if n_valid > 0 else torch.zeros(len(parts), m.numel(), device=m.device)
            comm.all_reduce(sums, tp_group)
            m, s, dt, xs = m_all, sums[0], sums[1], (sums[2] if label_smoothing else None)
        log_s = s.log()
        loss = log_s - (1 - label_smoothing) * dt
        if label_smoothing:
            loss -= label_smoothing / vocab_size * xs
        ctx.save_for_backward(rows, local_t, torch.stack([m, log_s]))
        ctx.label_smoothing, ctx.vocab_size, ctx.n_valid, ctx.shape = label_smoothing, vocab_size, n_valid, logits.shape
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        from .kernels.cross_entropy import logits_grad
        rows, local_t, shift = ctx.saved_tensors
        g = grad_loss.reshape(-1).float().contiguous()
        dx = logits_grad(rows, local_t, shift, g, ctx.n_valid, ctx.label_smoothing, ctx.vocab_size)
        return dx.view(ctx.shape), None, None, None, None


def vocab_parallel_cross_entropy(logits, target, tp_group: Group, vocab_size: int, label_smoothing: float = 0.0,
                                 fused: bool = False):
    """Per-token loss [s, b] in fp32 from logits [s, b, V_padded/tp] and targets [s, b].
    fused: the Triton kernels (_FusedVocabParallelCrossEntropy). Otherwise, at tp=1, the same math is
    F.cross_entropy's fused kernel on the unpadded vocabulary."""
    if fused:
        return _FusedVocabParallelCrossEntropy.apply(logits, target, tp_group, vocab_size, label_smoothing)
    if tp_group.size == 1:
        flat = logits.reshape(-1, logits.shape[-1])[:, :vocab_size].float()
        return F.cross_entropy(flat, target.reshape(-1), reduction="none",
                               label_smoothing=label_smoothing).view(target.shape)
    return _VocabParallelCrossEntropy.apply(logits, target, tp_group, vocab_size, label_smoothing)
