"""GPT-2 as a list of layers: [Embedding, Block_1 .. Block_L, Head].

Learned positions, pre-LayerNorm blocks, causal self-attention, GELU(tanh) MLP of width f = ffn_mult h (4h),
biases, LayerNorm eps 1e-5, tied input/output embeddings. Activations are `[s, b, h]`
(`[s/tp, b, h]` between layers with sequence parallelism). A pipeline stage runs a
contiguous slice of the layer list (`GPTChunk`); tensor parallelism lives inside the layers.
Every parameter has a global name (`embedding.word_embeddings.weight`, `blocks.3.attn.qkv.weight`,
`head.ln_f.bias`, ...) from which its full initial value is derived, whatever the layout.
For inference, a `KVCache` threads through the forward: each call feeds the positions after
the cached ones and attends to the cached keys and values as well.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from .comm import Group, Ledger
from .config import Kernels, ModelConfig, Recompute, TrainConfig
from .hardware import gpu_key
from .kernels import attention_unsupported, triton_installed
from .rng import RNGTracker
from .tensor_parallel import (ColumnParallelLinear, ParamSpec, RowParallelLinear, VocabParallelEmbedding,
                              add_position_embeddings, column_parallel_linear, full_shape,
                              gather_from_tensor_parallel_region, init_full, new_param, shard,
                              vocab_parallel_cross_entropy)


@dataclass(frozen=True)
class TritonOps:
    """Which fused ops run the Triton kernels (True) rather than torch (False): kernels=torch uses
    F.layer_norm, F.scaled_dot_product_attention and F.cross_entropy (its vocab-parallel form at tp > 1)
    everywhere; kernels=triton the Triton kernels (on CPU through the interpreter); kernels=layer_norm,
    attention or cross_entropy the Triton kernel of that op only; kernels=auto torch, except where
    `make bench-kernels` measured the Triton kernel faster than every torch path on this GPU at this size
    (TRITON_WINS) and it can run there, so auto is never slower than kernels=torch, nor refused."""
    layer_norm: bool = False
    attention: bool = False
    cross_entropy: bool = False


# (op, GPU, size, dtype, variant) where a Triton kernel beat every torch path, fwd+bwd, in `make bench-kernels`
# (docs/benchmarks.md): op "layer_norm" (size: hidden), "attention" (size: head dim) or "cross_entropy"
# (size: the vocabulary columns of a rank, padded vocabulary / tp; the bench measures one rank against
# F.cross_entropy, and at tp > 1 the torch path is the unfused vocab-parallel one), GPU a key of
# hardware.GPUS, dtype the run's precision.dtype ("bf16", "fp16", "fp32": the kernels' fp32 path is another
# one), variant whether the op runs its other kernel variant: the attention with dropout (model.dropout > 0),
# the cross-entropy with label smoothing (model.label_smoothing > 0); always False for the LayerNorm. Only what
# was measured: `bench-kernels` times bf16 without dropout or label smoothing, 16384 rows (tokens) a call. On an
# H100 (2026-11-24) the cross-entropy at 50,304 columns took 1.83 ms fwd+bwd against torch.compile's 2.28 and
# eager's 13.9 (at 8,192 it lost to torch.compile, 0.78 against 0.43); the LayerNorms and the attention lost at
# every size.
TRITON_WINS: frozenset = frozenset({("cross_entropy", "h100-80gb", 50304, "bf16", False)})


def select_triton_ops(kernels: Kernels, model: ModelConfig, device: torch.device, tp: int, dtype: str,
                      mbs: int) -> TritonOps:
    """TritonOps for `kernels`; under auto, an op's TRITON_WINS entry is taken where triton is installed and, for
    the attention, where the kernel takes the shape (attention_unsupported, with mbs x heads per TP rank)."""
    head_dim = model.hidden_size // model.num_heads
    sizes = {"layer_norm": model.hidden_size, "attention": head_dim, "cross_entropy": model.padded_vocab_size // tp}
    if kernels != "auto":
        return TritonOps(**{op: kernels in ("triton", op) for op in sizes})
    gpu = gpu_key(device)
    if gpu is None or not triton_installed():
        return TritonOps()
    variant = {"layer_norm": False, "attention": model.dropout > 0, "cross_entropy": model.label_smoothing > 0}
    wins = {op: (op, gpu, size, dtype, variant[op]) in TRITON_WINS for op, size in sizes.items()}
    if attention_unsupported(head_dim, model.seq_len, model.dropout, mbs * model.num_heads // tp):
        wins["attention"] = False
    return TritonOps(**wins)


def tp_ranks_may_round_apart(kernels: Kernels, tp: int, sp: bool) -> bool:
    """Whether the TP ranks may round the replicated parameters' gradients otherwise, so that the optimizer must
    average them over TP (Optimizer's average_replicated): where the Triton LayerNorm, which each rank autotunes,
    may run at tp > 1 without sp (every TP rank computes the whole LayerNorm). From the config alone, which every
    rank agrees on (kernels=auto's choice depends on a rank's GPU): a rank that ran the average's all-reduce while
    another did not would hang."""
    layer_norm = kernels in ("triton", "layer_norm") or (
        kernels == "auto" and any(entry[0] == "layer_norm" for entry in TRITON_WINS))
    return tp > 1 and not sp and layer_norm


# SDPA's backends on CUDA in this order of preference, each taken if it accepts the inputs. On an H100
# (2026-11-24, docs/probes/eager_glue.py) the attention core at gpt2-small's shape, q, k, v split from the
# qkv columns as Attention.core does, took 0.509 ms fwd+bwd under cuDNN, 0.722 under flash, and 0.881 as
# torch chose by itself (0.717 for q, k, v unbound from a [s, b, 3, heads, d] view, the earlier layout).
CUDA_SDPA_ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                   SDPBackend.MATH]
# (an older torch without set_priority: torch's order; torch.compile traces the context and honours the order
# from torch 2.9, pytorch#160684, in one graph: tests/test_model_kernels.py::test_the_cuda_sdpa_order_...)
_SDPA_PRIORITY = "set_priority" in inspect.signature(sdpa_kernel).parameters


def sdpa(q, k, v, **kwargs):
    """F.scaled_dot_product_attention, on CUDA with the backends in CUDA_SDPA_ORDER's order."""
    if q.is_cuda and _SDPA_PRIORITY:
        return sdpa_in_order(q, k, v, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, **kwargs)


def sdpa_in_order(q, k, v, **kwargs):
    """F.scaled_dot_product_attention with the backends tried in CUDA_SDPA_ORDER's order."""
    with sdpa_kernel(CUDA_SDPA_ORDER, set_priority=True):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)


