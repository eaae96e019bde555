"""Record of a probe run on one H100, 2026-11-23 (figures: docs/benchmarks.md, "First GPU run").
LayerNorm kernel probe (throwaway, GPU): where the time goes, and candidate kernels side by side.
x [16384, N] bf16. Times are medians of do_bench (L2 flushed before each rep), us."""
import sys
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench

from megatron_mini.kernels import layernorm as L

CUDA = torch.cuda.is_available()
M = 16384 if CUDA else 96      # CPU: a dry run under TRITON_INTERPRET=1 (values only)
dev = "cuda" if CUDA else "cpu"
SMS = torch.cuda.get_device_properties(0).multi_processor_count if CUDA else 2


def bench(fn):
    if not CUDA:
        fn()
        return 1.0
    return do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


@triton.jit
def bwd_plain(X, DY, DX, W, Mu, Rstd, Part, stride, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """fused persistent, no manual prefetch"""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    n = tl.cast(n_cols, tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    db = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for tile in range(pid, tl.cdiv(n_rows, BLOCK_M), programs):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * stride + cols[None, :]
        x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
        x0 = tl.load(X + rows.to(tl.int64) * stride, mask=row_ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=ok, other=0.0).to(tl.float32)
        mu = tl.load(Mu + rows, mask=row_ok, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
        xhat = tl.where(ok, (x - x0[:, None] - mu[:, None]) * rstd[:, None], 0.0)
        g = dy * w[None, :]
        c1 = tl.sum(g, axis=1) / n
        c2 = tl.sum(g * xhat, axis=1) / n
        dx = (g - c1[:, None] - xhat * c2[:, None]) * rstd[:, None]
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=ok)
        dw += dy * xhat
        db += dy
    part = Part + pid.to(tl.int64) * 2 * n_cols
    tl.store(part + cols, tl.sum(dw, axis=0), mask=col_ok)
    tl.store(part + n_cols + cols, tl.sum(db, axis=0), mask=col_ok)


@triton.jit
def bwd_dx(X, DY, DX, W, Mu, Rstd, stride, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dx only, BLOCK_M rows per program"""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < n_rows, cols < n_cols
    ok = row_ok[:, None] & col_ok[None, :]
    n = tl.cast(n_cols, tl.float32)
    offs = rows.to(tl.int64)[:, None] * stride + cols[None, :]
    x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
    x0 = tl.load(X + rows.to(tl.int64) * stride, mask=row_ok, other=0.0).to(tl.float32)
    dy = tl.load(DY + offs, mask=ok, other=0.0).to(tl.float32)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    mu = tl.load(Mu + rows, mask=row_ok, other=0.0)
    rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
    xhat = tl.where(ok, (x - x0[:, None] - mu[:, None]) * rstd[:, None], 0.0)
    g = dy * w[None, :]
    c1 = tl.sum(g, axis=1) / n
    c2 = tl.sum(g * xhat, axis=1) / n
    dx = (g - c1[:, None] - xhat * c2[:, None]) * rstd[:, None]
    tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=ok)


@triton.jit
def bwd_dwdb(X, DY, Mu, Rstd, Part, stride, n_rows, n_cols, rows_per_prog,
             BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """column-block partial sums of dy * xhat and dy over a row group: grid (col blocks, groups)"""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    g = tl.program_id(1)
    col_ok = cols < n_cols
    dw = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    db = tl.zeros([BLOCK_R, BLOCK_C], tl.float32)
    start = g * rows_per_prog
    for r0 in range(start, start + rows_per_prog, BLOCK_R):
        rows = r0 + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & col_ok[None, :]
        offs = rows.to(tl.int64)[:, None] * stride + cols[None, :]
        x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=ok, other=0.0).to(tl.float32)
        x0 = tl.load(X + rows.to(tl.int64) * stride, mask=row_ok, other=0.0).to(tl.float32)
        mu = tl.load(Mu + rows, mask=row_ok, other=0.0)
        rstd = tl.load(Rstd + rows, mask=row_ok, other=0.0)
        xhat = tl.where(ok, (x - x0[:, None] - mu[:, None]) * rstd[:, None], 0.0)
        dw += dy * xhat
        db += dy
    part = Part + g.to(tl.int64) * 2 * n_cols
    tl.store(part + cols, tl.sum(dw, axis=0), mask=col_ok)
    tl.store(part + n_cols + cols, tl.sum(db, axis=0), mask=col_ok)


def main():
    torch.manual_seed(0)
    rows = []
    for N in ((768, 1024, 2048, 4096) if CUDA else (96,)):
        BN = triton.next_power_of_2(N)
        x = torch.randn(M, N, device=dev, dtype=torch.bfloat16) * 2 + 0.5
        w = torch.randn(N, device=dev, dtype=torch.bfloat16)
        b = torch.randn(N, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        fwd_bytes, bwd_bytes = 2 * M * N * 2, 3 * M * N * 2
        # reference gradients (fp32)
        xr = x.float().requires_grad_()
        wr, br = w.float().requires_grad_(), b.float().requires_grad_()
        yr = F.layer_norm(xr, (N,), wr, br, 1e-5)
        gx, gw, gb = torch.autograd.grad(yr, (xr, wr, br), dy.float())

        def rel(a, r):
            return ((a.float() - r).norm() / r.norm()).item()

        # torch eager
        def t_fwd():
            return F.layer_norm(x, (N,), w, b, 1e-5)
        xg = x.clone().requires_grad_()
        wg, bg = w.clone().requires_grad_(), b.clone().requires_grad_()
        yg = F.layer_norm(xg, (N,), wg, bg, 1e-5)
        t = bench(t_fwd)
        tb = bench(lambda: torch.autograd.grad(yg, (xg, wg, bg), dy, retain_graph=True))
        rows.append((N, "torch fwd", "", t, fwd_bytes / t / 1e3))
        rows.append((N, "torch bwd(autograd)", "", tb, bwd_bytes / tb / 1e3))

        # ours: forward configs
        y = torch.empty_like(x)
        stats = torch.empty(2, M, device=dev, dtype=torch.float32)
        mu, rstd = stats[0], stats[1]
        best = None
        for bm in (1, 2, 4, 8, 16, 32):
            for wp in (2, 4, 8, 16):
                per = bm * BN // (32 * wp)
                if per < 4 or per > 64 or bm * BN > 32768:
                    continue
                def f(bm=bm, wp=wp):
                    L._fwd.fn[(triton.cdiv(M, bm),)](x, x, x, y, w, b, mu, rstd, N, N, N, N, M, N, 1e-5,
                                                     HAS_RESIDUAL=False, BLOCK_M=bm, BLOCK_N=BN, num_warps=wp)
                try:
                    f()
                    tt = bench(f)
                except Exception:  # noqa: BLE001
                    rows.append((N, "ours fwd", f"BM{bm} w{wp}", float("nan"), 0.0)); continue
                if best is None or tt < best[0]:
                    best = (tt, bm, wp)
        rows.append((N, "ours fwd best", f"BM{best[1]} w{best[2]}", best[0], fwd_bytes / best[0] / 1e3))
        f = lambda: L._fwd.fn[(triton.cdiv(M, best[1]),)](x, x, x, y, w, b, mu, rstd, N, N, N, N, M, N, 1e-5,  # noqa
                                                            HAS_RESIDUAL=False, BLOCK_M=best[1], BLOCK_N=BN,
                                                            num_warps=best[2])
        f()
        rows.append((N, "  fwd err y", "", rel(y, yr.detach()), 0.0))

        # ours: current fused backward, per programs-per-SM and config
        dx = torch.empty_like(x)
        for pps in (1, 2, 4, 8):
            programs = min(pps * SMS, triton.cdiv(M, 32))
            part = torch.empty(programs, 2 * N, device=dev, dtype=torch.float32)
            bestb = None
            for bm in (1, 2, 4):
                for wp in (4, 8, 16):
                    per = bm * BN // (32 * wp)
                    if per < 4 or per > 16:
                        continue
                    def g(bm=bm, wp=wp, part=part, programs=programs):
                        L._bwd.fn[(programs,)](x, dy, dy, dx, w, mu, rstd, part, N, N, N, N, M, N,
                                               HAS_DRES=False, BLOCK_M=bm, BLOCK_N=BN, num_warps=wp)
                    try:
                        g()
                        tt = bench(g)
                    except Exception:  # noqa: BLE001
                        continue
                    rows.append((N, f"ours bwd kernel pps{pps}", f"BM{bm} w{wp}", tt, bwd_bytes / tt / 1e3))
                    if bestb is None or tt < bestb[0]:
                        bestb = (tt, bm, wp)
            # plain (no prefetch) variant at the best config
            if bestb:
                bm, wp = bestb[1], bestb[2]
                def gp(bm=bm, wp=wp, part=part, programs=programs):
                    bwd_plain[(programs,)](x, dy, dx, w, mu, rstd, part, N, M, N, BLOCK_M=bm, BLOCK_N=BN, num_warps=wp)
                gp()
                tt = bench(gp)
                rows.append((N, f"plain bwd pps{pps}", f"BM{bm} w{wp}", tt, bwd_bytes / tt / 1e3))
                rows.append((N, "  plain err dx/dw", "", rel(dx, gx), rel(part.sum(0)[:N], gw)))
        # two-kernel backward
        bestdx = None
        for bm in (1, 2, 4, 8, 16):
            for wp in (2, 4, 8, 16):
                per = bm * BN // (32 * wp)
                if per < 4 or per > 32:
                    continue
                def h(bm=bm, wp=wp):
                    bwd_dx[(triton.cdiv(M, bm),)](x, dy, dx, w, mu, rstd, N, M, N, BLOCK_M=bm, BLOCK_N=BN, num_warps=wp)
                try:
                    h()
                    tt = bench(h)
                except Exception:  # noqa: BLE001
                    continue
                if bestdx is None or tt < bestdx[0]:
                    bestdx = (tt, bm, wp)
        rows.append((N, "dx-only best", f"BM{bestdx[1]} w{bestdx[2]}", bestdx[0], 3 * M * N * 2 / bestdx[0] / 1e3))
        bestsum = None
        for bc in (32, 64, 128, 256):
            for br in (16, 32, 64, 128):
                for groups in ((64, 128, 256) if CUDA else (2,)):
                    if bc * br > 16384:
                        continue
                    rpp = triton.cdiv(M, groups)
                    rpp = triton.cdiv(rpp, br) * br
                    part = torch.empty(groups, 2 * N, device=dev, dtype=torch.float32)
                    for wp in (4, 8):
                        def s(bc=bc, br=br, groups=groups, rpp=rpp, part=part, wp=wp):
                            bwd_dwdb[(triton.cdiv(N, bc), groups)](x, dy, mu, rstd, part, N, M, N, rpp,
                                                                   BLOCK_R=br, BLOCK_C=bc, num_warps=wp)
                            return part.sum(0)
                        try:
                            s()
                            tt = bench(s)
                        except Exception:  # noqa: BLE001
                            continue
                        if bestsum is None or tt < bestsum[0]:
                            bestsum = (tt, bc, br, groups, wp, s)
        rows.append((N, "dwdb colsum best (+sum)", f"C{bestsum[1]} R{bestsum[2]} G{bestsum[3]} w{bestsum[4]}",
                     bestsum[0], 2 * M * N * 2 / bestsum[0] / 1e3))
        dwdb = bestsum[5]()
        rows.append((N, "  colsum err dw/db", "", rel(dwdb[:N], gw), rel(dwdb[N:], gb)))
        tot = bestdx[0] + bestsum[0]
        rows.append((N, "two-kernel bwd total", "", tot, bwd_bytes / tot / 1e3))
        print(f"N={N} done", file=sys.stderr, flush=True)
    print(f"{'N':>5} {'what':28} {'config':22} {'us':>9} {'GB/s':>7}")
    for n, what, cfg, t, bw in rows:
        print(f"{n:>5} {what:28} {cfg:22} {t:9.2f} {bw:7.0f}" if "err" not in what else
              f"{n:>5} {what:28} {'':22} {t:9.2e} {bw:7.2e}")


if __name__ == "__main__":
    main()
