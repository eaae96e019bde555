"""Cross-entropy over (a shard of) the vocabulary in Triton: the logits are read once forward and once
backward, in their own dtype, and nothing fp32 of their size is made or kept.

Rows x [M, n] hold vocabulary columns [start, start + n) of each token's logits; the first n_valid of them
are real classes (the rest padding, never counted), t is the target's column in the shard (outside
[0, n_valid) when the target lives in another shard). Per row, in fp32 whatever x's dtype, every sum
shifted by the row's max m so that large logits cost no accuracy (as torch's log-softmax does):

    row_stats:   m = max_j x_j,  s = sum_j exp(x_j - m),  dt = x_t - m if t is in the shard else 0,
                 xs = sum_j (x_j - m) (label smoothing only)                         j < n_valid
    logits_grad: dx_j = g * (exp((x_j - M) - log S) - (1 - a) [j = t] - a / V)      j < n_valid, else 0

The caller (tensor_parallel._FusedVocabParallelCrossEntropy) combines the stats over the TP ranks to the
row's max M and S = sum_r s_r exp(m_r - M) (so lse = M + log S), shifts dt and xs to M likewise, takes
loss = log S - (1 - a) dt - (a / V) xs (= lse - (1 - a) x_t - (a / V) sum_j x_j) and saves (M, log S) for
the backward; g is the loss's incoming gradient per token. A program takes BLOCK_R rows (1 on a GPU) and
walks them in BLOCK_V chunks with an online max (s and xs re-shifted when the max grows). A shard holding
only padding (n_valid <= 0) gives m = -inf and s = 0, and the caller counts nothing of it.
"""
import torch
import triton
import triton.language as tl

from . import autotune, cdiv, check_device, interpreting, launch_tuned, next_power_of_2

_INTERPRET = interpreting()
# (BLOCK_V, num_warps) candidates on a GPU (a row a program), pruned to 8..32 elements per thread of a chunk that is not
# (much) wider than the row; under the interpreter one small chunk, so test rows span several
CONFIGS = [triton.Config({"BLOCK_R": 1, "BLOCK_V": v}, num_warps=w) for v in (1024, 2048, 4096, 8192)
           for w in (4, 8, 16)]
PER_THREAD = (8, 32)
# the stats kernel's candidates that ptxas spills, 8 B a thread at 64 registers (tools/check_kernels.py, sm_90, 16-bit
# logits at GPT-2's vocabulary, Triton 3.7: torch 2.12's; not 3.6, 3.8 or 3.9): (BLOCK_V, warps)
STATS_SPILLING = {(4096, 8)}
# under the interpreter (programs run one after another, each op a numpy call): many rows per program
INTERPRET_CONFIGS = [triton.Config({"BLOCK_R": 64, "BLOCK_V": 128}, num_warps=4)]


