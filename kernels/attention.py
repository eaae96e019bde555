"""Fused causal attention in Triton: the FlashAttention-2 algorithm (Dao 2023).

    o = dropout(softmax(scale * q k^T + causal mask)) v          q, k, v, o: [b, heads, s, d]

Forward: each program owns BLOCK_M query rows of one (batch, head) and walks the key blocks
with an online softmax (running max m and sum l, in fp32), so the [s, s] scores never reach
memory; it stores o and the log-sum-exp lse = m + log(l) (fp32, [b*heads, s]).
Backward recomputes P = exp(scale * q k^T - lse) block by block:
    delta_i = sum_d do_i o_i                        (a small pre-pass)
    dv = Z^T do,  dZ = do v^T,  dP = dZ * keep / (1 - p_drop),  dS = P * (dP - delta)
    dk = scale * dS^T q,  dq = scale * dS k         (Z = P * keep / (1 - p_drop))
one kernel owning a key block (dk, dv), one owning a query block (dq): no atomics, deterministic.
Dropout on the probabilities draws keep = philox(seed, row * s + col) >= p_drop, the same in the
backward and in a recomputation; the seed is drawn from torch's current generator on q's device,
so the RNG tracker's streams (and activation recompute, which replays them) choose the mask.
Math in fp32 whatever the input dtype (fp16/bf16 operands of the matmuls, fp32 accumulation;
fp32 inputs use IEEE fp32 matmuls, not TF32). Causal masking is top-left aligned (key j <= query i).
Head dims up to MAX_HEAD_DIM (128).

Blocks entirely below the diagonal and inside the sequence skip the mask arithmetic; only the
diagonal blocks and a ragged last block pay for it. Outputs come back in the layout the model
wants next: o as a [b, heads, s, d] view of an [s, b, heads, d] buffer, and with the packed entry
point `flash_attention_qkv` (qkv [s, b, 3 * heads * d] -> [s, b, heads * d]) the gradient is one
[s, b, 3 * heads * d] tensor, with no permute or concatenation copies around the kernels.
"""
import math
import os

import torch
import triton
import triton.language as tl

# as @triton.jit reads it at import: kernels below are interpreted (CPU) when set
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")
LOG2E = 1.4426950408889634
MAX_DROPOUT_SEQ = 46340  # dropout offsets row * s + col must fit in int32


