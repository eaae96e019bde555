"""Fused LayerNorm and residual-add + LayerNorm over the last dimension (Triton), with autograd.

    layer_norm(x, w, b)          y = LN(x)                                          x [..., N]
    add_layer_norm(x, r, w, b)   h = x + r (rounded once to x's dtype), y = LN(h)   -> (h, y)

Per row of length N, statistics in fp32 whatever the dtypes, shifted by the row's first element x0
(so a constant row has mu = 0, xhat = 0 and y = b exactly, and a large mean costs no accuracy):
    mu = sum(x - x0) / N,   rstd = 1 / sqrt(sum((x - x0 - mu)^2) / N + eps)
    xhat = (x - x0 - mu) * rstd,   y = xhat * w + b
Backward, g = dy * w (dh = the gradient of h; none for layer_norm):
    dx = dr = dh + rstd * (g - mean(g) - xhat * mean(g * xhat))
    dw = sum over rows of dy * xhat,   db = sum over rows of dy
The forward saves h (x for layer_norm), mu and rstd; the backward recomputes xhat with the same
operations, so both passes see the same xhat. One kernel per pass: the forward reads x (and r) and
writes y (and h); the backward reads h, dy (and dh) and writes dx.

Forward: BLOCK_M rows per program, whole rows in registers. Backward: about BWD_PROGRAMS_PER_SM
programs per SM; each walks the row tiles pid, pid + programs, ... (loading the next tile before
it works on the current one, so loads stay in flight), keeps its dw/db sums in fp32 registers and
writes one row of a [programs, 2N] fp32 partial buffer; torch sums the partials (no atomics,
deterministic). BLOCK_M and num_warps are autotuned per row width on a GPU (under the interpreter
BLOCK_M gives about 4 row tiles). Rows wider than MAX_FUSED_N (MAX_FUSED_BWD_N for the backward,
which holds more per column) take looped kernels that walk each row in LOOP_BLOCK_N chunks.

Division: Triton's fp32 `/` is approximate on GPUs (div.full.f32), so every per-row statistic
divides with tl.math.div_rn (IEEE round to nearest, as the interpreter does; one per row).
"""
import functools
from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import (HOPPER, FP_FUSION, as_rows, autotune, cdiv, check_device, compute_capability, interpreting,
               launch_tuned, next_power_of_2)

MAX_FUSED_N = 16384       # widest row the forward holds whole in registers
MAX_FUSED_BWD_N = 4096    # the same for the backward (x, dy, dw, db and w per column): at 8192 every
                          # candidate spills (below) or holds a row in too few threads
LOOP_BLOCK_N = 8192       # chunk width of the looped kernels
LOOP_WARPS = 16
BWD_PROGRAMS_PER_SM = 2   # backward programs: each writes one fp32 partial row of dw and db...
MIN_BWD_ROWS = 32         # ...and covers >= this many rows, so partials stay <= ~8% of its traffic
# as @triton.jit reads it at import: kernels below are interpreted (CPU) when set
_INTERPRET = interpreting()


# ----------------------------------------------------------------------------------- configs
# autotune candidates (BLOCK_M rows per tile, num_warps), pruned per row width by candidates
CONFIGS = [triton.Config({"BLOCK_M": m}, num_warps=w) for m in (1, 2, 4, 8, 16, 32, 64, 128, 256)
           for w in (4, 8, 16, 32)]
FWD_TILE, BWD_TILE = (4096, 8192), (2048, 8192)     # elements per tile (BLOCK_M x BLOCK_N)
FWD_PER_THREAD, BWD_PER_THREAD = (8, 32), (8, 16)   # 8: one 16-byte load of 16-bit values per thread
# registers per thread <= base + per element held (sm_90, tools/check_kernels.py: the forward needs up to
# 104 at 32 elements, the backward up to 124 at 8 and 206 at 16); a block of W warps may use at most
# 64 K / (32 W) (<= 255) each, and a config past that spills to local memory
FWD_REGS, BWD_REGS = (24, 2.5), (40, 11)
# where ptxas spills below that model (tools/check_kernels.py, Triton 3.9), fewer elements per thread: 8 in the
# backward of rows at most NARROW_BWD_N wide (16 spill on sm_90: 8 rows of 256 in 4 warps, with a residual), 16 in
# the forward before Hopper (ptxas for sm_80 holds 32 in 64 registers, 4 rows in 4 or 8 warps, and spills)
NARROW_BWD_N, NARROW_BWD_PER_THREAD, PRE_HOPPER_FWD_PER_THREAD = 256, 8, 16
# forward candidates within that model that ptxas holds to fewer registers than the block may have (one more block
# an SM) and spills 8 B a thread (tools/check_kernels.py, sm_90, Triton 3.8: torch 2.14's; not 3.6, 3.7 or 3.9),
# (BLOCK_M, BLOCK_N, warps): each tile keeps its candidates in other warps
FWD_SPILLING = {(32, 128, 8), (2, 4096, 32), (1, 8192, 16)}
# the autotuners' one config under the interpreter, which cannot time several (reached only when tests make
# the wrappers take their GPU path; otherwise _launch picks BLOCK_M there)
INTERPRET_CONFIGS = [triton.Config({"BLOCK_M": 2}, num_warps=4)]


