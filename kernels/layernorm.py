"""Fused LayerNorm over the last dimension (Triton), its autograd wrapper and a drop-in module.

For each row x of length N (all math in fp32, whatever the input dtype):
    mean = sum(x) / N,  rstd = 1 / sqrt(sum((x - mean)^2) / N + eps),  xhat = (x - mean) * rstd
    y = xhat * w + b
Backward, with g = dy * w:
    dx = rstd * (g - mean(g) - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat,   db = sum over rows of dy
Forward saves x, mean and rstd (fp32, one per row); xhat is recomputed in backward.
dw/db are summed in fp32: each backward program owns one row (or one chunk of a row) of a
[programs, N] partial buffer (no locks, deterministic); the partials are summed afterwards.

Rows up to MAX_FUSED_N wide are held whole in registers (several narrow rows per program);
wider rows take the looped kernels, which walk the row in LOOP_BLOCK_N chunks.
"""
import functools
import os

import torch
import triton
import triton.language as tl

MAX_FUSED_N = 16384   # widest row (power-of-two block) kept entirely in registers
LOOP_BLOCK_N = 8192   # chunk width of the looped kernels used above MAX_FUSED_N
# as @triton.jit reads it at import: kernels below are interpreted (CPU) when set
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


@triton.jit
def _fwd_fused(X, Y, W, B, Mean, Rstd, stride_x, stride_y, n_rows, n_cols, eps,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < n_rows, cols < n_cols
    ok = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    x = tl.load(X + rows64 * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    xc = tl.where(ok, x - mean[:, None], 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=1) / n_cols + eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + rows64 * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)
    tl.store(Mean + rows, mean, mask=row_ok)
    tl.store(Rstd + rows, rstd, mask=row_ok)


@triton.jit
def _fwd_looped(X, Y, W, B, Mean, Rstd, stride_x, stride_y, n_cols, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0)
    x_row = X + row.to(tl.int64) * stride_x
    y_row = Y + row.to(tl.int64) * stride_y
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        acc += tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    mean = tl.sum(acc, axis=0) / n_cols
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):  # second pass: exact centred variance
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_row + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        xc = tl.where(cols < n_cols, x - mean, 0.0)
        acc += xc * xc
    rstd = tl.rsqrt(tl.sum(acc, axis=0) / n_cols + eps)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        x = tl.load(x_row + cols, mask=col_ok, other=0.0).to(tl.float32)
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(y_row + cols, ((x - mean) * rstd * w + b).to(Y.dtype.element_ty), mask=col_ok)
    tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)


