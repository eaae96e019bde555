"""Fused causal attention in Triton: the FlashAttention-2 algorithm (Dao 2023). The kernels are in
attention_kernels.py; this module launches them, wraps them for autograd and holds the references.

    o = dropout(softmax(scale * q k^T + causal mask)) v          q, k, v, o: [b, heads, s, d]

Forward: each program owns BLOCK_M query rows of one (batch, head) and walks the key blocks
with an online softmax (running max m and sum l, in fp32), so the [s, s] scores never reach
memory; it stores o and the log-sum-exp in base 2 (the kernels use exp2 of scores scaled by log2(e)):
lse = m + log2(l) = log2(e) logsumexp(scale * q k^T) (fp32, [b*heads, s]).
Backward recomputes P = exp2(log2(e) scale * q k^T - lse) block by block:
    delta_i = sum_d do_i o_i                        (a small pre-pass)
    dv = Z^T do,  dZ = do v^T,  dP = dZ * keep / (1 - p_drop),  dS = P * (dP - delta)
    dk = scale * dS^T q,  dq = scale * dS k         (Z = P * keep / (1 - p_drop))
one kernel owning a key block (dk, dv), one owning a query block (dq): no atomics, deterministic.
Dropout on the probabilities draws keep = philox(seed, row * s + col) >= p_drop, the same in the
backward and in a recomputation; the seed is drawn from torch's current generator on q's device,
so the RNG tracker's streams (and activation recompute, which replays them) choose the mask.
Math in fp32 whatever the input dtype (fp16/bf16 operands of the matmuls, fp32 accumulation;
fp32 inputs use IEEE fp32 matmuls, not TF32). Causal masking is top-left aligned (key j <= query i).
Head dims up to MAX_HEAD_DIM (128); b x heads up to MAX_BATCH_HEADS (65535, CUDA's limit on grid axis 1,
which holds them).

Blocks entirely below the diagonal and inside the sequence skip the mask arithmetic; only the
diagonal blocks and a ragged last block pay for it. Outputs come back in the layout the model
wants next: o as a [b, heads, s, d] view of an [s, b, heads, d] buffer, and with the packed entry
point `flash_attention_qkv` (qkv [s, b, 3 * heads * d] -> [s, b, heads * d]) the gradient is one
[s, b, 3 * heads * d] tensor, with no permute or concatenation copies around the kernels.
"""
import math

import torch

from .attention_kernels import _bwd_delta, _bwd_dkdv, _bwd_dq, _fwd, _keep_mask
from . import (HOPPER, FP_FUSION, attention_unsupported, cdiv, check_device, compute_capability, interpreting,
               next_power_of_2)

# as @triton.jit reads it at import: the kernels are interpreted (CPU) when set
_INTERPRET = interpreting()
LOG2E = 1.4426950408889634


# ----------------------------------------------------------------------------------- launching
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head dim on a GPU, 16-bit inputs: of the
# configurations `tools/sweep_attention.py --quick` timed on an H100 (2026-11-24), the fastest that compiles
# for sm_90 without spilling registers (tools/check_kernels.py). The sweep's fastest dk/dv (both head dims)
# and d = 64 dq spill (8-424 B a thread): fwd+bwd with them 0.798 ms at (16, 12, 1024, 64), 1.635 at
# (8, 16, 2048, 128), against 0.871 and 2.034 with the earlier table (fwd (128, 64, 4|8, 3), d = 128 dq 2 stages).
# dk/dv at head dims 80 to 112 (masked in 128-wide tiles) has a row of its own, untimed: the d = 128 rows reach 255
# registers there and spill 8 B a thread under Triton 3.6 (the GPU machine's; not 3.9), these do not (check_kernels)
GPU_CONFIGS = {
    "fwd": {64: (64, 64, 4, 3), 128: (64, 64, 4, 3)},
    "dkdv": {64: (64, 128, 8, 3), 112: (16, 128, 8, 2), 128: (32, 128, 8, 2)},
    "dq": {64: (128, 64, 8, 3), 128: (128, 64, 8, 3)},
}
# with dropout (the Philox draws take registers too): d = 64 as timed by the sweep with `--dropout 0.1` (the
# fastest fwd and dq; its fastest dk/dv, (64, 64, 4, 3), spills), d = 128 untimed (the sweep ran out of time):
# configurations that compile without spills on sm_90
DROPOUT_CONFIGS = {
    "fwd": {64: (64, 64, 4, 3), 128: (128, 64, 8, 3)},
    "dkdv": {64: (32, 128, 8, 2), 112: (16, 32, 4, 1),    # 112: (16, 64, 4, 1) spills 8 B on Triton 3.6, causal
             128: (16, 64, 4, 1)},                           # 128: (16, 128, 8, 1) spills 24 B on Triton 3.6
    "dq": {64: (64, 32, 4, 3), 128: (128, 32, 8, 2)},
}
# fp32 inputs (tests, fp32 runs) take IEEE fp32 dots on the CUDA cores, with tiles of twice the bytes:
# small blocks, so registers and shared memory fit (speed is not the point there); 32 x 32 spills at d = 128
FP32_CONFIGS = {64: (32, 32, 8, 1), 128: (16, 16, 4, 1)}
# under the interpreter: small blocks, so small test shapes still cover several blocks and ragged ends,
# oriented as on the GPU (dk/dv: fewer query rows than keys per block; fwd and dq: more)
INTERPRET_CONFIGS = {"fwd": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1)}
DELTA_BLOCK_M = 64        # rows per program of the backward's delta pre-pass