def chunk_is_one_graph(tp: int, recompute: Recompute, dropout: float) -> bool:
    """Whether torch.compile takes a chunk's run of blocks as one graph: nothing in it needs to stay eager
    (no TP collective, no full recompute, no dropout, whose masks are keyed before each block: RNGTracker.seed).
    Else each block is a graph of its own."""
    return tp == 1 and recompute != Recompute.full and not dropout


def compiles(cfg: TrainConfig, device) -> bool:
    """cfg.compile as set; unset: on CUDA where a chunk is one graph, which one H100 measured faster than eager
    at every size tried (gpt2-small 1.07-1.13x, gpt2-medium 1.09x, gpt3-1.3b 1.02x: docs/benchmarks.md), where a
    graph per block was slower (gpt2-medium 468 against 387 ms); eager elsewhere, and on a CPU."""
    if cfg.compile is not None:
        return cfg.compile
    return torch.device(device).type == "cuda" and chunk_is_one_graph(cfg.tp, cfg.recompute, cfg.model.dropout)


def cpu_compile_missing() -> str | None:
    """What torch.compile lacks on this machine to compile for the CPU, where inductor builds C++ (on CUDA it
    generates Triton): a C++ compiler, found as inductor finds it (cpp_builder.get_cpp_compiler: $CXX, else g++;
    clang++ on macOS; `--version` must run), and on Linux Python's headers, Python.h in the include directory
    inductor passes it (sysconfig's, whose absence inductor only warns of). None where nothing is missing. Costs
    the compiler's `--version` (0.07 s) after importing inductor (1.1 s, which the first compile would)."""
    from torch._inductor import config as inductor_config
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler
    except ImportError:             # (torch 2.4's is private, _get_cpp_compiler: a missing one is inductor's to name)
        get_cpp_compiler = None
    try:
        if get_cpp_compiler:
            get_cpp_compiler()
    except (RuntimeError, OSError):     # (InvalidCxxCompiler, a RuntimeError: none of them runs)
        cxx = inductor_config.cpp.cxx
        tried = [c for c in (cxx if isinstance(cxx, (list, tuple)) else (cxx,)) if c]
        named = " or ".join(f"`{c} --version`" + (" ($CXX)" if c == os.environ.get("CXX") else "") for c in tried)
        return (f"torch.compile builds C++ there (inductor) and finds no C++ compiler ({named} failed): install g++ "
                f"(Debian/Ubuntu: apt install g++) or set CXX to one")
    if sys.platform == "linux":
        return python_headers_missing("torch.compile builds C++ there (inductor)", sysconfig.get_path("include"))
    return None


