"""Fused scaled, masked softmax over the last dim of attention scores x [b, heads, sq, sk].

    y = softmax(scale * x + mask)        (scale first; masked positions get -inf, then y = 0)
Masks: `causal=True` masks key j > i + (sk - sq) for query row i (bottom-right aligned as in
Megatron; for sq == sk simply j > i) without any mask tensor; `mask` is a bool tensor
broadcastable to x (True = masked out), e.g. [b or 1, 1 or heads, sq, sk]; both may be combined.
A fully masked row gives zeros, not NaN. Math is fp32 for every input dtype.
Backward uses only the saved output: dx = scale * y * (dy - sum(dy * y)).
With `causal`, neither pass reads x, y or dy above the diagonal (about half of them for sq == sk).
Rows longer than MAX_SK fall back (with a one-time warning) to torch_scaled_masked_softmax,
the pure-torch reference with the same semantics.
"""
import os
import warnings
from typing import Optional

import torch
import triton
import triton.language as tl

MAX_SK = 16384  # longest row the kernels hold in registers; longer rows use the torch path
# as @triton.jit reads it at import: kernels below are interpreted (CPU) when set
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")
_warned_fallback = False


@triton.jit
def _fwd(X, Y, Mask, sx_b, sx_h, sx_q, sm_b, sm_h, sm_q, sm_k, n_rows, n_heads, sq, sk, scale,
         CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # flat (b, head, query) index
    q = rows % sq
    h = (rows // sq) % n_heads
    b = (rows // sq) // n_heads
    cols = tl.arange(0, BLOCK_N)
    inside = (rows < n_rows)[:, None] & (cols < sk)[None, :]
    keep = inside  # positions that take part in the softmax
    if CAUSAL:  # x above the diagonal is never read
        keep = keep & (cols[None, :] <= (q + sk - sq)[:, None])
    x_off = b.to(tl.int64) * sx_b + h.to(tl.int64) * sx_h + q.to(tl.int64) * sx_q
    x = tl.load(X + x_off[:, None] + cols[None, :], mask=keep, other=0.0).to(tl.float32)
    if HAS_MASK:  # x is not masked by the mask tensor's values: its load need not wait for them
        m_off = b.to(tl.int64) * sm_b + h.to(tl.int64) * sm_h + q.to(tl.int64) * sm_q
        masked = tl.load(Mask + m_off[:, None] + cols[None, :] * sm_k, mask=keep, other=1)
        keep = keep & (masked == 0)
    z = tl.where(keep, x * scale, float("-inf"))
    z_max = tl.max(z, axis=1)
    z_max = tl.where(z_max == float("-inf"), 0.0, z_max)  # fully masked row: exp(-inf - 0) = 0
    e = tl.exp(z - z_max[:, None])
    total = tl.sum(e, axis=1)
    y = e * (1.0 / tl.where(total == 0.0, 1.0, total))[:, None]
    y_off = rows.to(tl.int64)[:, None] * sk + cols[None, :]
    tl.store(Y + y_off, y.to(Y.dtype.element_ty), mask=inside)


@triton.jit
def _bwd(Y, DY, DX, n_rows, sq, sk, scale, CAUSAL: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    inside = (rows < n_rows)[:, None] & (cols < sk)[None, :]
    live = inside
    if CAUSAL:  # y = 0 above the diagonal, so dx = 0 there: skip reading y and dy
        live = live & (cols[None, :] <= (rows % sq + sk - sq)[:, None])
    off = rows.to(tl.int64)[:, None] * sk + cols[None, :]
    y = tl.load(Y + off, mask=live, other=0.0).to(tl.float32)
    dy = tl.load(DY + off, mask=live, other=0.0).to(tl.float32)
    dot = tl.sum(y * dy, axis=1)
    dx = scale * y * (dy - dot[:, None])
    tl.store(DX + off, dx.to(DX.dtype.element_ty), mask=inside)


def _config(n_rows: int, sk: int):
    """(BLOCK_M rows, BLOCK_N cols, num_warps): one whole row per program for long rows,
    short rows grouped so a program touches at least 2048 elements."""
    block_n = triton.next_power_of_2(sk)
    if _INTERPRET:  # programs run one after another (~1 ms each): about 4 big tiles
        block_m = min(triton.next_power_of_2(triton.cdiv(n_rows, 4)), max(1, 2**16 // block_n))
    else:
        block_m = max(1, 2048 // block_n)
    num_warps = min(32, max(4, block_m * block_n // 512))  # ~16 fp32 values per thread
    return block_m, block_n, num_warps


def _check_device(x: torch.Tensor):
    if not x.is_cuda and not _INTERPRET:
        raise RuntimeError("Triton kernels need CUDA tensors; on CPU set TRITON_INTERPRET=1 "
                           "before importing kernels.softmax.")


class _SoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale, causal, mask):
        _check_device(x)
        if x.stride(-1) != 1:
            x = x.contiguous()
        bsz, heads, sq, sk = x.shape
        n_rows = bsz * heads * sq
        y = torch.empty((bsz, heads, sq, sk), dtype=x.dtype, device=x.device)
        # bool -> uint8 (same bytes); without a mask, y stands in as an unused pointer
        m = mask.expand(x.shape).view(torch.uint8) if mask is not None else y
        m_strides = m.stride() if mask is not None else (0, 0, 0, 0)
        block_m, block_n, num_warps = _config(n_rows, sk)
        _fwd[(triton.cdiv(n_rows, block_m),)](
            x, y, m, x.stride(0), x.stride(1), x.stride(2), *m_strides, n_rows, heads, sq, sk, scale,
            CAUSAL=causal, HAS_MASK=mask is not None, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps)
        ctx.save_for_backward(y)
        ctx.scale, ctx.causal = scale, causal
        return y

    @staticmethod
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        dy = dy.contiguous()
        dx = torch.empty_like(y)
        sq, sk = y.shape[-2:]
        n_rows = y.numel() // sk
        block_m, block_n, num_warps = _config(n_rows, sk)
        _bwd[(triton.cdiv(n_rows, block_m),)](y, dy, dx, n_rows, sq, sk, ctx.scale, CAUSAL=ctx.causal,
                                               BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
        return dx, None, None, None


def _check(x: torch.Tensor, mask: Optional[torch.Tensor]):
    if x.dim() != 4:
        raise ValueError(f"expected attention scores [b, heads, sq, sk], got shape {tuple(x.shape)}")
    if mask is not None and mask.dtype != torch.bool:
        raise TypeError(f"mask must be a bool tensor (True = masked out), got {mask.dtype}")


def scaled_masked_softmax(x: torch.Tensor, scale: float, causal: bool = False,
                          mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(scale * x + mask) over the last dim of x [b, heads, sq, sk] (see module doc);
    returns x's dtype, autograd-aware. Rows longer than MAX_SK use the torch reference."""
    global _warned_fallback
    _check(x, mask)
    if x.shape[-1] > MAX_SK:
        if not _warned_fallback:
            warnings.warn(f"scaled_masked_softmax: sk={x.shape[-1]} > {MAX_SK}, "
                          "using the (slower) torch implementation", stacklevel=2)
            _warned_fallback = True
        return torch_scaled_masked_softmax(x, scale, causal, mask)
    return _SoftmaxFn.apply(x, float(scale), bool(causal), mask)


def torch_scaled_masked_softmax(x: torch.Tensor, scale: float, causal: bool = False,
                                mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Pure-torch reference of scaled_masked_softmax, same semantics (fp32 math, masked -> 0)."""
    _check(x, mask)
    sq, sk = x.shape[-2:]
    masked = mask
    if causal:
        upper = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(sk - sq + 1)
        masked = upper if masked is None else masked | upper
    z = x.float() * scale
    if masked is None:
        return torch.softmax(z, dim=-1).to(x.dtype)
    # a fully masked row is all -inf -> NaN after softmax; every entry of it is masked -> 0
    y = torch.softmax(z.masked_fill(masked, float("-inf")), dim=-1).masked_fill(masked, 0.0)
    return y.to(x.dtype)