def _block_d(d: int) -> int:
    """The kernels' head-dim tile: d rounded up to a power of 2, 16 at least (a dot's least); masked past d."""
    return max(16, next_power_of_2(d))


def _register_bound(kind: str, d: int, cc: int, dropout_p: float, dtype: torch.dtype) -> int:
    """How many times a table's streamed block halves: once for each register load the tables (sized on an H100
    at head dims 64 and 128) do not hold, with which their launches spill (tools/check_kernels.py, --arch sm80):
    - a head dim that is not a multiple of 16: Triton cannot prove its rows 16-byte aligned, so tiles load element
      by element into registers, with no async copy into shared memory;
    - a GPU before Hopper: mma.sync holds both operands in registers, where wgmma reads them from shared memory;
    - there, dropout's Philox draws (DROPOUT_CONFIGS make room for them beside wgmma's operands only), and so in
      fp32's dk/dv on any GPU (IEEE dots on the CUDA cores): at d = 32 with dropout it spilled 8 B on sm_90 under
      Triton 3.7 and 3.8 (torch 2.12's and 2.14's) at 32 queries a block, not at 16 (fp32's forward, so halved,
      spilled 16 B under 3.6 at 16 keys a block, and neither it nor dq spills at 32)."""
    before_hopper = cc < HOPPER
    in_registers = before_hopper or (dtype == torch.float32 and kind == "dkdv")
    return (d % 16 != 0) + before_hopper + (dropout_p > 0 and in_registers)


def _gpu_config(kind: str, dtype: torch.dtype, d: int, dropout_p: float, cc: int) -> tuple:
    """(BLOCK_M, BLOCK_N, warps, stages) of kernel `kind` at head dim d on a GPU of compute capability cc: the
    table's for the dtype, dropout and its smallest head dim >= d, with the block the kernel streams (fwd and
    dq: keys, BLOCK_N; dk/dv: queries, BLOCK_M) halved _register_bound times, to 16 at least (a dot's least).
    fp32 with dropout before Hopper takes 2 stages at least: FP32_CONFIGS has no dropout variant, its streamed block
    is at 16 there already, and with 1 stage each streamed tile goes from global memory through registers into
    shared memory, where 2 copy it asynchronously (cp.async), leaving those registers to the Philox draws. So do
    fp32's forward at a head dim not a multiple of 16 and its dq at one narrower than its tile (_block_d): with 1
    stage ptxas holds them to 128 registers (two blocks an SM) and spills 8 to 32 B on sm_90 (dq at a head dim not a
    multiple of 16 under Triton 3.6; fwd at 40 and 56, dq at 48 under 3.5, torch 2.9's); with 2, no fp32 attention
    launch spills on sm_80 or sm_90 under 3.6 to 3.9, nor on sm_90 under 3.5 (the forward at 80 to 112 stays at 1:
    with 2 it spills 8 B on sm_80 under 3.9). Before Hopper the 16-bit forward at a head dim narrower than its tile
    and dk/dv below 64 take 2 stages at most: with 3 they spilled 8 B on sm_80 under Triton 3.5 (dk/dv at 32, 40 and
    56) and 3.7 (torch 2.12's: the forward at 48, dk/dv at 32); the forward at 32 with 2 spills under 3.8 and 3.9."""
    if dtype == torch.float32:
        table = FP32_CONFIGS
    else:
        table = (DROPOUT_CONFIGS if dropout_p > 0 else GPU_CONFIGS)[kind]
    block_m, block_n, warps, stages = table[min(k for k in table if k >= d)]
    halve = _register_bound(kind, d, cc, dropout_p, dtype)
    if kind == "dkdv":
        block_m = max(16, block_m >> halve)
    else:
        block_n = max(16, block_n >> halve)
    masked = d != _block_d(d)                # the head dim fills its tile in part
    one_stage_spills = kind == "fwd" and d % 16 != 0 or kind == "dq" and masked
    if dtype == torch.float32 and (dropout_p > 0 and cc < HOPPER or one_stage_spills):
        stages = max(stages, 2)
    if cc < HOPPER and (kind == "fwd" and masked or kind == "dkdv" and d < 64):
        stages = min(stages, 2)
    return block_m, block_n, warps, stages