def triton_build_missing() -> str | None:
    """What Triton lacks on this machine to build the C it loads on CUDA (its driver's utilities, at the first
    launch of any Triton kernel, torch.compile's included, and each kernel's launcher), found as
    triton.runtime.build finds them: a C compiler ($CC as given, else gcc, else clang, on PATH) and Python.h (in
    the include directory of sysconfig's default scheme; posix_prefix's for Debian's posix_local). None where
    nothing is missing. Without them a run fails in its first step (a compiled one's after tracing it)."""
    what = "Triton builds C there (its driver's utilities and each kernel's launcher)"
    cc = os.environ.get("CC")
    if cc is not None and not shutil.which(cc):
        return f"{what} with $CC={cc}, which is not found: set CC to a C compiler, or unset it (gcc, else clang)"
    if cc is None and not (shutil.which("gcc") or shutil.which("clang")):
        return (f"{what} and finds no C compiler (no $CC, gcc or clang on PATH): install gcc (Debian/Ubuntu: apt "
                f"install gcc) or set CC to one")
    scheme = sysconfig.get_default_scheme()
    scheme = "posix_prefix" if scheme == "posix_local" else scheme
    return python_headers_missing(what, sysconfig.get_paths(scheme=scheme)["include"])


def python_headers_missing(what: str, include: str) -> str | None:
    """Why `what`, which compiles C or C++ that includes Python.h from `include`, fails where it is not there."""
    if os.path.exists(os.path.join(include, "Python.h")):
        return None
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return (f"{what} that includes Python.h, which is not in {include}: install Python's headers (Debian/Ubuntu: "
            f"apt install python{version}-dev)")


@dataclass
class ParallelContext:
    """What the layers need of the parallelisation and the run, beside the ModelConfig (torchtitan's
    split of model from parallelisation): the TP group, sequence parallelism, activation
    recompute, which ops run Triton kernels, the dropout RNG streams, torch.compile per block."""
    tp_group: Group
    rng: RNGTracker
    sp: bool = False
    recompute: Recompute = Recompute.none
    triton: TritonOps = TritonOps()
    compile: bool = False

    @classmethod
    def one_device(cls, device, seed: int = 0) -> "ParallelContext":
        """No parallelism, torch kernels: a whole model on one device (inference, tests)."""
        return cls(Group("tp", [0], None, Ledger()), RNGTracker(seed, 0, torch.device(device)))

    def compile_chunks(self, dropout: float) -> bool:
        """Compiling, a chunk's run of blocks as one graph where it can be (chunk_is_one_graph): the per-call
        cost of a compiled region (guards, the autograd wrapper) is then paid once per microbatch, not once
        per block. Else each block."""
        return self.compile and chunk_is_one_graph(self.tp_group.size, self.recompute, dropout)

    def dropout_stream(self, per_tp_rank: bool):
        """The RNG stream a dropout draws from: the TP-rank stream (RNGTracker.fork) when its tensor differs
        across TP ranks (`per_tp_rank`: local heads, a sequence shard) and there are several; else the
        default stream. At tp=1 there is one rank, so no fork is needed, and none keeps a compiled graph
        whole (switching generator state is a graph break)."""
        return self.rng.fork() if per_tp_rank and self.tp_group.size > 1 else contextlib.nullcontext()