@triton.jit
def _bwd_fused(X, DY, DX, W, Mean, Rstd, DW, DB, stride_x, stride_dy, stride_dx,
               n_rows, n_cols, rows_per_program, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid * rows_per_program
    last = tl.minimum(first + rows_per_program, n_rows)
    for start in range(first, last, BLOCK_M):
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < last
        ok = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)[:, None]
        x = tl.load(X + rows64 * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows64 * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        mean = tl.load(Mean + rows, mask=row_ok, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
        xhat = (x - mean[:, None]) * rstd[:, None]  # dy = 0 outside the tile: no effect there
        g = dy * w[None, :]
        c1 = tl.sum(g, axis=1) / n_cols
        c2 = tl.sum(g * xhat, axis=1) / n_cols
        dx = (g - c1[:, None] - xhat * c2[:, None]) * rstd[:, None]
        tl.store(DX + rows64 * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=ok)
        dw += tl.sum(dy * xhat, axis=0)
        db += tl.sum(dy, axis=0)
    tl.store(DW + pid * n_cols + cols, dw, mask=col_ok)
    tl.store(DB + pid * n_cols + cols, db, mask=col_ok)


@triton.jit
def _bwd_row_sums(X, DY, W, Mean, Rstd, C1, C2, stride_x, stride_dy, n_cols, BLOCK_N: tl.constexpr):
    """Wide rows, pass 1 (one row per program): c1 = mean(g), c2 = mean(g * xhat)."""
    row = tl.program_id(0)
    x_row = X + row.to(tl.int64) * stride_x
    dy_row = DY + row.to(tl.int64) * stride_dy
    mean, rstd = tl.load(Mean + row), tl.load(Rstd + row)
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_gx = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        x = tl.load(x_row + cols, mask=col_ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + cols, mask=col_ok, other=0.0).to(tl.float32)
        g = dy * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc_g += g
        acc_gx += g * (x - mean) * rstd
    tl.store(C1 + row, tl.sum(acc_g, axis=0) / n_cols)
    tl.store(C2 + row, tl.sum(acc_gx, axis=0) / n_cols)


@triton.jit
def _bwd_looped(X, DY, DX, W, Mean, Rstd, C1, C2, DW, DB, stride_x, stride_dy, stride_dx,
                n_rows, n_cols, rows_per_program, BLOCK_N: tl.constexpr):
    """Wide rows, pass 2: program (i, j) owns rows [i*rows_per_program, ...) of column chunk j,
    so its dw/db partials stay in registers over the rows and are written once."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid * rows_per_program
    for row in range(first, tl.minimum(first + rows_per_program, n_rows)):
        row64 = tl.cast(row, tl.int64)  # (the interpreter hands loop indices over as ints)
        x = tl.load(X + row64 * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + row64 * stride_dy + cols, mask=col_ok, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + row)
        xhat = (x - tl.load(Mean + row)) * rstd
        dx = (dy * w - tl.load(C1 + row) - xhat * tl.load(C2 + row)) * rstd
        tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=col_ok)
        dw += dy * xhat
        db += dy
    tl.store(DW + pid * n_cols + cols, dw, mask=col_ok)
    tl.store(DB + pid * n_cols + cols, db, mask=col_ok)


def _config(n_rows: int, n_cols: int):
    """(BLOCK_M rows, BLOCK_N cols, num_warps, looped) for an [n_rows, n_cols] problem."""
    block_n = triton.next_power_of_2(n_cols)
    looped = block_n > MAX_FUSED_N
    if looped:
        block_n, block_m = LOOP_BLOCK_N, 1
    elif _INTERPRET:  # programs run one after another (~1 ms each): about 4 big tiles
        block_m = min(triton.next_power_of_2(triton.cdiv(n_rows, 4)), max(1, 2**16 // block_n))
    else:  # narrow rows are grouped so a program touches at least 2048 elements
        block_m = max(1, 2048 // block_n)
    num_warps = min(32, max(4, block_m * block_n // 512))  # ~16 fp32 values per thread
    return block_m, block_n, num_warps, looped


def _rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """[..., N] -> a 2-D [rows, N] view with unit column stride (copies only if it must)."""
    t = t.reshape(-1, n_cols)
    return t if t.stride(1) == 1 else t.contiguous()


def _check_device(x: torch.Tensor):
    if not x.is_cuda and not _INTERPRET:
        raise RuntimeError("Triton kernels need CUDA tensors; on CPU set TRITON_INTERPRET=1 "
                           "before importing kernels.layernorm.")


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _backward_programs(n_rows: int, block_m: int, chunks: int, num_warps: int,
                       device: torch.device) -> int:
    """Backward row groups (each has `chunks` column chunks): enough programs to fill the GPU
    (~16 warps per SM) but >= 16 rows each, so the fp32 dw/db partials (8 bytes per column
    per group) stay under ~10% of the x/dy/dx traffic."""
    tiles = triton.cdiv(n_rows, block_m)
    if _INTERPRET:
        return min(tiles, 4)
    fill = triton.cdiv(_sm_count(device) * max(1, 16 // num_warps), chunks)
    return max(1, min(tiles, fill, n_rows // 16))


class _LayerNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        _check_device(x)
        n = x.shape[-1]
        x2 = _rows(x, n)
        m = x2.shape[0]
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        mean = torch.empty(m, dtype=torch.float32, device=x.device)
        rstd = torch.empty(m, dtype=torch.float32, device=x.device)
        block_m, block_n, num_warps, looped = _config(m, n)
        if looped:
            _fwd_looped[(m,)](x2, y, weight, bias, mean, rstd, x2.stride(0), y.stride(0), n, eps,
                              BLOCK_N=block_n, num_warps=num_warps)
        else:
            _fwd_fused[(triton.cdiv(m, block_m),)](
                x2, y, weight, bias, mean, rstd, x2.stride(0), y.stride(0), m, n, eps,
                BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        x2, weight, mean, rstd = ctx.saved_tensors
        m, n = x2.shape
        dy2 = _rows(dy, n)
        dx = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
        block_m, block_n, num_warps, looped = _config(m, n)
        chunks = triton.cdiv(n, block_n)  # 1 unless looped
        programs = _backward_programs(m, block_m, chunks, num_warps, x2.device)
        rows_per_program = triton.cdiv(m, programs)
        dw = torch.empty((programs, n), dtype=torch.float32, device=x2.device)
        db = torch.empty((programs, n), dtype=torch.float32, device=x2.device)
        strides = (x2.stride(0), dy2.stride(0), dx.stride(0))
        if looped:
            c1 = torch.empty(m, dtype=torch.float32, device=x2.device)
            c2 = torch.empty(m, dtype=torch.float32, device=x2.device)
            _bwd_row_sums[(m,)](x2, dy2, weight, mean, rstd, c1, c2, strides[0], strides[1], n,
                                BLOCK_N=block_n, num_warps=num_warps)
            _bwd_looped[(programs, chunks)](x2, dy2, dx, weight, mean, rstd, c1, c2, dw, db, *strides,
                                            m, n, rows_per_program, BLOCK_N=block_n, num_warps=num_warps)
        else:
            _bwd_fused[(programs,)](x2, dy2, dx, weight, mean, rstd, dw, db, *strides, m, n,
                                    rows_per_program, BLOCK_M=block_m, BLOCK_N=block_n,
                                    num_warps=num_warps)
        return dx.view(ctx.x_shape), dw.sum(0).to(weight.dtype), db.sum(0).to(weight.dtype), None


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm of x [..., N] over its last dim with weight, bias [N]; returns x's dtype and shape."""
    return _LayerNormFn.apply(x, weight, bias, float(eps))


class FusedLayerNorm(torch.nn.Module):
    """Drop-in for torch.nn.LayerNorm(hidden_size, eps): same `weight`/`bias` parameters and
    state_dict keys, forward through the fused Triton kernels."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype=None, device=None):
        super().__init__()
        self.normalized_shape = (hidden_size,)
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))
        self.bias = torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=device))
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)
        torch.nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}"