def _config(kind: str, q: torch.Tensor, dropout_p: float) -> tuple:
    """_gpu_config for q's dtype, head dim and device; INTERPRET_CONFIGS under the interpreter."""
    if _INTERPRET:
        return INTERPRET_CONFIGS[kind]
    return _gpu_config(kind, q.dtype, q.shape[-1], dropout_p, compute_capability(q.device))


def _delta_block_m(d: int) -> int:
    """Rows per program of the delta pre-pass: DELTA_BLOCK_M, halved at a head dim that is not a multiple of 16
    (the element-wise loads of 64 rows of 16-bit o and do spill)."""
    return DELTA_BLOCK_M >> (d % 16 != 0)


def _strides(t: torch.Tensor):
    """(batch, head, seq) strides of a [b, heads, s, d] tensor with unit stride on d."""
    return t.stride(0), t.stride(1), t.stride(2)


def _unit_d(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _new_bhsd(b, h, s, d, like: torch.Tensor) -> torch.Tensor:
    """An empty [b, heads, s, d] tensor laid out as [s, b, heads, d] (the model's next layout)."""
    return torch.empty((s, b, h, d), dtype=like.dtype, device=like.device).permute(1, 2, 0, 3)


def _check(q, k, v, dropout_p):
    """q, k, v's shapes, dtypes and dropout. Their device is checked where the kernels launch: torch.compile traces
    this, and torch 2.4's dynamo broke the graph at the device check (the re.match of interpreter_unsupported)."""
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must be [b, heads, s, d] of one shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q, k, v must share one of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p} must be in [0, 1)")
    b, heads, s, d = q.shape
    why = attention_unsupported(d, s, dropout_p, b * heads)
    if why:
        raise ValueError(f"flash_attention {why}")


def _meta(q, causal, dropout_p):
    d = q.shape[-1]
    return dict(CAUSAL=causal, DROPOUT=dropout_p > 0, HEAD_DIM=d, BLOCK_D=_block_d(d),
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                UPCAST=_INTERPRET and q.dtype != torch.float32)


def _forward(q, k, v, o, scale, causal, dropout_p, seed):
    b, h, s, _ = q.shape
    lse = torch.empty((b * h, s), dtype=torch.float32, device=q.device)
    block_m, block_n, warps, stages = _config("fwd", q, dropout_p)
    _fwd[(cdiv(s, block_m), b * h)](
        q, k, v, o, lse, seed, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        h, s, scale * LOG2E, dropout_p, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
        **_meta(q, causal, dropout_p), **FP_FUSION)
    return lse


def _backward(q, k, v, o, lse, do, dq, dk, dv, scale, causal, dropout_p, seed):
    b, h, s, d = q.shape
    meta = _meta(q, causal, dropout_p)
    delta = torch.empty_like(lse)
    rows = _delta_block_m(d)
    _bwd_delta[(cdiv(s, rows), b * h)](o, do, delta, *_strides(o), *_strides(do), h, s,
                                       HEAD_DIM=d, BLOCK_D=meta["BLOCK_D"], BLOCK_M=rows, **FP_FUSION)
    block_m, block_n, warps, stages = _config("dkdv", q, dropout_p)
    _bwd_dkdv[(cdiv(s, block_n), b * h)](
        q, k, v, do, dk, dv, lse, delta, seed, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
        *_strides(dk), *_strides(dv), h, s, scale * LOG2E, scale, dropout_p,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **meta, **FP_FUSION)
    block_m, block_n, warps, stages = _config("dq", q, dropout_p)
    _bwd_dq[(cdiv(s, block_m), b * h)](
        q, k, v, do, dq, lse, delta, seed, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
        *_strides(dq), h, s, scale * LOG2E, scale, dropout_p,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **meta, **FP_FUSION)