class LayerNorm(nn.Module):
    """LayerNorm over h (fp32 statistics), with a fused residual add: `ln(x)` is LN(x) and
    `ln.add_and_norm(x, r)` is (h, LN(h)) with h = x + r. Parameters `weight`, `bias` as in
    nn.LayerNorm, marked for the sequence-parallel gradient sum."""

    def __init__(self, m: ModelConfig, ctx: ParallelContext, device):
        super().__init__()
        h = m.hidden_size
        self.eps, self.triton = m.ln_eps, ctx.triton.layer_norm
        self.weight = new_param((h,), ParamSpec("ones", sequence_parallel=ctx.sp, no_weight_decay=True), device=device)
        self.bias = new_param((h,), ParamSpec("zeros", sequence_parallel=ctx.sp, no_weight_decay=True), device=device)
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x):
        if self.triton:
            from .kernels.layernorm import layer_norm
            return layer_norm(x, self.weight, self.bias, self.eps)
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def add_and_norm(self, x, r):
        """(h, LN(h)) with h = x + r; r None means h = x."""
        if r is None:
            return x, self(x)
        if self.triton:
            from .kernels.layernorm import add_layer_norm
            return add_layer_norm(x, r, self.weight, self.bias, self.eps)
        h = x + r
        return h, F.layer_norm(h, self.weight.shape, self.weight, self.bias, self.eps)


class Dropout(nn.Dropout):
    """Dropout on the residual stream: with sequence parallelism each TP rank holds other tokens, so
    its mask draws from the TP-rank stream; otherwise the TP ranks hold the same tokens and draw the
    same mask from the default stream (ParallelContext.dropout_stream)."""

    def __init__(self, p: float, ctx: ParallelContext):
        super().__init__(p)
        self.ctx = ctx

    def forward(self, x):
        with self.ctx.dropout_stream(self.ctx.sp and self.p > 0 and self.training):
            return super().forward(x)


def recomputed(fn, rng: RNGTracker | None, *args):
    """Run fn(*args) under activation checkpointing, replaying the same dropout masks in backward; rng None
    when fn draws nothing random (no dropout): no RNG state is saved or restored, so under
    torch.compile the checkpoint stays inside the graph (reading generator state is a graph break)."""
    if rng is None:
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)
    saved = rng.get_states()
    calls = [0]

    def replay(*a):
        calls[0] += 1
        if calls[0] == 1:
            return fn(*a)
        current = rng.get_states()
        rng.set_states(saved)
        try:
            return fn(*a)
        finally:
            rng.set_states(current)

    return checkpoint(replay, *args, use_reentrant=False, preserve_rng_state=False)


class KVCache:
    """Inference cache: each attention layer's keys and values of the `length` positions seen so far,
    k and v [b, heads, length, d]. A forward with the cache feeds positions length .. length + s - 1,
    attends to the cached keys and values as well, and appends its own (so `length` grows by s).
    For inference without sequence parallelism (megatron_mini.inference runs tp=1)."""

    def __init__(self):
        self.kv = {}                                   # attention module -> (k, v)

    @property
    def length(self) -> int:
        return next(iter(self.kv.values()))[0].shape[2] if self.kv else 0

    def update(self, layer: nn.Module, k, v):
        """Append k, v [b, heads, s, d] to `layer`'s cache; returns its keys and values [b, heads, length + s, d]."""
        if layer in self.kv:
            k, v = (torch.cat(kv, dim=2) for kv in zip(self.kv[layer], (k, v)))
        self.kv[layer] = k, v
        return k, v


class Layer(nn.Module):
    """A pipeline unit; its parameters' global names are `prefix.local_name`. The embedding and the blocks
    have an `index`, their place in the layer list [Embedding, Block_1..L, Head], which keys their dropout
    masks (RNGTracker.seed)."""
    prefix = ""

    def global_name(self, local: str) -> str:
        return f"{self.prefix}.{local}"