def fitting_configs(configs, n_cols: int) -> list:
    """The configs whose chunk holds PER_THREAD elements per thread and is at most the row rounded up
    to a power of two (the narrowest candidate otherwise)."""
    width = next_power_of_2(n_cols)
    fit = [c for c in configs if c.kwargs["BLOCK_V"] <= max(width, 1024)
           and PER_THREAD[0] <= c.kwargs["BLOCK_V"] // (32 * c.num_warps) <= PER_THREAD[1]]
    return fit or [triton.Config({"BLOCK_R": 1, "BLOCK_V": 1024}, num_warps=4)]


def candidates(kernel: str, n_cols: int, configs=CONFIGS) -> list:
    """The configs kernel "stats" or "grad" is timed over at rows of n_cols: those of `configs` that fitting_configs
    keeps, less STATS_SPILLING for the stats."""
    if kernel == "stats":
        configs = [c for c in configs if (c.kwargs["BLOCK_V"], c.num_warps) not in STATS_SPILLING]
    return fitting_configs(configs, n_cols)


def _autotune(kernel: str):
    def prune(configs, named_args, **kwargs):
        return candidates(kernel, named_args["n_cols"], configs)

    return autotune(INTERPRET_CONFIGS if _INTERPRET else CONFIGS, ["n_cols", "SMOOTHING"], prune)


@_autotune("stats")
@triton.jit
def _stats(X, T, Stats, stride_x, n_rows, n_cols, n_valid, SMOOTHING: tl.constexpr, BLOCK_R: tl.constexpr,
           BLOCK_V: tl.constexpr):
    """Stats [4, M]: m, s, dt, xs of rows [pid * BLOCK_R, ...) (module docstring)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    x_rows = X + rows.to(tl.int64)[:, None] * stride_x
    t = tl.load(T + rows, mask=row_ok, other=-1)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_R], tl.float32)
    x_t = tl.zeros([BLOCK_R], tl.float32)
    xs = tl.zeros([BLOCK_R], tl.float32)
    for start in range(0, n_valid, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)[None, :]
        ok = row_ok[:, None] & (cols < n_valid)
        x = tl.load(x_rows + cols, mask=ok, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 1))
        m_new = tl.where(row_ok, m_new, 0.0)                     # rows past the end: no -inf - -inf
        # exp is the GPU's approximate ex2 of x * log2(e) (~2 ulp): far below the loss's own rounding
        # (a row whose chunks so far are all -inf, a masked vocabulary's: shifted by 0, no -inf - -inf = NaN)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(x - m_ref[:, None]), 1)
        x_t += tl.sum(tl.where(ok & (cols == t[:, None]), x, 0.0), 1)   # one term at most: exact
        if SMOOTHING:   # sum of (x - m) over the `start` columns so far, re-shifted to the new max
            xs += start * (tl.where(m > float("-inf"), m, m_new) - m_new)    # 0 on the first chunk
            xs += tl.sum(tl.where(ok, x - m_new[:, None], 0.0), 1)
        m = m_new
    dt = tl.where((t >= 0) & (t < n_valid), x_t - m, 0.0)
    tl.store(Stats + rows, m, mask=row_ok)
    tl.store(Stats + n_rows + rows, s, mask=row_ok)
    tl.store(Stats + 2 * n_rows + rows, dt, mask=row_ok)
    tl.store(Stats + 3 * n_rows + rows, xs, mask=row_ok)


@_autotune("grad")
@triton.jit
def _grad(X, T, Shift, G, DX, stride_x, stride_dx, n_rows, n_cols, n_valid, keep, each,
          SMOOTHING: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr):
    """dx of rows [pid * BLOCK_R, ...) (module docstring) from Shift [2, M] = (M, log S), keep = 1 - a,
    each = a / V, in DX's dtype."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)[:, None]
    t = tl.load(T + rows, mask=row_ok, other=-1)[:, None]
    m = tl.load(Shift + rows, mask=row_ok, other=0.0)[:, None]
    log_s = tl.load(Shift + n_rows + rows, mask=row_ok, other=0.0)[:, None]
    g = tl.load(G + rows, mask=row_ok, other=0.0)[:, None]
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)[None, :]
        real = row_ok[:, None] & (cols < n_valid)
        x = tl.load(X + rows64 * stride_x + cols, mask=real, other=float("-inf")).to(tl.float32)
        dx = tl.exp((x - m) - log_s) - tl.where(real & (cols == t), keep, 0.0)   # padding: exp(-inf) = 0
        if SMOOTHING:
            dx -= tl.where(real, each, 0.0)
        tl.store(DX + rows64 * stride_dx + cols, (dx * g).to(DX.dtype.element_ty),
                 mask=row_ok[:, None] & (cols < n_cols))


def row_stats(x: torch.Tensor, t: torch.Tensor, n_valid: int, smoothing: bool) -> torch.Tensor:
    """[4, M] fp32 (m, s, dt, xs) of rows x [M, n] (unit column stride) with int64 targets t [M] given as
    columns of this shard; xs is 0 unless smoothing."""
    check_device(x, _INTERPRET, __name__)
    m, n = x.shape
    stats = torch.empty((4, m), dtype=torch.float32, device=x.device)
    launch_tuned(_stats, lambda meta: (cdiv(m, meta["BLOCK_R"]),), x, t, stats, x.stride(0), m, n, n_valid,
                 key=(n, smoothing), SMOOTHING=smoothing)
    return stats


def logits_grad(x: torch.Tensor, t: torch.Tensor, shift: torch.Tensor, g: torch.Tensor, n_valid: int,
                label_smoothing: float, vocab_size: int) -> torch.Tensor:
    """dx [M, n] in x's dtype from rows x [M, n], shard targets t [M], shift [2, M] = (M, log S) of the
    combined stats and the incoming per-token gradient g [M] (fp32)."""
    check_device(x, _INTERPRET, __name__)
    m, n = x.shape
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    a = float(label_smoothing)
    launch_tuned(_grad, lambda meta: (cdiv(m, meta["BLOCK_R"]),), x, t, shift, g, dx, x.stride(0), dx.stride(0),
                 m, n, n_valid, 1.0 - a, a / vocab_size, key=(n, a > 0), SMOOTHING=a > 0)
    return dx