def _draw_seed(device, dropout_p):
    """A philox seed from torch's current generator on `device` (a tensor: no host sync)."""
    if dropout_p > 0:
        return torch.randint(0, 2**31 - 1, (1,), device=device, dtype=torch.int64)
    return torch.zeros(1, dtype=torch.int64, device=device)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, dropout_p):
        q, k, v = _unit_d(q), _unit_d(k), _unit_d(v)
        o = _new_bhsd(*q.shape[:3], q.shape[3], q)
        seed = _draw_seed(q.device, dropout_p)
        lse = _forward(q, k, v, o, scale, causal, dropout_p, seed)
        ctx.save_for_backward(q, k, v, o, lse, seed)
        ctx.scale, ctx.causal, ctx.dropout_p = scale, causal, dropout_p
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, seed = ctx.saved_tensors
        dq, dk, dv = (_new_bhsd(*q.shape[:3], q.shape[3], q) for _ in range(3))
        _backward(q, k, v, o, lse, _unit_d(do), dq, dk, dv, ctx.scale, ctx.causal, ctx.dropout_p, seed)
        return dq, dk, dv, None, None, None


def _split_qkv(qkv: torch.Tensor, heads: int):
    """[s, b, 3 * heads * d] -> q, k, v views [b, heads, s, d] (blocks [q heads | k heads | v heads])."""
    s, b, width = qkv.shape
    d = width // (3 * heads)
    return qkv.view(s, b, 3, heads, d).permute(2, 1, 3, 0, 4).unbind(0)


def _qkv_forward(qkv, seed, heads, scale, causal, dropout_p):
    """(o [s, b, heads * d], lse [b * heads, s] fp32, base 2) of a contiguous qkv [s, b, 3 * heads * d]."""
    q, k, v = _split_qkv(qkv, heads)
    o = _new_bhsd(*q.shape[:3], q.shape[3], q)
    lse = _forward(q, k, v, o, scale, causal, dropout_p, seed)
    s, b = qkv.shape[:2]
    return o.permute(2, 0, 1, 3).reshape(s, b, -1), lse          # a view: o is [s, b, heads, d] in memory


def _qkv_backward(qkv, o, lse, do, seed, heads, scale, causal, dropout_p):
    """dqkv [s, b, 3 * heads * d] from the forward's qkv, o, lse, seed and do [s, b, heads * d]."""
    s, b = qkv.shape[:2]
    dqkv = torch.empty_like(qkv)
    (q, k, v), (dq, dk, dv) = _split_qkv(qkv, heads), _split_qkv(dqkv, heads)
    o, do = (t.contiguous().view(s, b, heads, -1).permute(1, 2, 0, 3) for t in (o, do))
    _backward(q, k, v, o, lse, do, dq, dk, dv, scale, causal, dropout_p, seed)
    return dqkv


class _FlashAttentionQKV(torch.autograd.Function):
    """The eager path of flash_attention_qkv (a Python autograd.Function costs about half the host time of a
    custom op's dispatch, which only torch.compile needs)."""

    @staticmethod
    def forward(ctx, qkv, heads, scale, causal, dropout_p):
        check_device(qkv, _INTERPRET, __name__)
        qkv = qkv.contiguous()
        seed = _draw_seed(qkv.device, dropout_p)
        o, lse = _qkv_forward(qkv, seed, heads, scale, causal, dropout_p)
        ctx.save_for_backward(qkv, o, lse, seed)
        ctx.args = heads, scale, causal, dropout_p
        return o

    @staticmethod
    def backward(ctx, do):
        qkv, o, lse, seed = ctx.saved_tensors
        return (_qkv_backward(qkv, o, lse, do, seed, *ctx.args),) + (None,) * 4