class Embedding(Layer):
    """ids [b, s] -> word + position embeddings [s(/tp), b, h]: positions 0 .. s - 1 (this rank's
    shard of them with sp), or those after a cache's `length` (inference)."""
    prefix, index = "embedding", 0

    def __init__(self, m: ModelConfig, ctx: ParallelContext, device):
        super().__init__()
        self.tp_group, self.sp = ctx.tp_group, ctx.sp
        self.word_embeddings = VocabParallelEmbedding(m.padded_vocab_size, m.hidden_size, ctx.tp_group,
                                                      sequence_parallel=ctx.sp, std=m.init_std, tied=True,
                                                      device=device)
        self.position_embeddings = new_param((m.seq_len, m.hidden_size),
                                             ParamSpec("normal", 0.01, sequence_parallel=ctx.sp), device=device)
        self.dropout = Dropout(m.dropout, ctx)

    def forward(self, ids, cache: KVCache | None = None):
        if cache is not None and self.sp:
            raise ValueError("a KVCache needs the whole sequence on every rank: build the model with sp=False")
        first = cache.length if cache is not None else 0     # inference: the positions after the cached ones
        end = first + ids.shape[1]
        if end > len(self.position_embeddings):   # on every rank, before word_embeddings' collective
            raise ValueError(f"positions {first}..{end - 1} exceed the model's context of "
                             f"{len(self.position_embeddings)}")
        x = self.word_embeddings(ids.t())
        s = x.shape[0]
        if self.sp:
            first += self.tp_group.rank * s
        return self.dropout(add_position_embeddings(x, self.position_embeddings, first))


class Attention(nn.Module):
    """Causal self-attention with heads split over TP: QKV column-parallel, output row-parallel."""

    def __init__(self, m: ModelConfig, ctx: ParallelContext, device):
        super().__init__()
        h, tp = m.hidden_size, ctx.tp_group.size
        self.heads, self.head_dim = m.num_heads // tp, h // m.num_heads
        self.ctx, self.attn_dropout = ctx, m.dropout
        self.selective_recompute = ctx.recompute == "selective"
        self.triton = ctx.triton.attention
        self.qkv = ColumnParallelLinear(h, 3 * h, ctx.tp_group, sequence_parallel=ctx.sp, std=m.init_std,
                                        tp_groups=3, device=device)
        self.proj = RowParallelLinear(h, h, ctx.tp_group, sequence_parallel=ctx.sp,
                                      std=m.init_std / math.sqrt(2 * m.num_layers), device=device)

    def core(self, qkv, cache: KVCache | None = None):
        """softmax(q k^T / sqrt(d) + causal mask) v: qkv [s, b, 3 * heads * d] (local heads) -> [s, b, heads * d].
        With a cache (torch SDPA) the keys are the t - s cached ones then these s: query i sees keys 0 .. t - s + i.
        Dropout on the probabilities draws from the TP-rank stream at tp > 1 (the heads differ per rank)."""
        drop = self.attn_dropout if self.training else 0.0
        with self.ctx.dropout_stream(drop > 0):
            if self.triton and cache is None:
                from .kernels.attention import flash_attention_qkv
                return flash_attention_qkv(qkv, self.heads, causal=True, dropout_p=drop)
            s, b = qkv.shape[:2]
            # [b, heads, s, d] views of the three column blocks. Split (not unbind of a [s, b, 3, ...] view):
            # SDPA (cuDNN, CPU) returns each gradient laid out as its input, [s, b, heads, d], so the qkv
            # gradient is one cat; through unbind it was a stack and then a copy of the permuted result.
            q, k, v = (t.view(s, b, self.heads, self.head_dim).permute(1, 2, 0, 3)
                       for t in qkv.split(self.heads * self.head_dim, dim=-1))
            if cache is None:
                y = sdpa(q, k, v, dropout_p=drop, is_causal=True)                     # [b, heads, s, d]
            else:
                k, v = cache.update(self, k, v)                                               # [b, heads, t, d]
                t = k.shape[2]
                mask = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(t - s)
                y = sdpa(q, k, v, attn_mask=mask, dropout_p=drop)
            return y.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)

    def forward(self, x, cache: KVCache | None = None):
        qkv = self.qkv(x)                                        # [s, b, 3 * heads * d] (local heads)
        if self.selective_recompute and self.training:
            return self.proj(recomputed(self.core, self.ctx.rng if self.attn_dropout else None, qkv))
        return self.proj(self.core(qkv, cache))