@triton.jit
def _load(ptrs, mask, UPCAST: tl.constexpr):
    """A masked load of matmul operands; upcast to fp32 under the interpreter, whose 16-bit
    arithmetic is wrong (on a GPU they stay 16-bit for the tensor cores)."""
    x = tl.load(ptrs, mask=mask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def _i64(stride):
    """A sequence stride as int64: position * stride passes 2^31 elements in long packed inputs
    ([s, b, 3 * heads * d]: s * b * 3 * heads * d), and int32 products would wrap silently."""
    return tl.cast(stride, tl.int64)


@triton.jit
def _head_seed(Seed, bh):
    """The philox key of one (batch, head): the drawn seed (< 2^31) in the low word, bh in the high."""
    return tl.load(Seed) + bh.to(tl.int64) * 4294967296


@triton.jit
def _keep(seed, rows, cols, seq_len, p_drop):
    """Dropout keep mask of scores (query rows, key cols) of one (batch, head), offsets row * s + col,
    shaped as `rows + cols` broadcast ([M, 1] and [1, N] give [M, N]; [1, M] and [N, 1] give its
    transpose, drawn directly rather than through tl.trans of a bool tile)."""
    return tl.rand(seed, rows * seq_len + cols) >= p_drop


@triton.jit
def _fwd_block(acc, m_i, l_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d, seq_len, qk_scale,
               seed, p_drop, stride_ks, stride_vs,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
               HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One key block of the online softmax: returns the updated (acc, m_i, l_i)."""
    cols = start_n + offs_n
    if MASK:
        kv_ok = (cols < seq_len)[:, None]
    else:
        kv_ok = tl.full([offs_n.shape[0], 1], 1, tl.int1)
    if not EVEN_D:
        kv_ok = kv_ok & (offs_d < HEAD_DIM)[None, :]
    k = _load(k_ptrs + start_n * stride_ks, kv_ok, UPCAST)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale          # [BLOCK_M, BLOCK_N], log2 units
    if MASK:
        ok = (cols < seq_len)[None, :]
        if CAUSAL:
            ok = ok & (cols[None, :] <= offs_m[:, None])
        s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # exp2 is the GPU's approximate ex2 (~2 ulp), as in FlashAttention: harmless next to the 16-bit P
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DROPOUT:
        # 1 / (1 - p_drop): approximate on GPUs (~1 ulp), harmless and the same expression in fwd and bwd
        p = tl.where(_keep(seed, offs_m[:, None], cols[None, :], seq_len, p_drop), p * (1.0 / (1.0 - p_drop)), 0.0)
    v = _load(v_ptrs + start_n * stride_vs, kv_ok, UPCAST)
    acc += tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _fwd(Q, K, V, O, LSE, Seed, sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_s,
         n_heads, seq_len, qk_scale, p_drop,
         CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
         UPCAST: tl.constexpr):
    n_m = tl.cdiv(seq_len, BLOCK_M)
    pid_m = n_m - 1 - tl.program_id(0)             # longest (causal) rows first
    bh = tl.program_id(1)
    sq_s, sk_s, sv_s, so_s = _i64(sq_s), _i64(sk_s), _i64(sv_s), _i64(so_s)
    b, h = (bh // n_heads).to(tl.int64), (bh % n_heads).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    q_ok = (offs_m < seq_len)[:, None]
    if not EVEN_D:
        q_ok = q_ok & (offs_d < HEAD_DIM)[None, :]
    q = _load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :], q_ok, UPCAST)
    k_ptrs = K + b * sk_b + h * sk_h + offs_n[:, None] * sk_s + offs_d[None, :]
    v_ptrs = V + b * sv_b + h * sv_h + offs_n[:, None] * sv_s + offs_d[None, :]
    seed = _head_seed(Seed, bh) if DROPOUT else 0
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # key blocks that need no mask: below the diagonal (causal) and inside the sequence
    if CAUSAL:
        n_full = (pid_m * BLOCK_M) // BLOCK_N * BLOCK_N
        hi = tl.minimum((pid_m + 1) * BLOCK_M, seq_len)
    else:
        n_full = seq_len // BLOCK_N * BLOCK_N
        hi = seq_len
    for start_n in range(0, n_full, BLOCK_N):
        acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d, seq_len,
                                   qk_scale, seed, p_drop, sk_s, sv_s, False, CAUSAL, DROPOUT, EVEN_D,
                                   HEAD_DIM, PRECISION, UPCAST)
    for start_n in range(n_full, hi, BLOCK_N):
        acc, m_i, l_i = _fwd_block(acc, m_i, l_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d, seq_len,
                                   qk_scale, seed, p_drop, sk_s, sv_s, True, CAUSAL, DROPOUT, EVEN_D,
                                   HEAD_DIM, PRECISION, UPCAST)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)        # rows past the end of the sequence
    o = acc * (1.0 / l_safe)[:, None]              # approximate reciprocal on GPUs (~1 ulp): harmless
    tl.store(O + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :], o.to(O.dtype.element_ty), mask=q_ok)
    lse = m_i + tl.math.log2(l_safe)               # approximate lg2 (~2 ulp of l): P's relative error, harmless
    tl.store(LSE + bh.to(tl.int64) * seq_len + offs_m, lse, mask=offs_m < seq_len)


@triton.jit
def _bwd_delta(O, DO, Delta, so_b, so_h, so_s, sdo_b, sdo_h, sdo_s, n_heads, seq_len,
               HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta_i = sum_d o_i do_i (fp32), [b*heads, s]."""
    bh = tl.program_id(1)
    so_s, sdo_s = _i64(so_s), _i64(sdo_s)
    b, h = (bh // n_heads).to(tl.int64), (bh % n_heads).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    ok = (offs_m < seq_len)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(O + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :], mask=ok, other=0.0)
    do = tl.load(DO + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_s + offs_d[None, :], mask=ok, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + bh.to(tl.int64) * seq_len + offs_m, delta, mask=offs_m < seq_len)


@triton.jit
def _dkdv_block(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, start_m, offs_m, offs_n, offs_d, seq_len,
                qk_scale, seed, p_drop, stride_qs, stride_dos,
                MASK: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
                HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One query block's contribution to dk, dv of this program's key block (transposed: [BLOCK_N, BLOCK_M])."""
    rows = start_m + offs_m
    if MASK:
        q_ok = (rows < seq_len)[:, None]
    else:
        q_ok = tl.full([offs_m.shape[0], 1], 1, tl.int1)
    if not EVEN_D:
        q_ok = q_ok & (offs_d < HEAD_DIM)[None, :]
    q = _load(q_ptrs + start_m * stride_qs, q_ok, UPCAST)
    do = _load(do_ptrs + start_m * stride_dos, q_ok, UPCAST)
    if MASK:
        lse = tl.load(lse_ptr + rows, mask=rows < seq_len, other=0.0)
        delta = tl.load(delta_ptr + rows, mask=rows < seq_len, other=0.0)
    else:
        lse = tl.load(lse_ptr + rows)
        delta = tl.load(delta_ptr + rows)
    s_t = tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale       # [BLOCK_N, BLOCK_M]
    p_t = tl.math.exp2(s_t - lse[None, :])                                   # approximate ex2: as in _fwd_block
    if MASK:
        ok = (rows < seq_len)[None, :]
        if CAUSAL:
            ok = ok & (rows[None, :] >= offs_n[:, None])
        p_t = tl.where(ok, p_t, 0.0)
    dp_t = tl.dot(v, tl.trans(do), input_precision=PRECISION)                # dZ^T
    if DROPOUT:
        keep_t = _keep(seed, rows[None, :], offs_n[:, None], seq_len, p_drop)
        z_t = tl.where(keep_t, p_t * (1.0 / (1.0 - p_drop)), 0.0)
        dp_t = tl.where(keep_t, dp_t * (1.0 / (1.0 - p_drop)), 0.0)
        dv += tl.dot(z_t.to(do.dtype), do, input_precision=PRECISION)
    else:
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
    return dk, dv


@triton.jit
def _bwd_dkdv(Q, K, V, DO, DK, DV, LSE, Delta, Seed,
              sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sdo_b, sdo_h, sdo_s,
              sdk_b, sdk_h, sdk_s, sdv_b, sdv_h, sdv_s,
              n_heads, seq_len, qk_scale, sm_scale, p_drop,
              CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
              UPCAST: tl.constexpr):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    sq_s, sk_s, sv_s, sdo_s, sdk_s, sdv_s = _i64(sq_s), _i64(sk_s), _i64(sv_s), _i64(sdo_s), _i64(sdk_s), _i64(sdv_s)
    b, h = (bh // n_heads).to(tl.int64), (bh % n_heads).to(tl.int64)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    kv_ok = (offs_n < seq_len)[:, None]
    if not EVEN_D:
        kv_ok = kv_ok & (offs_d < HEAD_DIM)[None, :]
    k = _load(K + b * sk_b + h * sk_h + offs_n[:, None] * sk_s + offs_d[None, :], kv_ok, UPCAST)
    v = _load(V + b * sv_b + h * sv_h + offs_n[:, None] * sv_s + offs_d[None, :], kv_ok, UPCAST)
    q_ptrs = Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :]
    do_ptrs = DO + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_s + offs_d[None, :]
    lse_ptr = LSE + bh.to(tl.int64) * seq_len
    delta_ptr = Delta + bh.to(tl.int64) * seq_len
    seed = _head_seed(Seed, bh) if DROPOUT else 0
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    # query blocks: [lo, mid) straddle the diagonal (masked), [mid, full) need no mask, [full, s) ragged end
    if CAUSAL:
        lo = start_n // BLOCK_M * BLOCK_M
        mid = tl.minimum(tl.cdiv(start_n + BLOCK_N - 1, BLOCK_M) * BLOCK_M, tl.cdiv(seq_len, BLOCK_M) * BLOCK_M)
    else:
        lo = 0
        mid = 0
    full = tl.maximum(mid, seq_len // BLOCK_M * BLOCK_M)
    for start_m in range(lo, mid, BLOCK_M):
        dk, dv = _dkdv_block(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, start_m, offs_m, offs_n, offs_d,
                             seq_len, qk_scale, seed, p_drop, sq_s, sdo_s, True, CAUSAL, DROPOUT, EVEN_D,
                             HEAD_DIM, PRECISION, UPCAST)
    for start_m in range(mid, full, BLOCK_M):
        dk, dv = _dkdv_block(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, start_m, offs_m, offs_n, offs_d,
                             seq_len, qk_scale, seed, p_drop, sq_s, sdo_s, False, CAUSAL, DROPOUT, EVEN_D,
                             HEAD_DIM, PRECISION, UPCAST)
    for start_m in range(full, seq_len, BLOCK_M):
        dk, dv = _dkdv_block(dk, dv, k, v, q_ptrs, do_ptrs, lse_ptr, delta_ptr, start_m, offs_m, offs_n, offs_d,
                             seq_len, qk_scale, seed, p_drop, sq_s, sdo_s, True, CAUSAL, DROPOUT, EVEN_D,
                             HEAD_DIM, PRECISION, UPCAST)
    dk = dk * sm_scale
    tl.store(DK + b * sdk_b + h * sdk_h + offs_n[:, None] * sdk_s + offs_d[None, :], dk.to(DK.dtype.element_ty),
             mask=kv_ok)
    tl.store(DV + b * sdv_b + h * sdv_h + offs_n[:, None] * sdv_s + offs_d[None, :], dv.to(DV.dtype.element_ty),
             mask=kv_ok)


@triton.jit
def _dq_block(dq, q, do, lse, delta, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d, seq_len, qk_scale,
              seed, p_drop, stride_ks, stride_vs,
              MASK: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
              HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One key block's contribution to dq of this program's query block."""
    cols = start_n + offs_n
    if MASK:
        kv_ok = (cols < seq_len)[:, None]
    else:
        kv_ok = tl.full([offs_n.shape[0], 1], 1, tl.int1)
    if not EVEN_D:
        kv_ok = kv_ok & (offs_d < HEAD_DIM)[None, :]
    k = _load(k_ptrs + start_n * stride_ks, kv_ok, UPCAST)
    v = _load(v_ptrs + start_n * stride_vs, kv_ok, UPCAST)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    p = tl.math.exp2(s - lse[:, None])                 # approximate ex2: as in _fwd_block
    if MASK:
        ok = (cols < seq_len)[None, :]
        if CAUSAL:
            ok = ok & (cols[None, :] <= offs_m[:, None])
        p = tl.where(ok, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    if DROPOUT:
        dp = tl.where(_keep(seed, offs_m[:, None], cols[None, :], seq_len, p_drop), dp * (1.0 / (1.0 - p_drop)), 0.0)
    ds = p * (dp - delta[:, None])
    dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
    return dq


@triton.jit
def _bwd_dq(Q, K, V, DO, DQ, LSE, Delta, Seed,
            sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sdo_b, sdo_h, sdo_s, sdq_b, sdq_h, sdq_s,
            n_heads, seq_len, qk_scale, sm_scale, p_drop,
            CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
            UPCAST: tl.constexpr):
    n_m = tl.cdiv(seq_len, BLOCK_M)
    pid_m = n_m - 1 - tl.program_id(0)
    bh = tl.program_id(1)
    sq_s, sk_s, sv_s, sdo_s, sdq_s = _i64(sq_s), _i64(sk_s), _i64(sv_s), _i64(sdo_s), _i64(sdq_s)
    b, h = (bh // n_heads).to(tl.int64), (bh % n_heads).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    EVEN_D: tl.constexpr = BLOCK_D == HEAD_DIM
    row_ok = offs_m < seq_len
    q_ok = row_ok[:, None]
    if not EVEN_D:
        q_ok = q_ok & (offs_d < HEAD_DIM)[None, :]
    q = _load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :], q_ok, UPCAST)
    do = _load(DO + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_s + offs_d[None, :], q_ok, UPCAST)
    lse = tl.load(LSE + bh.to(tl.int64) * seq_len + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(Delta + bh.to(tl.int64) * seq_len + offs_m, mask=row_ok, other=0.0)
    k_ptrs = K + b * sk_b + h * sk_h + offs_n[:, None] * sk_s + offs_d[None, :]
    v_ptrs = V + b * sv_b + h * sv_h + offs_n[:, None] * sv_s + offs_d[None, :]
    seed = _head_seed(Seed, bh) if DROPOUT else 0
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if CAUSAL:
        n_full = (pid_m * BLOCK_M) // BLOCK_N * BLOCK_N
        hi = tl.minimum((pid_m + 1) * BLOCK_M, seq_len)
    else:
        n_full = seq_len // BLOCK_N * BLOCK_N
        hi = seq_len
    for start_n in range(0, n_full, BLOCK_N):
        dq = _dq_block(dq, q, do, lse, delta, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d, seq_len, qk_scale,
                       seed, p_drop, sk_s, sv_s, False, CAUSAL, DROPOUT, EVEN_D, HEAD_DIM, PRECISION, UPCAST)
    for start_n in range(n_full, hi, BLOCK_N):
        dq = _dq_block(dq, q, do, lse, delta, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d, seq_len, qk_scale,
                       seed, p_drop, sk_s, sv_s, True, CAUSAL, DROPOUT, EVEN_D, HEAD_DIM, PRECISION, UPCAST)
    dq = dq * sm_scale
    tl.store(DQ + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_s + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=q_ok)


# ----------------------------------------------------------------------------------- launching
# (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and head dim on a GPU (tools/sweep_attention.py)
GPU_CONFIGS = {
    "fwd": {64: (128, 64, 4, 3), 128: (128, 64, 8, 3)},
    "dkdv": {64: (64, 128, 8, 3), 128: (64, 128, 8, 2)},
    "dq": {64: (128, 64, 8, 3), 128: (128, 64, 8, 2)},
}
# fp32 inputs (tests, fp32 runs) take IEEE fp32 dots on the CUDA cores, with tiles of twice the bytes:
# small blocks, so registers and shared memory fit whatever the head dim (speed is not the point there)
FP32_CONFIG = (32, 32, 8, 1)
# under the interpreter: small blocks, so small test shapes still cover several blocks and ragged ends,
# oriented as on the GPU (dk/dv: fewer query rows than keys per block; fwd and dq: more)
INTERPRET_CONFIGS = {"fwd": (32, 16, 4, 1), "dkdv": (16, 32, 4, 1), "dq": (32, 16, 4, 1)}
MAX_HEAD_DIM = 128   # the GPU configs are sized for head dims up to 128 (shared memory at 256 overflows)


def _config(kind: str, q: torch.Tensor):
    if _INTERPRET:
        return INTERPRET_CONFIGS[kind]
    if q.dtype == torch.float32:
        return FP32_CONFIG
    table = GPU_CONFIGS[kind]
    return table[min(d for d in table if d >= q.shape[-1])]


def _strides(t: torch.Tensor):
    """(batch, head, seq) strides of a [b, heads, s, d] tensor with unit stride on d."""
    return t.stride(0), t.stride(1), t.stride(2)


def _unit_d(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _new_bhsd(b, h, s, d, like: torch.Tensor) -> torch.Tensor:
    """An empty [b, heads, s, d] tensor laid out as [s, b, heads, d] (the model's next layout)."""
    return torch.empty((s, b, h, d), dtype=like.dtype, device=like.device).permute(1, 2, 0, 3)


def _check(q, k, v, dropout_p):
    if not (q.is_cuda or _INTERPRET):
        raise RuntimeError("Triton kernels need CUDA tensors; on CPU set TRITON_INTERPRET=1 "
                           "before importing kernels.attention.")
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"q, k, v must be [b, heads, s, d] of one shape, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q, k, v must share one of fp16/bf16/fp32, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] > MAX_HEAD_DIM:
        raise ValueError(f"head dim {q.shape[-1]} > {MAX_HEAD_DIM} is not supported")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p={dropout_p} must be in [0, 1)")
    if dropout_p > 0 and q.shape[2] > MAX_DROPOUT_SEQ:
        raise ValueError(f"dropout needs s <= {MAX_DROPOUT_SEQ} (int32 RNG offsets), got {q.shape[2]}")


def _meta(q, causal, dropout_p):
    d = q.shape[-1]
    return dict(CAUSAL=causal, DROPOUT=dropout_p > 0, HEAD_DIM=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
                PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                UPCAST=_INTERPRET and q.dtype != torch.float32)


def _forward(q, k, v, o, scale, causal, dropout_p, seed):
    b, h, s, _ = q.shape
    lse = torch.empty((b * h, s), dtype=torch.float32, device=q.device)
    block_m, block_n, warps, stages = _config("fwd", q)
    _fwd[(triton.cdiv(s, block_m), b * h)](
        q, k, v, o, lse, seed, *_strides(q), *_strides(k), *_strides(v), *_strides(o),
        h, s, scale * LOG2E, dropout_p, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages,
        **_meta(q, causal, dropout_p))
    return lse


def _backward(q, k, v, o, lse, do, dq, dk, dv, scale, causal, dropout_p, seed):
    b, h, s, d = q.shape
    meta = _meta(q, causal, dropout_p)
    delta = torch.empty_like(lse)
    _bwd_delta[(triton.cdiv(s, 64), b * h)](o, do, delta, *_strides(o), *_strides(do), h, s,
                                            HEAD_DIM=d, BLOCK_D=meta["BLOCK_D"], BLOCK_M=64)
    block_m, block_n, warps, stages = _config("dkdv", q)
    _bwd_dkdv[(triton.cdiv(s, block_n), b * h)](
        q, k, v, do, dk, dv, lse, delta, seed, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
        *_strides(dk), *_strides(dv), h, s, scale * LOG2E, scale, dropout_p,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **meta)
    block_m, block_n, warps, stages = _config("dq", q)
    _bwd_dq[(triton.cdiv(s, block_m), b * h)](
        q, k, v, do, dq, lse, delta, seed, *_strides(q), *_strides(k), *_strides(v), *_strides(do),
        *_strides(dq), h, s, scale * LOG2E, scale, dropout_p,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages, **meta)


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


class _FlashAttentionQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, heads, scale, causal, dropout_p):
        qkv = qkv.contiguous()
        q, k, v = _split_qkv(qkv, heads)
        o = _new_bhsd(*q.shape[:3], q.shape[3], q)
        seed = _draw_seed(qkv.device, dropout_p)
        lse = _forward(q, k, v, o, scale, causal, dropout_p, seed)
        ctx.save_for_backward(qkv, o, lse, seed)
        ctx.heads, ctx.scale, ctx.causal, ctx.dropout_p = heads, scale, causal, dropout_p
        s, b = qkv.shape[:2]
        return o.permute(2, 0, 1, 3).reshape(s, b, -1)          # a view: o is [s, b, heads, d] in memory

    @staticmethod
    def backward(ctx, do):
        qkv, o, lse, seed = ctx.saved_tensors
        s, b = qkv.shape[:2]
        dqkv = torch.empty_like(qkv)
        do = do.contiguous().view(s, b, ctx.heads, -1).permute(1, 2, 0, 3)
        _backward(*_split_qkv(qkv, ctx.heads), o, lse, do, *_split_qkv(dqkv, ctx.heads),
                  ctx.scale, ctx.causal, ctx.dropout_p, seed)
        return dqkv, None, None, None, None


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                    softmax_scale: float | None = None, dropout_p: float = 0.0) -> torch.Tensor:
    """dropout(softmax(scale * q k^T [+ causal mask])) v for q, k, v [b, heads, s, d] (any strides
    with unit stride on d); scale defaults to 1/sqrt(d). Returns [b, heads, s, d] in q's dtype
    (a view of an [s, b, heads, d] buffer)."""
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


@triton.jit
def _keep_mask(Out, Seed, seq_len, p_drop, BLOCK: tl.constexpr):
    bh = tl.program_id(1)
    offs_m = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs_n = tl.arange(0, BLOCK)
    seed = _head_seed(Seed, bh)
    for start_n in range(0, seq_len, BLOCK):
        cols = start_n + offs_n
        keep = _keep(seed, offs_m[:, None], cols[None, :], seq_len, p_drop)
        ok = (offs_m < seq_len)[:, None] & (cols < seq_len)[None, :]
        tl.store(Out + bh.to(tl.int64) * seq_len * seq_len + offs_m[:, None] * seq_len + cols[None, :],
                 keep.to(tl.int8), mask=ok)


def dropout_keep_mask(seed: torch.Tensor, b: int, heads: int, s: int, dropout_p: float) -> torch.Tensor:
    """The keep mask [b, heads, s, s] (bool) the kernels draw from `seed` (for tests)."""
    out = torch.empty((b * heads, s, s), dtype=torch.int8, device=seed.device)
    _keep_mask[(triton.cdiv(s, 32), b * heads)](out, seed, s, dropout_p, BLOCK=32)
    return out.view(b, heads, s, s).bool()
