"""The Triton kernels of the flash attention (attention.py launches them; its docstring states the
math): the forward, the backward's delta pre-pass, the dk/dv and dq kernels, and the dropout mask
for tests. Blocks entirely below the diagonal and inside the sequence skip the mask arithmetic."""
import triton
import triton.language as tl


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
def _tile_ok(idx, offs_d, seq_len, MASK: tl.constexpr, EVEN_D: tl.constexpr, HEAD_DIM: tl.constexpr):
    """[BLOCK, BLOCK_D] load mask of the q/k/v tile at sequence positions `idx` (rows past the end, padded
    head-dim columns)."""
    if MASK:
        ok = (idx < seq_len)[:, None]
    else:
        ok = tl.full([idx.shape[0], 1], 1, tl.int1)
    if not EVEN_D:
        ok = ok & (offs_d < HEAD_DIM)[None, :]
    return ok


@triton.jit
def _score_ok(rows, cols, seq_len, CAUSAL: tl.constexpr):
    """[len(rows), len(cols)]: which (query, key) scores exist (key inside the sequence, causal: key <= query)."""
    ok = (cols < seq_len)[None, :]
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None])
    return ok


@triton.jit
def _key_range(pid_m, seq_len, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(n_full, hi) for query block pid_m: key blocks [0, n_full) need no mask (below the diagonal and
    inside the sequence), [n_full, hi) do."""
    if CAUSAL:
        n_full = (pid_m * BLOCK_M) // BLOCK_N * BLOCK_N
        hi = tl.minimum((pid_m + 1) * BLOCK_M, seq_len)
    else:
        n_full = seq_len // BLOCK_N * BLOCK_N
        hi = seq_len
    return n_full, hi


@triton.jit
def _fwd_block(acc, m_i, l_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d, seq_len, qk_scale,
               seed, p_drop, stride_ks, stride_vs,
               MASK: tl.constexpr, CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
               HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One key block of the online softmax: returns the updated (acc, m_i, l_i)."""
    cols = start_n + offs_n
    kv_ok = _tile_ok(cols, offs_d, seq_len, MASK, EVEN_D, HEAD_DIM)
    k = _load(k_ptrs + start_n * stride_ks, kv_ok, UPCAST)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale          # [BLOCK_M, BLOCK_N], log2 units
    if MASK:
        s = tl.where(_score_ok(offs_m, cols, seq_len, CAUSAL), s, float("-inf"))
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
    q_ok = _tile_ok(offs_m, offs_d, seq_len, True, EVEN_D, HEAD_DIM)
    q = _load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :], q_ok, UPCAST)
    k_ptrs = K + b * sk_b + h * sk_h + offs_n[:, None] * sk_s + offs_d[None, :]
    v_ptrs = V + b * sv_b + h * sv_h + offs_n[:, None] * sv_s + offs_d[None, :]
    seed = _head_seed(Seed, bh) if DROPOUT else 0
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_full, hi = _key_range(pid_m, seq_len, CAUSAL, BLOCK_M, BLOCK_N)
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
    q_ok = _tile_ok(rows, offs_d, seq_len, MASK, EVEN_D, HEAD_DIM)
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
    kv_ok = _tile_ok(offs_n, offs_d, seq_len, True, EVEN_D, HEAD_DIM)
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
    kv_ok = _tile_ok(cols, offs_d, seq_len, MASK, EVEN_D, HEAD_DIM)
    k = _load(k_ptrs + start_n * stride_ks, kv_ok, UPCAST)
    v = _load(v_ptrs + start_n * stride_vs, kv_ok, UPCAST)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    p = tl.math.exp2(s - lse[:, None])                 # approximate ex2: as in _fwd_block
    if MASK:
        p = tl.where(_score_ok(offs_m, cols, seq_len, CAUSAL), p, 0.0)
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
    q_ok = _tile_ok(offs_m, offs_d, seq_len, True, EVEN_D, HEAD_DIM)
    q = _load(Q + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :], q_ok, UPCAST)
    do = _load(DO + b * sdo_b + h * sdo_h + offs_m[:, None] * sdo_s + offs_d[None, :], q_ok, UPCAST)
    lse = tl.load(LSE + bh.to(tl.int64) * seq_len + offs_m, mask=row_ok, other=0.0)
    delta = tl.load(Delta + bh.to(tl.int64) * seq_len + offs_m, mask=row_ok, other=0.0)
    k_ptrs = K + b * sk_b + h * sk_h + offs_n[:, None] * sk_s + offs_d[None, :]
    v_ptrs = V + b * sv_b + h * sv_h + offs_n[:, None] * sv_s + offs_d[None, :]
    seed = _head_seed(Seed, bh) if DROPOUT else 0
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_full, hi = _key_range(pid_m, seq_len, CAUSAL, BLOCK_M, BLOCK_N)
    for start_n in range(0, n_full, BLOCK_N):
        dq = _dq_block(dq, q, do, lse, delta, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d, seq_len, qk_scale,
                       seed, p_drop, sk_s, sv_s, False, CAUSAL, DROPOUT, EVEN_D, HEAD_DIM, PRECISION, UPCAST)
    for start_n in range(n_full, hi, BLOCK_N):
        dq = _dq_block(dq, q, do, lse, delta, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d, seq_len, qk_scale,
                       seed, p_drop, sk_s, sv_s, True, CAUSAL, DROPOUT, EVEN_D, HEAD_DIM, PRECISION, UPCAST)
    dq = dq * sm_scale
    tl.store(DQ + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_s + offs_d[None, :], dq.to(DQ.dtype.element_ty),
             mask=q_ok)


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