class MLP(nn.Module):
    """fc1 (column-parallel, h -> f/tp), GELU(tanh), fc2 (row-parallel, f/tp -> h); f = ffn_mult h (4h)."""

    def __init__(self, m: ModelConfig, ctx: ParallelContext, device):
        super().__init__()
        self.fc1 = ColumnParallelLinear(m.hidden_size, m.ffn_hidden_size, ctx.tp_group, sequence_parallel=ctx.sp,
                                        std=m.init_std, device=device)
        self.fc2 = RowParallelLinear(m.ffn_hidden_size, m.hidden_size, ctx.tp_group, sequence_parallel=ctx.sp,
                                     std=m.init_std / math.sqrt(2 * m.num_layers), device=device)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(Layer):
    """Pre-LN block on the residual stream, with the residual adds fused into the LayerNorms:

        (x, r) -> h = x + r, y = ln1(h);  h = h + drop(attn(y)), y = ln2(h);  -> (h, drop(mlp(y)))

    The MLP's output is returned unadded (r of the next block, added by its ln1, or by the chunk
    at its end); r None means nothing is pending.
    """

    def __init__(self, index: int, m: ModelConfig, ctx: ParallelContext, device):
        super().__init__()
        self.prefix, self.index = f"blocks.{index}", index + 1
        self.rng = ctx.rng if m.dropout else None      # for recomputed(): None when nothing is random
        self.full_recompute = ctx.recompute == "full"
        self.ln1 = LayerNorm(m, ctx, device)
        self.attn = Attention(m, ctx, device)
        self.ln2 = LayerNorm(m, ctx, device)
        self.mlp = MLP(m, ctx, device)
        self.dropout = Dropout(m.dropout, ctx)
        if ctx.compile and not ctx.compile_chunks(m.dropout):   # a graph per block between what stays eager
            self._forward = torch.compile(self._forward, dynamic=False)

    def _forward(self, x, r, cache=None):
        h, y = self.ln1.add_and_norm(x, r)
        h, y = self.ln2.add_and_norm(h, self.dropout(self.attn(y, cache)))
        return h, self.dropout(self.mlp(y))

    def forward(self, x, r=None, cache: KVCache | None = None):
        if self.full_recompute and self.training:
            if r is not None:       # (the sum, unfused: the checkpoint keeps one [s, b, h] input, as Megatron's)
                x, r = x + r, None
            return recomputed(self._forward, self.rng, x, r)
        return self._forward(x, r, cache)


