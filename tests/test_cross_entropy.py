"""The Triton cross-entropy (kernels/cross_entropy.py, through tensor_parallel's fused path) against
F.cross_entropy in float64, on a GPU when there is one, else under the Triton interpreter. Its vocab-parallel
form over TP ranks is checked with the torch path in test_tensor_parallel.py (",fused" cases)."""
import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the Triton kernels need the triton package (installed on Linux only)")

from megatron_mini.comm import Group, Ledger  # noqa: E402
from megatron_mini.kernels import cross_entropy as ce  # noqa: E402
from megatron_mini.tensor_parallel import vocab_parallel_cross_entropy  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ONE = Group("tp", [0], None, Ledger())
# d(logits) lies in [-1, 1]: 16-bit results are compared within an ulp or two of the output dtype
GRAD_TOL = {torch.float32: 1e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def _inputs(rows, padded, vocab, dtype, scale=3.0, seed=0, offset=0.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 2, padded, generator=g) * scale + offset).to(dtype)
    x[..., vocab:] = 30.0                                   # garbage in the padding: never counted
    t = torch.randint(0, vocab, (rows, 2), generator=g)
    grad_loss = torch.rand(rows, 2, generator=g) + 0.5
    return x.to(DEVICE), t.to(DEVICE), grad_loss.to(DEVICE)


def _check(x, t, grad_loss, vocab, smoothing):
    """Loss (fp32) and d(logits) (x's dtype, 0 on padding) vs F.cross_entropy on float64 copies."""
    a = x.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(a, t, ONE, vocab, smoothing, fused=True)
    loss.backward(grad_loss)
    b = x.double().requires_grad_()
    ref = F.cross_entropy(b[..., :vocab].flatten(0, 1), t.flatten(), reduction="none",
                          label_smoothing=smoothing).view(t.shape)
    ref.backward(grad_loss.double())
    assert loss.dtype == torch.float32 and loss.shape == t.shape and a.grad.dtype == x.dtype
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(a.grad.double(), b.grad, rtol=0, atol=GRAD_TOL[x.dtype] * grad_loss.max().item())
    assert torch.equal(a.grad[..., vocab:], torch.zeros_like(a.grad[..., vocab:]))
    assert torch.equal(a.detach(), x)                       # the logits are left as they were


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("vocab, padded", [(300, 384), (1000, 1000), (5, 128)])
def test_fused_cross_entropy_matches_float64(dtype, smoothing, vocab, padded):
    """Rows of several chunks (BLOCK_V is 128 under the interpreter), a ragged last chunk, padding."""
    _check(*_inputs(5, padded, vocab, dtype), vocab, smoothing)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_cross_entropy_large_logits(dtype):
    """Logits of +-1e4 (the online max rescales the running sum; nothing overflows)."""
    x, t, g = _inputs(4, 384, 300, dtype, scale=3000.0)
    _check(x, t, g, 300, 0.1)


def test_fused_cross_entropy_large_offset_keeps_fp32_accuracy():
    """fp32 logits of 1e4 + N(0, 1): a softmax that is not one-hot on top of a large common offset. The sums
    are shifted by the row's max, so the loss and gradient keep torch's accuracy; unshifted, lse = m + log S
    alone rounds to ulp(1e4) ~ 1e-3 (a first version that summed unshifted logits failed here by 5.2e-4)."""
    x, t, g = _inputs(4, 384, 300, torch.float32, scale=1.0, offset=1e4)
    _check(x, t, g, 300, 0.1)