# ------------------------------------------------------------------- under torch.compile: custom ops
# The same passes as opaque operators (as kernels/layernorm.py's): a call in dynamo's graph, not a break. The
# dropout seed is drawn outside, in the graph (an input of the op: an op must not draw random numbers itself).
@torch.library.custom_op("megatron_mini::flash_attention_qkv_fwd", mutates_args=())
def _qkv_fwd_op(qkv: torch.Tensor, seed: torch.Tensor, heads: int, scale: float, causal: bool, dropout_p: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    check_device(qkv, _INTERPRET, __name__)
    o, lse = _qkv_forward(qkv.contiguous(), seed, heads, scale, causal, dropout_p)   # (inductor may pick strides)
    return o.contiguous(), lse


@torch.library.custom_op("megatron_mini::flash_attention_qkv_bwd", mutates_args=())
def _qkv_bwd_op(qkv: torch.Tensor, o: torch.Tensor, lse: torch.Tensor, do: torch.Tensor, seed: torch.Tensor,
                heads: int, scale: float, causal: bool, dropout_p: float) -> torch.Tensor:
    return _qkv_backward(qkv.contiguous(), o, lse, do, seed, heads, scale, causal, dropout_p)


@_qkv_fwd_op.register_fake
def _(qkv, seed, heads, scale, causal, dropout_p):
    s, b, width = qkv.shape
    return qkv.new_empty((s, b, width // 3)), qkv.new_empty((b * heads, s), dtype=torch.float32)


@_qkv_bwd_op.register_fake
def _(qkv, o, lse, do, seed, heads, scale, causal, dropout_p):
    return torch.empty_like(qkv, memory_format=torch.contiguous_format)


def _qkv_setup(ctx, inputs, output):
    qkv, seed, *args = inputs
    ctx.save_for_backward(qkv, output[0], output[1], seed)
    ctx.mark_non_differentiable(output[1])
    ctx.args = args


def _qkv_op_grads(ctx, do, dlse):
    qkv, o, lse, seed = ctx.saved_tensors
    return (_qkv_bwd_op(qkv, o, lse, do, seed, *ctx.args),) + (None,) * 5


_qkv_fwd_op.register_autograd(_qkv_op_grads, setup_context=_qkv_setup)


@torch.compiler.disable          # an opaque call under torch.compile (kernels/__init__.py)
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    softmax_scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """dropout(softmax(scale * q k^T [+ causal mask])) v for q, k, v [b, heads, s, d] (any strides
    with unit stride on d); scale defaults to 1/sqrt(d). Returns [b, heads, s, d] in q's dtype
    (a view of an [s, b, heads, d] buffer)."""
    check_device(q, _INTERPRET, __name__)
    _check(q, k, v, dropout_p)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return _FlashAttention.apply(q, k, v, scale, bool(causal), float(dropout_p))


def flash_attention_qkv(qkv: torch.Tensor, heads: int, causal: bool = True, softmax_scale: float | None = None,
                        dropout_p: float = 0.0) -> torch.Tensor:
    """Attention on a fused projection qkv [s, b, 3 * heads * d] (the last dim is [q | k | v], each
    heads x d) -> [s, b, heads * d]; its gradient is one [s, b, 3 * heads * d] tensor."""
    if qkv.dim() != 3 or qkv.shape[-1] % (3 * heads):
        raise ValueError(f"qkv must be [s, b, 3 * heads * d] with heads={heads}, got {tuple(qkv.shape)}")
    q, k, v = _split_qkv(qkv, heads)
    _check(q, k, v, dropout_p)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if torch.compiler.is_compiling():     # (the op makes qkv contiguous)
        return _qkv_fwd_op(qkv, _draw_seed(qkv.device, dropout_p), heads, scale, bool(causal), float(dropout_p))[0]
    return _FlashAttentionQKV.apply(qkv, heads, scale, bool(causal), float(dropout_p))


def torch_attention(q, k, v, causal: bool = True, softmax_scale: float | None = None,
                    keep: torch.Tensor | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Reference: the same math materialising P in q's dtype; `keep` [b, heads, s, s] (bool) is an
    explicit dropout mask (scaled by 1 / (1 - dropout_p)), e.g. from `dropout_keep_mask`."""
    s, d = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    p = torch.softmax(scores, dim=-1)
    if keep is not None:
        p = p * keep / (1.0 - dropout_p)
    return p @ v


def dropout_keep_mask(seed: torch.Tensor, b: int, heads: int, s: int, dropout_p: float) -> torch.Tensor:
    """The keep mask [b, heads, s, s] (bool) the kernels draw from `seed` (for tests)."""
    out = torch.empty((b * heads, s, s), dtype=torch.int8, device=seed.device)
    _keep_mask[(cdiv(s, 32), b * heads)](out, seed, s, dropout_p, BLOCK=32, **FP_FUSION)
    return out.view(b, heads, s, s).bool()