class Head(Layer):
    """Final LayerNorm, logits with the (tied) word embedding, vocab-parallel cross-entropy.

    With labels [b, s]: the sum of the per-token losses (fp32 scalar); the caller normalises.
    Without: the logits (inference).
    `word_embeddings` is the embedding's own Parameter when both live on this rank, else a
    copy with the same global name, kept identical by the embedding-group gradient sum.
    """
    prefix = "head"

    def __init__(self, m: ModelConfig, ctx: ParallelContext, word_embeddings: nn.Parameter | None, device):
        super().__init__()
        self.tp_group, self.sp = ctx.tp_group, ctx.sp
        self.vocab_size, self.label_smoothing = m.vocab_size, m.label_smoothing
        self.ln_f = LayerNorm(m, ctx, device)
        # the embedding's own table (pp = 1): its lookup, later in the backward, says its gradient is in
        self.looked_up = word_embeddings is not None
        if word_embeddings is None:
            word_embeddings = new_param((m.padded_vocab_size // ctx.tp_group.size, m.hidden_size),
                                        ParamSpec("normal", m.init_std, tp_dim=0, tied=True, copy=True), device=device)
        self.word_embeddings = word_embeddings
        self.cross_entropy = vocab_parallel_cross_entropy
        if ctx.triton.cross_entropy:                 # the Triton kernels: the logits read once each way
            self.cross_entropy = functools.partial(vocab_parallel_cross_entropy, fused=True)
        elif ctx.compile and ctx.tp_group.size == 1:   # F.cross_entropy on fp32 logits: inductor fuses the cast
            self.cross_entropy = torch.compile(vocab_parallel_cross_entropy, dynamic=False)   # and the log-softmax

    def global_name(self, local: str) -> str:
        return "embedding.word_embeddings.weight" if local == "word_embeddings" else super().global_name(local)

    def forward(self, x, labels=None, r=None):
        """logits = ln_f(x + r) E^T, [s, b, V/tp] on this rank's vocabulary slice; r is the last block's
        pending residual (or None). Returns each sample's sum of its token losses, [b], or, without labels, the
        logits [s, b, vocab_size] in fp32 (an fp64 model's in fp64) over the whole real vocabulary (gathered over
        TP, padded rows dropped)."""
        logits = column_parallel_linear(self.ln_f.add_and_norm(x, r)[1], self.word_embeddings, None,
                                        self.tp_group, self.sp, wgrad_ready=not self.looked_up)
        if labels is None:
            logits = gather_from_tensor_parallel_region(logits, self.tp_group)[..., :self.vocab_size]
            return logits.to(torch.promote_types(logits.dtype, torch.float32))     # (an fp64 model's: fp64)
        losses = self.cross_entropy(logits, labels.t(), self.tp_group, self.vocab_size, self.label_smoothing)
        return losses.sum(0)


class GPTChunk(nn.Module):
    """A contiguous slice of the layer list, run by one (virtual) pipeline stage. `rng` (None without
    dropout) is keyed before each layer's forward in training (RNGTracker.seed)."""

    def __init__(self, layers: list, rng: RNGTracker | None = None, compile_blocks: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.rng = rng
        self.has_embedding = isinstance(layers[0], Embedding)
        self.has_head = isinstance(layers[-1], Head)
        self.blocks = [layer for layer in layers if isinstance(layer, Block)]   # contiguous (a plain list)
        self.blocks_compiled = compile_blocks and bool(self.blocks)
        if self.blocks_compiled:                # ParallelContext.compile_chunks: the blocks as one graph
            self._blocks = torch.compile(self._blocks, dynamic=False)

    def _key(self, layer: Layer, sample: int | None) -> None:
        if sample is not None:
            self.rng.seed(sample, layer.index)

    def _blocks(self, x, cache, sample=None):
        r = None                           # a block's output not yet added to the residual stream x
        for block in self.blocks:
            self._key(block, sample)
            x, r = block(x, r, cache)
        return x, r

    def forward(self, x, labels=None, cache: KVCache | None = None, sample: int | None = None):
        """Embedding, blocks, head, those this chunk has: the head's losses (labels: each sample's, [b])
        or logits (no labels), else the last activation. `sample`: the global index of the microbatch's first
        sample, which keys the dropout masks in training (None: the streams run on as they are)."""
        if self.rng is None or not self.training:
            sample = None
        if self.has_embedding:
            self._key(self.layers[0], sample)
            x = self.layers[0](x, cache)
        x, r = self._blocks(x, cache, sample)     # (sample is None where the blocks are one compiled graph)
        if self.has_head:
            return self.layers[-1](x, labels, r)
        return x if r is None else x + r

    def param_users(self) -> list:
        """The modules, in forward order, whose forward pre-hooks run eagerly before their parameters are
        used (ZeRO-1's GradBuffer.wait_before): the layers, or the chunk itself when its blocks are one
        compiled graph (a hook inside it would be traced into the graph)."""
        return [self] if self.blocks_compiled else list(self.layers)

    def named_global_parameters(self):
        """(global name, parameter) for every parameter, the shared word embedding once."""
        seen = set()
        for layer in self.layers:
            for local, p in layer.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield layer.global_name(local), p


def build_chunks(m: ModelConfig, ctx: ParallelContext, stage_layers: list, seed: int | None,
                 device: torch.device) -> list:
    """Build this rank's model chunks. `stage_layers[c]` = (first, last+1) indices into the
    layer list [Embedding, Block_1..L, Head] for local chunk c. Parameters are initialised to
    this rank's slice of their full, layout-independent value (of (seed, global name) alone);
    on the meta device (memory planning), or with seed None (weights a checkpoint gives next), they are left
    uninitialised."""
    L = m.num_layers
    embedding = None
    chunks = []
    for first, end in stage_layers:
        layers = []
        for i in range(first, end):
            if i == 0:
                embedding = Embedding(m, ctx, device)
                layers.append(embedding)
            elif i == L + 1:
                shared = embedding.word_embeddings.weight if embedding is not None else None
                layers.append(Head(m, ctx, shared, device))
            else:
                layers.append(Block(i - 1, m, ctx, device))
        chunks.append(GPTChunk(layers, ctx.rng if m.dropout else None, ctx.compile_chunks(m.dropout)))
    if torch.device(device).type != "meta" and seed is not None:
        initialize(chunks, ctx.tp_group, seed)
    return chunks


@torch.no_grad()
def initialize(chunks: list, tp_group: Group, seed: int) -> None:
    for chunk in chunks:
        for name, p in chunk.named_global_parameters():
            full = init_full(name, full_shape(p, tp_group.size), p.spec, seed)
            p.copy_(shard(full, p.spec, tp_group.size, tp_group.rank))