@pytest.mark.parametrize("chunk", ["own", "gpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_cross_entropy_with_a_masked_vocabulary(dtype, chunk, monkeypatch):
    """Logits of -inf (a masked vocabulary) over a row's first columns, more than a chunk, the targets past them:
    the loss and gradient of F.cross_entropy (the running max was -inf through the first chunk, and its sum
    -inf - -inf = NaN). "own": 200 of 300 columns in the kernel's own chunks (BLOCK_V 128 under the interpreter;
    on a GPU the autotuner's, 1024 or wider: one chunk, so the case is not met there); "gpu": 1100 of 1400
    columns in the narrowest GPU chunk, BLOCK_V 1024, pinned (on a GPU, and through the interpreter on a CPU)."""
    padded, vocab, masked = (384, 300, 200) if chunk == "own" else (1536, 1400, 1100)
    if chunk == "gpu":
        config = next(c for c in ce.CONFIGS if c.kwargs["BLOCK_V"] == 1024 and c.num_warps == 4)
        for tuned in (ce._stats, ce._grad):
            monkeypatch.setattr(tuned, "configs", [config])
            monkeypatch.setattr(tuned, "cache", {})
    x, _, g = _inputs(4, padded, vocab, dtype)
    x[::2, :, :masked] = -math.inf
    t = torch.randint(masked, vocab, (4, 2), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    _check(x, t, g, vocab, 0.0)


def test_row_stats_of_a_shard_with_targets_elsewhere_or_only_padding():
    """Per shard: a target column past the row (it lives in a later shard) counts 0, even where the last
    chunk reaches past the row; a shard of padding only gives m = -inf, s = 0 (weighed 0 when the
    ranks' stats combine) and a zero gradient."""
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    t = torch.tensor([5, 203, -7], device=DEVICE)             # in the shard, in a later one, in an earlier one
    m, s, dt, xs = ce.row_stats(x, t, 200, smoothing=True)
    torch.testing.assert_close(m, x.max(-1).values)
    torch.testing.assert_close(s, (x - m[:, None]).exp().sum(-1))
    torch.testing.assert_close(dt, torch.stack([x[0, 5] - m[0], x.new_zeros(()), x.new_zeros(())]))
    torch.testing.assert_close(xs, (x - m[:, None]).sum(-1))
    m, s, dt, xs = ce.row_stats(x, t, 0, smoothing=True)
    assert torch.all(m == -math.inf) and not s.any() and not dt.any() and not xs.any()
    shift, g = torch.full((2, 3), 2.0, device=DEVICE), torch.ones(3, device=DEVICE)
    assert not ce.logits_grad(x, t, shift, g, 0, 0.1, 1000).any()


def _gpu_configs():
    return [pytest.param(c, id=f"BLOCK_V{c.kwargs['BLOCK_V']}-warps{c.num_warps}")
            for c in ce.fitting_configs(ce.CONFIGS, 8192)]


@pytest.mark.parametrize("config", _gpu_configs())
def test_each_gpu_config(monkeypatch, config):
    """Each autotune candidate at bench_gpu's vocabulary width computes the same function, in bf16, and in
    fp32 on a large offset (rows of several chunks: the re-shifted sums)."""
    for tuned in (ce._stats, ce._grad):
        monkeypatch.setattr(tuned, "configs", [config])
        monkeypatch.setattr(tuned, "cache", {})
    _check(*_inputs(2, 8192, 8000, torch.bfloat16), 8000, 0.1)
    _check(*_inputs(2, 8192, 8000, torch.float32, scale=1.0, offset=1e4), 8000, 0.1)


@pytest.mark.parametrize("n_cols", [1, 100, 1024, 8192, 50304, 262144])
def test_gpu_configs_fit_every_width(n_cols):
    """Every width gets candidates within the per-thread bounds, none much wider than the row, for each kernel:
    the gradient's are all that fit, the stats' all but STATS_SPILLING."""
    fit = ce.fitting_configs(ce.CONFIGS, n_cols)
    for kernel, spilling in (("stats", ce.STATS_SPILLING), ("grad", set())):
        kept = ce.candidates(kernel, n_cols)
        assert kept
        for c in kept:
            assert ce.PER_THREAD[0] <= c.kwargs["BLOCK_V"] // (32 * c.num_warps) <= ce.PER_THREAD[1]
            assert c.kwargs["BLOCK_V"] <= max(1024, 2 * n_cols)
        assert [c for c in fit if (c.kwargs["BLOCK_V"], c.num_warps) not in spilling] == kept