def fitting_configs(configs, block_n: int, tile: tuple, per_thread: tuple, regs: tuple) -> list:
    """The configs whose tile (BLOCK_M rows of block_n) holds tile[0]..tile[1] elements (one row when
    wider) at per_thread[0]..per_thread[1] elements per thread, enough bytes in flight per program,
    and whose registers, regs[0] + regs[1] per element, fit the per-thread share of the block (no spill).
    The fallback (rows of 1 or 2) is held to the same bounds by tests/test_kernels.py."""
    lo, hi = min(tile[0], block_n), max(tile[1], block_n)

    def fits(c):
        elems = c.kwargs["BLOCK_M"] * block_n
        per = elems // (32 * c.num_warps)
        return (lo <= elems <= hi and per_thread[0] <= per <= per_thread[1]
                and regs[0] + regs[1] * per <= min(255, 65536 // (32 * c.num_warps)))

    fit = [c for c in configs if fits(c)]
    most = min(tile[0], 32 * 4 * per_thread[1])         # (the fallback's 4 warps at their most elements a thread)
    return fit or [triton.Config({"BLOCK_M": max(1, most // block_n)}, num_warps=4)]


def budget(backward: bool, block_n: int, cc: int = HOPPER) -> tuple:
    """(tile, per_thread, regs): what fitting_configs holds the forward's or the backward's configs to at rows of
    block_n on a GPU of compute capability cc."""
    if backward:
        most = NARROW_BWD_PER_THREAD if block_n <= NARROW_BWD_N else BWD_PER_THREAD[1]
        return BWD_TILE, (BWD_PER_THREAD[0], most), BWD_REGS
    most = PRE_HOPPER_FWD_PER_THREAD if cc < HOPPER else FWD_PER_THREAD[1]
    return FWD_TILE, (FWD_PER_THREAD[0], most), FWD_REGS


def candidates(backward: bool, block_n: int, cc: int = HOPPER, configs=CONFIGS) -> list:
    """The configs the forward's or the backward's autotuner times at rows of block_n on a GPU of compute capability
    cc: those of `configs` that fitting_configs keeps within the budget, less the forward's FWD_SPILLING."""
    if not backward:
        configs = [c for c in configs if (c.kwargs["BLOCK_M"], block_n, c.num_warps) not in FWD_SPILLING]
    return fitting_configs(configs, block_n, *budget(backward, block_n, cc))


def _autotune(key, backward: bool):
    """kernels.autotune (timings cached on disk where triton can) over the candidates at the row width, BLOCK_N,
    on the GPU of the rows X; under the interpreter its one config (a single config is neither pruned nor timed)."""
    def prune(configs, named_args, **kwargs):
        x = named_args["X"]
        cc = compute_capability(x.device) if x.is_cuda else HOPPER    # (tests that take the GPU path on a CPU)
        return candidates(backward, kwargs["BLOCK_N"], cc, configs)

    return autotune(INTERPRET_CONFIGS if _INTERPRET else CONFIGS, key, prune)


# ----------------------------------------------------------------------------------- kernels
@triton.jit
def _load_h(x_ptrs, r_ptrs, mask, HAS_RESIDUAL: tl.constexpr):
    """x, or h = x + r rounded once to x's dtype (fp32 add, as torch does): raw, not upcast."""
    x = tl.load(x_ptrs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptrs.dtype.element_ty)
    return x


@_autotune(["n_cols", "HAS_RESIDUAL"], backward=False)
@triton.jit
def _fwd(X, R, H, Y, W, B, Mu, Rstd, stride_x, stride_r, stride_h, stride_y, n_rows, n_cols, eps,
         HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Rows [pid * BLOCK_M, ...): y (and h), mu, rstd. R and H are unused without a residual."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < n_rows, cols < n_cols
    ok = row_ok[:, None] & col_ok[None, :]
    r64 = rows.to(tl.int64)
    x = _load_h(X + r64[:, None] * stride_x + cols[None, :], R + r64[:, None] * stride_r + cols[None, :], ok,
                HAS_RESIDUAL)
    if HAS_RESIDUAL:
        tl.store(H + r64[:, None] * stride_h + cols[None, :], x, mask=ok)
    x0 = _load_h(X + r64 * stride_x, R + r64 * stride_r, row_ok, HAS_RESIDUAL).to(tl.float32)  # same line: cached
    n = tl.cast(n_cols, tl.float32)
    xs = tl.where(ok, x.to(tl.float32) - x0[:, None], 0.0)
    mu = tl.math.div_rn(tl.sum(xs, axis=1), n)
    xc = tl.where(ok, xs - mu[:, None], 0.0)
    # approximate rsqrt (rsqrt.approx, ~1 ulp) as in torch's kernels: far below the output's rounding
    rstd = tl.rsqrt(tl.math.div_rn(tl.sum(xc * xc, axis=1), n) + eps)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + r64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=ok)
    tl.store(Mu + rows, mu, mask=row_ok)
    tl.store(Rstd + rows, rstd, mask=row_ok)


@triton.jit
def _bwd_tile(X, DY, DH, Mu, Rstd, tile, cols, col_ok, n_rows, stride_x, stride_dy, stride_dh,
              HAS_DRES: tl.constexpr, BLOCK_M: tl.constexpr):
    """Raw loads of row tile `tile` (rows past n_rows masked off, nothing read): x, x0, dy, dh, mu, rstd."""
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    ok = row_ok[:, None] & col_ok[None, :]
    r64 = rows.to(tl.int64)
    x = tl.load(X + r64[:, None] * stride_x + cols[None, :], mask=ok, other=0.0)
    x0 = tl.load(X + r64 * stride_x, mask=row_ok, other=0.0)
    dy = tl.load(DY + r64[:, None] * stride_dy + cols[None, :], mask=ok, other=0.0)
    if HAS_DRES:
        dh = tl.load(DH + r64[:, None] * stride_dh + cols[None, :], mask=ok, other=0.0)
    else:  # a placeholder, never read
        dh = dy
    mu = tl.load(Mu + rows, mask=row_ok, other=0.0)
    rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
    return x, x0, dy, dh, mu, rstd


@_autotune(["n_cols", "HAS_DRES"], backward=True)
@triton.jit
def _bwd(X, DY, DH, DX, W, Mu, Rstd, Part, stride_x, stride_dy, stride_dh, stride_dx, n_rows, n_cols,
         HAS_DRES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx (+ dh) for row tiles pid, pid + programs, ...; this program's dw, db sums -> Part[pid] ([2N])."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    n = tl.cast(n_cols, tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)   # 2-D: no cross-thread reduction until the end
    db = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    x_n, x0_n, dy_n, dh_n, mu_n, rstd_n = _bwd_tile(X, DY, DH, Mu, Rstd, pid, cols, col_ok, n_rows,
                                                    stride_x, stride_dy, stride_dh, HAS_DRES, BLOCK_M)
    for tile in range(pid, tl.cdiv(n_rows, BLOCK_M), programs):
        x, x0, dy, dh, mu, rstd = x_n, x0_n, dy_n, dh_n, mu_n, rstd_n
        # the next tile's loads fly while this one is computed
        x_n, x0_n, dy_n, dh_n, mu_n, rstd_n = _bwd_tile(X, DY, DH, Mu, Rstd, tile + programs, cols, col_ok,
                                                        n_rows, stride_x, stride_dy, stride_dh, HAS_DRES, BLOCK_M)
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        ok = (rows < n_rows)[:, None] & col_ok[None, :]
        xhat = tl.where(ok, (x.to(tl.float32) - x0.to(tl.float32)[:, None] - mu[:, None]) * rstd[:, None], 0.0)
        dy = dy.to(tl.float32)
        g = dy * w[None, :]
        c1 = tl.math.div_rn(tl.sum(g, axis=1), n)
        c2 = tl.math.div_rn(tl.sum(g * xhat, axis=1), n)
        dx = (g - c1[:, None] - xhat * c2[:, None]) * rstd[:, None]
        if HAS_DRES:
            dx += dh.to(tl.float32)
        tl.store(DX + rows.to(tl.int64)[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=ok)
        dw += dy * xhat
        db += dy
    part = Part + pid.to(tl.int64) * 2 * n_cols
    tl.store(part + cols, tl.sum(dw, axis=0), mask=col_ok)
    tl.store(part + n_cols + cols, tl.sum(db, axis=0), mask=col_ok)


@triton.jit
def _fwd_looped(X, R, H, Y, W, B, Mu, Rstd, stride_x, stride_r, stride_h, stride_y, n_cols, eps,
                HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Wide rows, one per program, three passes over chunks (h recomputed from x, r in each)."""
    row = tl.program_id(0).to(tl.int64)
    x_row, r_row = X + row * stride_x, R + row * stride_r
    n = tl.cast(n_cols, tl.float32)
    x0 = _load_h(x_row, r_row, True, HAS_RESIDUAL).to(tl.float32)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = _load_h(x_row + cols, r_row + cols, cols < n_cols, HAS_RESIDUAL).to(tl.float32)
        acc += tl.where(cols < n_cols, x - x0, 0.0)
    mu = tl.math.div_rn(tl.sum(acc, axis=0), n)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = _load_h(x_row + cols, r_row + cols, cols < n_cols, HAS_RESIDUAL).to(tl.float32)
        xc = tl.where(cols < n_cols, x - x0 - mu, 0.0)
        acc += xc * xc
    rstd = tl.rsqrt(tl.math.div_rn(tl.sum(acc, axis=0), n) + eps)  # approximate rsqrt: as in _fwd
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        x = _load_h(x_row + cols, r_row + cols, col_ok, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(H + row * stride_h + cols, x, mask=col_ok)
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = (x.to(tl.float32) - x0 - mu) * rstd * w + b
        tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=col_ok)
    tl.store(Mu + row, mu)
    tl.store(Rstd + row, rstd)


@triton.jit
def _bwd_row_sums(X, DY, W, Mu, Rstd, C1, C2, stride_x, stride_dy, n_cols, BLOCK_N: tl.constexpr):
    """Wide rows, pass 1 (one row per program): c1 = mean(g), c2 = mean(g * xhat)."""
    row = tl.program_id(0).to(tl.int64)
    x_row, dy_row = X + row * stride_x, DY + row * stride_dy
    x0 = tl.load(x_row).to(tl.float32)
    mu, rstd = tl.load(Mu + row), tl.load(Rstd + row)
    acc_g = tl.zeros([BLOCK_N], tl.float32)
    acc_gx = tl.zeros([BLOCK_N], tl.float32)
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < n_cols
        x = tl.load(x_row + cols, mask=col_ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_row + cols, mask=col_ok, other=0.0).to(tl.float32)
        g = dy * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc_g += g
        acc_gx += g * (x - x0 - mu) * rstd
    n = tl.cast(n_cols, tl.float32)
    tl.store(C1 + row, tl.math.div_rn(tl.sum(acc_g, axis=0), n))
    tl.store(C2 + row, tl.math.div_rn(tl.sum(acc_gx, axis=0), n))


@triton.jit
def _bwd_looped(X, DY, DH, DX, W, Mu, Rstd, C1, C2, Part, stride_x, stride_dy, stride_dh, stride_dx,
                n_rows, n_cols, rows_per_program, HAS_DRES: tl.constexpr, BLOCK_N: tl.constexpr):
    """Wide rows, pass 2: program (i, j) owns rows [i * rows_per_program, ...) of column chunk j, so
    its dw/db sums stay in registers over the rows and go to Part[i] once."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], tl.float32)
    db = tl.zeros([BLOCK_N], tl.float32)
    first = pid * rows_per_program
    for row in range(first, tl.minimum(first + rows_per_program, n_rows)):
        row64 = tl.cast(row, tl.int64)  # (the interpreter hands loop indices over as ints)
        x = tl.load(X + row64 * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
        x0 = tl.load(X + row64 * stride_x).to(tl.float32)
        dy = tl.load(DY + row64 * stride_dy + cols, mask=col_ok, other=0.0).to(tl.float32)
        rstd = tl.load(Rstd + row)
        xhat = (x - x0 - tl.load(Mu + row)) * rstd
        dx = (dy * w - tl.load(C1 + row) - xhat * tl.load(C2 + row)) * rstd
        if HAS_DRES:
            dx += tl.load(DH + row64 * stride_dh + cols, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(DX + row64 * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=col_ok)
        dw += dy * xhat
        db += dy
    part = Part + pid.to(tl.int64) * 2 * n_cols
    tl.store(part + cols, dw, mask=col_ok)
    tl.store(part + n_cols + cols, db, mask=col_ok)


# ----------------------------------------------------------------------------------- launching
def interpreter_block_m(n_rows: int, block_n: int) -> int:
    """Rows per tile under the interpreter (one config, no autotuning): about 4 row tiles."""
    return min(next_power_of_2(cdiv(n_rows, 4)), max(1, 2**14 // block_n))


def _launch(tuned, grid, *args, n_rows, n_cols, block_n, **meta):
    """Launch an autotuned kernel on rows of n_cols (block_n: its power of 2), keyed as the autotuner keys it
    (n_cols and the HAS_* flag); under the interpreter (programs run one after another, 10-40 ms each) the plain
    kernel, with BLOCK_M chosen for about 4 row tiles."""
    if _INTERPRET:
        tuned.fn[grid](*args, BLOCK_M=interpreter_block_m(n_rows, block_n), BLOCK_N=block_n, num_warps=4, **meta,
                       **FP_FUSION)
    else:
        launch_tuned(tuned, grid, *args, key=(n_cols, *meta.values()), BLOCK_N=block_n, **meta)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _backward_programs(n_rows: int, chunks: int, sms: int) -> int:
    """Backward row groups (each with `chunks` column chunks; 1 unless looped): BWD_PROGRAMS_PER_SM per
    SM in all, each over >= MIN_BWD_ROWS rows (fp32 partials: 8 bytes per column per program, next
    to 6 per column per row for 16-bit x, dy, dx)."""
    fill = cdiv(BWD_PROGRAMS_PER_SM * sms, chunks)
    return max(1, min(fill, cdiv(n_rows, MIN_BWD_ROWS)))


def _forward(x2, r2, weight, bias, eps):
    """(h, y, stats) of [M, N] rows, stats [2, M] fp32 = (mu, rstd); h is x2 itself without a residual."""
    m, n = x2.shape
    y = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    h = x2 if r2 is None else torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    stats = torch.empty((2, m), dtype=torch.float32, device=x2.device)
    mu, rstd = stats[0], stats[1]
    r = x2 if r2 is None else r2
    args = (x2, r, h, y, weight, bias, mu, rstd, x2.stride(0), r.stride(0), h.stride(0), y.stride(0))
    if n > MAX_FUSED_N:
        _fwd_looped[(m,)](*args, n, eps, HAS_RESIDUAL=r2 is not None, BLOCK_N=LOOP_BLOCK_N, num_warps=LOOP_WARPS,
                          **FP_FUSION)
    else:
        _launch(_fwd, lambda meta: (cdiv(m, meta["BLOCK_M"]),), *args, m, n, eps,
                n_rows=m, n_cols=n, block_n=next_power_of_2(n), HAS_RESIDUAL=r2 is not None)
    return h, y, stats


def _backward(h2, dy, dh, weight, stats):
    """(dx, [dw | db]) for rows h2 [M, N] with the forward's stats: dx = dh + LN backward of dy in h2's dtype;
    dw, db in fp32 (the sums of the programs' fp32 partials)."""
    m, n = h2.shape
    mu, rstd = stats[0], stats[1]
    dy2 = as_rows(dy, n)
    dh2 = dy2 if dh is None else as_rows(dh, n)
    dx = torch.empty((m, n), dtype=h2.dtype, device=h2.device)
    looped = n > MAX_FUSED_BWD_N
    chunks = cdiv(n, LOOP_BLOCK_N) if looped else 1
    # under the interpreter programs run one after another (~1 ms each): a few, each over several tiles
    programs = min(3, m) if _INTERPRET else _backward_programs(m, chunks, _sm_count(h2.device))
    part = torch.empty((programs, 2 * n), dtype=torch.float32, device=h2.device)
    strides = (h2.stride(0), dy2.stride(0), dh2.stride(0), dx.stride(0))
    if looped:
        c1 = torch.empty(m, dtype=torch.float32, device=h2.device)
        c2 = torch.empty(m, dtype=torch.float32, device=h2.device)
        _bwd_row_sums[(m,)](h2, dy2, weight, mu, rstd, c1, c2, strides[0], strides[1], n,
                            BLOCK_N=LOOP_BLOCK_N, num_warps=LOOP_WARPS, **FP_FUSION)
        _bwd_looped[(programs, chunks)](h2, dy2, dh2, dx, weight, mu, rstd, c1, c2, part, *strides, m, n,
                                        cdiv(m, programs), HAS_DRES=dh is not None,
                                        BLOCK_N=LOOP_BLOCK_N, num_warps=LOOP_WARPS, **FP_FUSION)
    else:
        _launch(_bwd, (programs,), h2, dy2, dh2, dx, weight, mu, rstd, part, *strides, m, n,
                n_rows=m, n_cols=n, block_n=next_power_of_2(n), HAS_DRES=dh is not None)
    return dx, part.sum(0)


def _check(x, r, weight, bias):
    n = x.shape[-1]
    if r is not None and r.shape != x.shape:
        raise ValueError(f"x and r must have one shape, got {tuple(x.shape)} and {tuple(r.shape)}")
    if weight.shape != (n,) or bias.shape != (n,):      # (the kernels read N contiguous values of each)
        raise ValueError(f"weight and bias must be [{n}] for x [..., {n}], got {tuple(weight.shape)} and "
                         f"{tuple(bias.shape)}")


def _grads(backward, saved, bias_dtype, dh, dy, params=None):
    """(dx, dw, db) through `backward` (_backward, or its op) from the saved (h rows, weight, stats) and the
    gradients of h (dh; None without a residual or where h is unused) and y (dy; None where y is unused:
    then dx = dh and the parameters get none). dw, db in the weight's and the bias's dtypes; with `params`,
    the (weight, bias) Parameters, added in fp32 into their fp32 main grads instead (training under a
    data_parallel.GradBuffer, as tensor_parallel's gradient-accumulation fusion: each then says so,
    main_grad_ready(), nothing added where y is unused) and returned None."""
    if dy is None:
        for p in params or ():
            p.main_grad_ready()
        return dh, None, None
    h, weight, stats = saved
    dx, dwdb = backward(h, dy, dh, weight, stats)
    n = h.shape[1]
    if params is not None:
        for p, g in zip(params, (dwdb[:n], dwdb[n:])):
            p.main_grad.add_(g)
            p.main_grad_ready()
        return dx, None, None
    return dx, dwdb[:n].to(weight.dtype), dwdb[n:].to(bias_dtype)


class _AddLayerNormFn(torch.autograd.Function):
    """(h, y) = (x + r, LN(x + r)) when r is given, else y = LN(x): the eager path (a Python autograd.Function
    costs about half the host time of a custom op's dispatch, which only torch.compile needs). Weights with fp32
    main grads get their gradients there, in fp32 (`_grads`)."""

    @staticmethod
    def forward(ctx, x, r, weight, bias, eps):
        check_device(x, _INTERPRET, __name__)
        n, parameter, weight = x.shape[-1], weight, weight.contiguous()
        h, y, stats = _forward(as_rows(x, n), None if r is None else as_rows(r, n), weight, bias.contiguous(), eps)
        ctx.save_for_backward(h, weight, stats)
        ctx.set_materialize_grads(False)     # a None gradient (h or y unused) costs nothing
        ctx.has_residual, ctx.shape, ctx.bias_dtype = r is not None, x.shape, bias.dtype
        ctx.params = (parameter, bias) if all(hasattr(p, "main_grad") for p in (parameter, bias)) else None
        return (h.view(x.shape), y.view(x.shape)) if r is not None else y.view(x.shape)

    @staticmethod
    def backward(ctx, *grads):
        dh, dy = grads if ctx.has_residual else (None, grads[0])
        dx, dw, db = _grads(_backward, ctx.saved_tensors, ctx.bias_dtype, dh, dy, ctx.params)
        dx = None if dx is None else dx.view(ctx.shape)
        return dx, (dx if ctx.has_residual else None), dw, db, None


# ------------------------------------------------------------------- under torch.compile: custom ops
# The same passes as opaque operators (torch.library.custom_op): dynamo puts a call in the graph instead of
# breaking it (it cannot trace the kernels under the interpreter, nor their autotuner's timing), and inductor
# runs it as an extern call. Rows in, rows out: the wrappers below reshape around them.
@torch.library.custom_op("megatron_mini::layer_norm_fwd", mutates_args=())
def _layer_norm_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, stats) of rows x [M, N]: y [M, N], stats [2, M] fp32 = (mu, rstd)."""
    check_device(x, _INTERPRET, __name__)
    _, y, stats = _forward(as_rows(x, x.shape[1]), None, weight.contiguous(), bias.contiguous(), eps)
    return y, stats          # (as_rows, contiguous: no copy unless the caller or inductor gave other strides)


@torch.library.custom_op("megatron_mini::add_layer_norm_fwd", mutates_args=())
def _add_layer_norm_fwd(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, y, stats) of rows x, r [M, N]: h = x + r, y = LN(h) [M, N], stats [2, M] fp32."""
    check_device(x, _INTERPRET, __name__)
    n = x.shape[1]
    return _forward(as_rows(x, n), as_rows(r, n), weight.contiguous(), bias.contiguous(), eps)


@torch.library.custom_op("megatron_mini::layer_norm_bwd", mutates_args=())
def _layer_norm_bwd(h: torch.Tensor, dy: torch.Tensor, dh: Optional[torch.Tensor], weight: torch.Tensor,
                    stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [M, N], [dw | db] [2N] fp32) as _backward."""
    return _backward(as_rows(h, h.shape[1]), dy, dh, weight.contiguous(), stats.contiguous())


@_layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty((2, x.shape[0]), dtype=torch.float32)


@_add_layer_norm_fwd.register_fake
def _(x, r, weight, bias, eps):
    rows = torch.empty_like(x, memory_format=torch.contiguous_format)
    return rows, torch.empty_like(rows), x.new_empty((2, x.shape[0]), dtype=torch.float32)


@_layer_norm_bwd.register_fake
def _(h, dy, dh, weight, stats):
    return torch.empty_like(h, memory_format=torch.contiguous_format), weight.new_empty(2 * h.shape[1],
                                                                                        dtype=torch.float32)


def _setup(ctx, inputs, output):
    """layer_norm_fwd(x, w, b, eps) -> (y, stats), add_layer_norm_fwd(x, r, w, b, eps) -> (h, y, stats)."""
    ctx.has_residual = len(inputs) == 5
    h = output[0] if ctx.has_residual else inputs[0]
    ctx.save_for_backward(h, inputs[-3], output[-1])
    ctx.mark_non_differentiable(output[-1])
    ctx.set_materialize_grads(False)
    ctx.bias_dtype = inputs[-2].dtype


def _op_grads(ctx, *grads):
    dh, dy = grads[:2] if ctx.has_residual else (None, grads[0])
    dx, dw, db = _grads(_layer_norm_bwd, ctx.saved_tensors, ctx.bias_dtype, dh, dy)
    return (dx, dx, dw, db, None) if ctx.has_residual else (dx, dw, db, None)


_layer_norm_fwd.register_autograd(_op_grads, setup_context=_setup)
_add_layer_norm_fwd.register_autograd(_op_grads, setup_context=_setup)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LayerNorm of x [..., N] over its last dim with weight, bias [N]; returns x's dtype and shape."""
    _check(x, None, weight, bias)
    if x.numel() == 0:                       # no rows: nothing to launch
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    if torch.compiler.is_compiling():
        y, _ = _layer_norm_fwd(as_rows(x, x.shape[-1]), weight, bias, float(eps))
        return y.view(x.shape)
    return _AddLayerNormFn.apply(x, None, weight, bias, float(eps))


def add_layer_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, y): h = x + r in x's dtype (rounded once) and y = LN(h) over the last dim, for x, r [..., N]
    and weight, bias [N]. Backward: dx = dr = dh + LN's input gradient, in one kernel."""
    _check(x, r, weight, bias)
    if x.numel() == 0:
        return torch_add_layer_norm(x, r, weight, bias, eps)
    if torch.compiler.is_compiling():
        n = x.shape[-1]
        h, y, _ = _add_layer_norm_fwd(as_rows(x, n), as_rows(r, n), weight, bias, float(eps))
        return h.view(x.shape), y.view(x.shape)
    return _AddLayerNormFn.apply(x, r, weight, bias, float(eps))


def torch_add_layer_norm(x: torch.Tensor, r: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                         eps: float = 1e-5) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for add_layer_norm in torch eager: h = (x + r) in x's dtype, y = F.layer_norm(h)."""
    h = (x + r).to(x.dtype)
    return h, F.layer_norm(h, (h.shape[-1],), weight, bias, eps)
