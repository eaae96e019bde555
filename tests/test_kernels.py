"""Triton LayerNorm and residual-add + LayerNorm against float64 torch references.

Runs on a GPU when there is one, else on CPU under the Triton interpreter (conftest sets
TRITON_INTERPRET=1 before anything imports triton). Shapes stay small for the interpreter.
Tolerances: 16-bit outputs are compared with ~2 ulp of the output dtype (the kernels do fp32
math on the same rounded inputs as the reference, so the rounding of the result dominates).
"""
import functools
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the Triton kernels need the triton package (installed on Linux only)")

from harness import skip_without_cpu_compiler  # noqa: E402
from megatron_mini import kernels  # noqa: E402
from megatron_mini.kernels import layernorm  # noqa: E402
from megatron_mini.kernels.layernorm import add_layer_norm, layer_norm, torch_add_layer_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol): fp32 allows accumulation-order noise; 16-bit allows 2 ulp of the output dtype
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (1e-3, 2**-9), torch.bfloat16: (1e-2, 2**-6)}


def _close(actual, expected, dtype, atol=None):
    default_atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol,
                               atol=default_atol if atol is None else atol)


def _randn(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


# ----------------------------------------------------------------------------------- LayerNorm
def _check_layer_norm(x, w, b, eps=1e-5):
    """Forward and backward of the kernel vs F.layer_norm on float64 copies of the same values."""
    dtype = x.dtype
    x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
    y = layer_norm(x, w, b, eps)
    dy = _randn(*y.shape, dtype=dtype, seed=1)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), dy)

    xr, wr, br = (t.detach().double().requires_grad_() for t in (x, w, b))
    yr = F.layer_norm(xr, wr.shape, wr, br, eps)
    dxr, dwr, dbr = torch.autograd.grad(yr, (xr, wr, br), dy.double())

    assert y.dtype == dtype and y.shape == x.shape and dx.dtype == dtype and dw.dtype == w.dtype
    _close(y, yr, dtype)
    _close(dx, dxr, dtype)
    # dw, db sum one term per row: their size and rounding noise grow like sqrt(rows)
    atol = TOL[dtype][0] * math.sqrt(x.numel() // x.shape[-1])
    _close(dw, dwr, dtype, atol=atol)
    _close(db, dbr, dtype, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 1000), (3, 4099), (2, 3, 257), (1, 65536)], ids=str)
def test_layer_norm_matches_torch(shape, dtype):
    n = shape[-1]
    x = (_randn(*shape) * 3 + 0.5).to(dtype)  # non-zero mean and non-unit variance
    _check_layer_norm(x, _randn(n, dtype=dtype, seed=2), _randn(n, dtype=dtype, seed=3))


@pytest.mark.parametrize("layout", ["row_strided", "column_strided", "transposed"])
def test_layer_norm_non_contiguous(layout):
    base = _randn(8, 1100)
    x = {"row_strided": base[:, 50:1050],        # rows 1100 apart, unit column stride
         "column_strided": base[:, ::2],          # every other column
         "transposed": base.t()[:600]}[layout]    # [600, 8] with column stride 1100
    assert not x.is_contiguous()
    n = x.shape[-1]
    _check_layer_norm(x, _randn(n, seed=2), _randn(n, seed=3))


def test_layer_norm_fp32_weights_with_bf16_input():
    """Mixed precision: output and dx in the input dtype, dw/db in the weights' dtype."""
    _check_layer_norm(_randn(6, 320, dtype=torch.bfloat16), _randn(320, seed=2), _randn(320, seed=3))


@pytest.mark.parametrize("residual", [False, True], ids=["layer_norm", "add_layer_norm"])
def test_layer_norm_weight_gradients_go_into_fp32_main_grads(residual):
    """bf16 weights with fp32 main grads (training under a GradBuffer) take dw = sum of dy * xhat and db = sum of dy
    there, as the kernel's fp32 sums, over three calls (microbatches) without a 16-bit rounding between: the fp64
    sums of the same bf16 h and dy, to fp32 rounding (1.2e-7 measured; 1.6e-3 through a bf16 .grad per call). Each
    call tells each parameter once that its gradient is in (as a GradBuffer's main_grad_ready)."""
    n, eps, ready = 320, 1e-5, []
    w, b = (torch.nn.Parameter(_randn(n, dtype=torch.bfloat16, seed=s)) for s in (2, 3))
    for p in (w, b):
        p.main_grad = torch.zeros(n, device=DEVICE)
        p.main_grad_ready = functools.partial(ready.append, p)
    exact_w, exact_b = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for call in range(3):
        x = (_randn(48, n, seed=10 + call) * 3 + 0.5).bfloat16()
        if residual:
            h, y = add_layer_norm(x, _randn(48, n, dtype=torch.bfloat16, seed=20 + call), w, b, eps)
        else:
            h, y = x, layer_norm(x, w, b, eps)
        dy = _randn(48, n, dtype=torch.bfloat16, seed=30 + call)
        y.backward(dy)
        hd = h.detach().double().cpu()
        xhat = (hd - hd.mean(-1, keepdim=True)) / (hd.var(-1, unbiased=False, keepdim=True) + eps).sqrt()
        exact_w += (dy.double().cpu() * xhat).sum(0)
        exact_b += dy.double().cpu().sum(0)
    assert w.grad is None and b.grad is None and [id(p) for p in ready] == [id(w), id(b)] * 3
    for p, exact in ((w, exact_w), (b, exact_b)):
        error = ((p.main_grad.double().cpu() - exact).norm() / exact.norm()).item()
        assert error < 1e-6, (error, residual)


def test_layer_norm_large_mean_small_spread():
    """Statistics shifted by the row's first element: a mean 1e4 times the spread costs no accuracy
    (torch's own fp32 LayerNorm on CPU is off by 2e-3 here)."""
    x = 1000.0 + 0.1 * _randn(5, 300)
    _check_layer_norm(x, _randn(300, seed=2), _randn(300, seed=3))


@pytest.fixture
def looped(monkeypatch):
    """Shrink the fused-row limits so rows of a few hundred take the looped (chunked) kernels."""
    monkeypatch.setattr(layernorm, "MAX_FUSED_N", 256)
    monkeypatch.setattr(layernorm, "MAX_FUSED_BWD_N", 256)
    monkeypatch.setattr(layernorm, "LOOP_BLOCK_N", 128)


def test_layer_norm_looped_path_many_rows(looped):
    """Several rows per backward program accumulate into the partial dw/db buffers; ragged last chunk."""
    _check_layer_norm(_randn(9, 1000) * 2 - 1, _randn(1000, seed=2), _randn(1000, seed=3))


@pytest.fixture
def gpu_launch_config(monkeypatch):
    """On CPU, make the wrappers choose the launch configuration they use on a GPU (backward
    programs from an SM count) so the interpreter checks it."""
    if DEVICE == "cpu":
        monkeypatch.setattr(layernorm, "_INTERPRET", False)
        monkeypatch.setattr(layernorm, "check_device", lambda *args: None)
        monkeypatch.setattr(layernorm, "_sm_count", lambda device: 4)


@pytest.mark.parametrize("shape", [(48, 1000), (100, 300), (40, 3000), (24, 12288), (32, 20000)], ids=str)
def test_layer_norm_gpu_launch_config(gpu_launch_config, shape):
    """12288: fused forward, looped backward (MAX_FUSED_BWD_N < N <= MAX_FUSED_N); 20000: both looped."""
    _check_layer_norm(_randn(*shape), _randn(shape[-1], seed=2), _randn(shape[-1], seed=3))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("value", [3.0, 0.1, -1234.567], ids=str)
def test_constant_rows_give_the_bias_exactly(value, dtype):
    """A constant row has xhat = 0, so y is b exactly (the mean is not divided out: the GPU's fp32
    `/` is approximate), for both entry points, fused and looped widths."""
    for n in (300, 20000):
        x = torch.full((4, n), value, device=DEVICE).to(dtype)
        w, b = _randn(n, dtype=dtype, seed=2), _randn(n, dtype=dtype, seed=3)
        y = layer_norm(x, w, b, 1e-5)
        torch.testing.assert_close(y, b.expand_as(y), atol=0, rtol=0)
        h, y = add_layer_norm(x, x.clone(), w, b, 1e-5)    # h = 2x: exact in any rounding
        torch.testing.assert_close(h, 2 * x, atol=0, rtol=0)
        torch.testing.assert_close(y, b.expand_as(y), atol=0, rtol=0)


# ------------------------------------------------------------------------------- add + LayerNorm
def _check_add_layer_norm(x, r, w, b, use=("h", "y"), eps=1e-5):
    """add_layer_norm's (h, y) and the gradients of x, r, w, b vs float64 torch math, with gradients
    flowing into the outputs in `use` (the others unused downstream: their gradient is None).
    h is checked against x + r; y and the gradients against LN of the kernel's own h (so the test
    sees LN's error, not the rounding of h, which the interpreter truncates)."""
    dtype = x.dtype
    x, r, w, b = (t.detach().requires_grad_() for t in (x, r, w, b))
    h, y = add_layer_norm(x, r, w, b, eps)
    douts = {"h": _randn(*x.shape, dtype=dtype, seed=4), "y": _randn(*x.shape, dtype=dtype, seed=5)}
    outs = {"h": h, "y": y}
    dx, dr, dw, db = torch.autograd.grad([outs[k] for k in use], (x, r, w, b), [douts[k] for k in use],
                                         allow_unused=True, materialize_grads=True)

    hk, wr, br = (t.detach().double().requires_grad_() for t in (h, w, b))
    yr = F.layer_norm(hk, (x.shape[-1],), wr, br, eps)
    dxr, dwr, dbr = torch.autograd.grad(yr, (hk, wr, br), douts["y"].double() * ("y" in use))
    dxr = dxr + douts["h"].double() * ("h" in use)

    assert h.shape == y.shape == x.shape and h.dtype == y.dtype == dx.dtype == dtype
    assert dw.dtype == w.dtype and db.dtype == b.dtype
    _close(h, x.double() + r.double(), dtype)
    _close(y, yr, dtype)
    _close(dx, dxr, dtype)
    torch.testing.assert_close(dr.to(dtype), dx, atol=0, rtol=0)
    atol = TOL[dtype][0] * math.sqrt(x.numel() // x.shape[-1])
    _close(dw, dwr, dtype, atol=atol)
    _close(db, dbr, dtype, atol=atol)


def _add_inputs(shape, dtype=torch.float32, wdtype=None):
    n = shape[-1]
    wdtype = wdtype or dtype
    return ((_randn(*shape) * 3 + 0.5).to(dtype), _randn(*shape, dtype=dtype, seed=6),
            _randn(n, dtype=wdtype, seed=2), _randn(n, dtype=wdtype, seed=3))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(7, 1000), (3, 4099), (2, 3, 257)], ids=str)
def test_add_layer_norm_matches_torch(shape, dtype):
    _check_add_layer_norm(*_add_inputs(shape, dtype))


@pytest.mark.parametrize("use", [("y",), ("h",)], ids=["only_y_used", "only_h_used"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_add_layer_norm_one_output_used(use, dtype):
    """dh None (the backward kernel skips reading it) or dy None (dx = dr = dh, no kernel)."""
    _check_add_layer_norm(*_add_inputs((6, 500), dtype), use=use)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=str)
def test_add_layer_norm_mixed_dtypes(wdtype):
    """bf16 activations with fp32 or bf16 weights; an fp32 residual still gives h in x's dtype."""
    x, r, w, b = _add_inputs((5, 320), torch.bfloat16, wdtype)
    _check_add_layer_norm(x, r, w, b)
    _check_add_layer_norm(x, r.float(), w, b)


def test_add_layer_norm_model_layout_and_strides():
    """[s, b, h] inputs as the model passes them, and a residual that is a strided view."""
    x, r, w, b = _add_inputs((6, 2, 192))
    _check_add_layer_norm(x, r, w, b)
    wide = _randn(6, 2, 400, seed=7)
    _check_add_layer_norm(x, wide[..., 100:292], w, b)


def test_add_layer_norm_looped_path(looped):
    _check_add_layer_norm(*_add_inputs((9, 1000)))
    _check_add_layer_norm(*_add_inputs((9, 1000)), use=("y",))


@pytest.mark.parametrize("shape", [(48, 1000), (32, 20000)], ids=str)
def test_add_layer_norm_gpu_launch_config(gpu_launch_config, shape):
    _check_add_layer_norm(*_add_inputs(shape))


def _gpu_configs(block_n=1024):
    """Every GPU autotune candidate that fits rows of block_n, for the forward and the backward."""
    params = []
    for kernel in ("fwd", "bwd"):
        for c in layernorm.candidates(kernel == "bwd", block_n):
            params.append(pytest.param(kernel, c, id=f"{kernel}-BLOCK_M{c.kwargs['BLOCK_M']}-warps{c.num_warps}"))
    return params


@pytest.mark.parametrize("n,kernel,config", [pytest.param(1000, *p.values, id=p.id) for p in _gpu_configs()] + [
    pytest.param(200, *p.values, id=f"n200-{p.id}") for p in _gpu_configs(256) if p.values[0] == "bwd"])
def test_add_layer_norm_each_gpu_config(gpu_launch_config, monkeypatch, n, kernel, config):
    """Each autotune candidate computes the same function (the autotuner may pick any of them); at rows of 200
    (256 wide tiles) the backward's, 8 elements a thread at most (NARROW_BWD_N), with up to 16 rows a tile."""
    tuned = getattr(layernorm, "_" + kernel)
    monkeypatch.setattr(tuned, "configs", [config])
    monkeypatch.setattr(tuned, "cache", {})
    _check_add_layer_norm(*_add_inputs((90, n)))


def _fake_timings(monkeypatch, tuned, times):
    """The autotuner runs each config once and takes next(times) as its timing: triton >= 3.2 times through the
    autotuner's do_bench, torch 2.4's triton 3.0 (and 3.1) through its module's (the GPU's, with warmup and rep)."""
    import triton.runtime.autotuner

    def bench(fn, quantiles, **kwargs):
        fn()
        return [next(times)] * 3
    monkeypatch.setitem(tuned.__dict__, "do_bench", bench)
    monkeypatch.setattr(triton.runtime.autotuner, "do_bench", bench, raising=False)


def test_add_layer_norm_through_the_gpu_autotuner(gpu_launch_config, monkeypatch):
    """The autotuner as on a GPU (all candidates, pruned to the row width, each run while being
    timed, fake timings that pick the last) gives correct results; layer_norm and add_layer_norm
    are tuned separately."""
    for tuned in (layernorm._fwd, layernorm._bwd):
        times = iter(range(1000, 0, -1))
        monkeypatch.setattr(tuned, "configs", layernorm.CONFIGS)
        monkeypatch.setattr(tuned, "cache", {})
        monkeypatch.setattr(tuned, "cache_results", False, raising=False)  # (no timings from disk; triton >= 3.4)
        _fake_timings(monkeypatch, tuned, times)
    _check_add_layer_norm(*_add_inputs((40, 1000)))
    _check_layer_norm(_randn(40, 1000), _randn(1000, seed=2), _randn(1000, seed=3))
    for tuned in (layernorm._fwd, layernorm._bwd):
        assert len(tuned.cache) == 2 and len(set(tuned.cache.values())) == 1
        assert tuned.best_config.kwargs["BLOCK_M"] * 1024 <= 8192


@pytest.mark.parametrize("triton_version, numpy_version, refused", [
    ("3.6.0", "2.4.6", True), ("3.0.0", "2.4.0rc1", True), ("3.6.0", "2.3.5", False), ("3.7.0", "2.4.6", False),
    ("3.10.1+git0123abc", "2.5.0", False), ("unknown", "2.4.6", False)])
def test_an_interpreter_that_cannot_run_the_kernels_is_one_message(triton_version, numpy_version, refused,
                                                                    monkeypatch):
    """triton < 3.7's interpreter with numpy >= 2.4 fails in every kernel with a loop ("only 0-dimensional
    arrays can be converted": seen with triton 3.6.0 and numpy 2.4.6): a CPU launch and kernels=triton on a CPU
    say so, and what to install, instead."""
    from megatron_mini import training
    from megatron_mini.config import ConfigError, TrainConfig
    why = kernels.interpreter_unsupported(triton_version, numpy_version)
    assert bool(why) == refused
    if not refused:
        return
    assert f"triton {triton_version}" in why and f"numpy {numpy_version}" in why and "triton>=3.7" in why
    monkeypatch.setattr(kernels, "interpreter_unsupported", lambda: why)
    monkeypatch.setattr(training, "interpreter_unsupported", lambda: why)
    monkeypatch.setattr(layernorm, "_INTERPRET", True)          # (a GPU machine's tests import no interpreter)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="numpy<2.4"):
        layer_norm(torch.randn(2, 8), torch.ones(8), torch.zeros(8))
    with pytest.raises(ConfigError, match=f"kernels=triton: .*numpy {numpy_version}.*; or use kernels=torch"):
        training.setup_device(TrainConfig(kernels="triton", device="cpu"))


def test_host_cdiv_and_next_power_of_2_are_tritons():
    """The wrappers' plain-Python cdiv and next_power_of_2 (triton's are constexpr functions, ~3 us a call on the
    host) give what triton's give."""
    import triton
    for a in range(1, 5000):
        assert kernels.next_power_of_2(a) == triton.next_power_of_2(a)
        assert [kernels.cdiv(a, b) for b in (1, 3, 64, 8192)] == [triton.cdiv(a, b) for b in (1, 3, 64, 8192)]


def test_autotuners_cache_timings_where_triton_can():
    """kernels.autotune asks for timings cached on disk (cache_results) only of a triton.autotune that takes it
    (3.4 on): torch 2.4's triton 3.0 refused the keyword, and the kernel modules failed to import."""
    def autotune_3_0(configs, key, prune_configs_by=None, reset_to_zero=None, restore_value=None, pre_hook=None,
                     post_hook=None, warmup=None, rep=None, use_cuda_graph=False):
        pass

    def autotune_3_4(configs, key, prune_configs_by=None, reset_to_zero=None, restore_value=None, pre_hook=None,
                     post_hook=None, warmup=None, rep=None, use_cuda_graph=False, do_bench=None, cache_results=False):
        pass
    assert kernels.autotune_cache(autotune_3_0) == {}
    assert kernels.autotune_cache(autotune_3_4) == {"cache_results": True}
    import triton
    installed = kernels.autotune_cache(triton.autotune)
    assert installed == ({"cache_results": True} if kernels._major_minor(triton.__version__) >= (3, 4) else {})


def test_the_autotuner_is_asked_once_per_key(gpu_launch_config, monkeypatch):
    """kernels.launch_tuned: the first launch of a key (row width, residual or not, the tensors' dtypes) goes
    through the autotuner (here all GPU candidates, fake timings that pick the last pruned); later ones launch
    the config it chose for that key straight, with the same result."""
    tuned = layernorm._fwd
    times = iter(range(10**6, 0, -1))
    monkeypatch.setattr(tuned, "configs", layernorm.CONFIGS)
    monkeypatch.setattr(tuned, "cache", {})                     # (a new cache: launch_tuned forgets its choices)
    monkeypatch.setattr(tuned, "cache_results", False, raising=False)   # (triton >= 3.4 has it)
    _fake_timings(monkeypatch, tuned, times)
    asked, straight, inside = [], [], []
    run, fn_run = tuned.run, tuned.fn.run

    def ask(*a, **k):
        asked.append(a[13])                                     # n_cols
        inside.append(1)
        try:
            return run(*a, **k)
        finally:
            inside.pop()

    def launch(*a, **k):
        if not inside:
            straight.append((a[13], a[0].dtype, k["HAS_RESIDUAL"], k["BLOCK_M"], k["num_warps"]))
        return fn_run(*a, **k)
    monkeypatch.setattr(tuned, "run", ask)
    monkeypatch.setattr(tuned.fn, "run", launch)
    # fn[grid] through fn.run, as a JITFunction's (triton 3.0 to 3.3's interpreter launches it without its run)
    monkeypatch.setattr(type(tuned.fn), "__getitem__",
                        lambda fn, grid: lambda *a, **k: fn.run(*a, grid=grid, warmup=False, **k))
    w, b = _randn(300, seed=2), _randn(300, seed=3)
    x = _randn(40, 300)
    first, again = layer_norm(x, w, b), layer_norm(x, w, b)
    assert torch.equal(first, again)
    layer_norm(x.to(torch.bfloat16), w, b)
    add_layer_norm(x, _randn(40, 300, seed=4), w, b)
    layer_norm(_randn(40, 200), w[:200], b[:200])
    layer_norm(_randn(40, 200), w[:200], b[:200])
    assert asked == [300, 300, 300, 200]
    cache, chosen = kernels._CHOSEN[tuned]
    assert cache is tuned.cache and len(chosen) == 4
    for (key, dtypes), config in chosen.items():              # the autotuner's own key: values, then dtypes
        assert tuned.cache[(*key, *(str(d) for d in dtypes if d is not None))] is config
    picked = {(k[0], k[2], k[1]): c for k, c in tuned.cache.items()}    # (n_cols, x dtype, residual)
    assert [s[:3] for s in straight] == [(300, torch.float32, False), (200, torch.float32, False)]
    for n, dtype, residual, block_m, warps in straight:
        config = picked[(n, str(dtype), residual)]
        assert (block_m, warps) == (config.kwargs["BLOCK_M"], config.num_warps)
        block_n = kernels.next_power_of_2(n)
        assert config is not layernorm.candidates(False, block_n)[0]   # (a choice was made)


@pytest.mark.parametrize("cc", [90, 80])
@pytest.mark.parametrize("block_n", [2**k for k in range(15)])
def test_gpu_configs_fit_every_width(block_n, cc):
    """Every fused width gets candidates (an empty list would leave the autotuner nothing) within the
    tile and per-thread bounds, each within its per-thread register share (64 K / threads, <= 255), on an
    H100 and on an A100 (cc 80: at most 16 elements a thread forward); the forward's are none of FWD_SPILLING,
    each of whose tiles keeps a candidate in other warps."""
    for backward, widest in ((False, layernorm.MAX_FUSED_N), (True, layernorm.MAX_FUSED_BWD_N)):
        if block_n > widest:
            continue
        tile, per_thread, regs = layernorm.budget(backward, block_n, cc)
        fit = layernorm.candidates(backward, block_n, cc)
        assert fit
        for c in fit:
            elems = c.kwargs["BLOCK_M"] * block_n
            per = elems // (32 * c.num_warps)
            assert min(tile[0], block_n) <= elems <= max(tile[1], block_n)
            assert per_thread[0] <= per <= per_thread[1]
            assert regs[0] + regs[1] * per <= min(255, 65536 // (32 * c.num_warps))
        if not backward:
            kept = {(c.kwargs["BLOCK_M"], block_n, c.num_warps) for c in fit}
            model = {(c.kwargs["BLOCK_M"], block_n, c.num_warps)
                     for c in layernorm.fitting_configs(layernorm.CONFIGS, block_n, tile, per_thread, regs)}
            assert kept == model - layernorm.FWD_SPILLING
            assert all(any(k[:2] == spilled[:2] for k in kept) for spilled in model & layernorm.FWD_SPILLING)


@pytest.mark.parametrize("block_n", [512, 1024, 2048, 4096])
def test_the_h100_keeps_its_candidates_where_they_were_measured(block_n):
    """On an H100 the benchmarked widths (768 to 4096, docs/benchmarks.md) are pruned as they were when timed: the
    narrow-row and pre-Hopper caps on elements per thread (layernorm.budget) reach neither. (FWD_SPILLING, found
    since under other Tritons, takes the forward's (2 rows, 32 warps) from 4096's; no candidate at the others.)"""
    assert layernorm.budget(False, block_n) == (layernorm.FWD_TILE, layernorm.FWD_PER_THREAD, layernorm.FWD_REGS)
    assert layernorm.budget(True, block_n) == (layernorm.BWD_TILE, layernorm.BWD_PER_THREAD, layernorm.BWD_REGS)


def test_layer_norm_strided_weights_and_wrong_sizes():
    """A strided weight is read right (the kernels assume unit stride); a weight or bias of another length
    than N is refused, as F.layer_norm refuses it (the kernel read past its end)."""
    big_w, big_b = _randn(2 * 96, seed=2), _randn(2 * 96, seed=3)
    _check_layer_norm(_randn(5, 96), big_w[::2], big_b[::2])
    x = _randn(4, 32)
    with pytest.raises(ValueError, match=r"weight and bias must be \[32\] for x \[\.\.\., 32\], got \(16,\)"):
        layer_norm(x, _randn(16, seed=2), _randn(32, seed=3))
    with pytest.raises(ValueError, match="weight and bias must be"):
        add_layer_norm(x, x, _randn(32, seed=2), _randn(31, seed=3))


@pytest.mark.parametrize("shape", [(0, 32), (3, 0, 32)])
def test_layer_norm_of_no_rows(shape):
    x, w, b = _randn(*shape).requires_grad_(), _randn(32, seed=2).requires_grad_(), _randn(32, seed=3).requires_grad_()
    y = layer_norm(x, w, b)
    h, y2 = add_layer_norm(x, x, w, b)
    assert y.shape == y2.shape == h.shape == shape
    dw, db = torch.autograd.grad(y.sum() + y2.sum(), (w, b))
    assert not dw.any() and not db.any()


def test_add_layer_norm_rejects_mismatched_shapes():
    x, r, w, b = _add_inputs((4, 64))
    with pytest.raises(ValueError, match="one shape"):
        add_layer_norm(x, r[:2], w, b)


def test_torch_add_layer_norm_reference():
    """The eager reference the benchmark times: h in x's dtype, y = F.layer_norm(h)."""
    x, r, w, b = _add_inputs((4, 64), torch.bfloat16)
    h, y = torch_add_layer_norm(x, r.float(), w, b)
    assert h.dtype == y.dtype == torch.bfloat16
    torch.testing.assert_close(h, (x.float() + r.float()).to(torch.bfloat16), atol=0, rtol=0)
    torch.testing.assert_close(y, F.layer_norm(h, (64,), w, b), atol=0, rtol=0)


def test_importing_kernels_package_does_not_import_triton():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "import sys, megatron_mini.kernels; assert 'triton' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=repo, check=True)


# ----------------------------------------------------------------------------------- under torch.compile
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_kernels_are_one_graph_under_compile(backend):
    """The model's kernel entry points (add_layer_norm, layer_norm, flash_attention_qkv) as custom ops: a
    function of all three compiles to one graph without a break (an opaque call each), and its outputs
    and input gradients are eager's (the same kernels; inductor fuses the torch ops around them, which
    round like eager's in fp32)."""
    import torch._dynamo
    if backend == "inductor":
        skip_without_cpu_compiler(DEVICE)
    from megatron_mini.kernels.attention import flash_attention_qkv

    def f(x, r, w, b, w2, b2, qkv):
        h, y = add_layer_norm(x, r, w, b)
        z = layer_norm(y * 2 + h, w2, b2)
        a = flash_attention_qkv(qkv * 1.5, 2, causal=True)
        return (z * z).sum() + h.sum() + (a * torch.arange(a.shape[-1], device=a.device)).sum()

    args = [_randn(24, 2, 40, seed=i).requires_grad_() for i in range(2)]
    args += [_randn(40, seed=2 + i).requires_grad_() for i in range(4)]
    args += [_randn(24, 2, 3 * 2 * 16, seed=6).requires_grad_()]
    explained = torch._dynamo.explain(f)(*args)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    torch._dynamo.reset()
    out, grads = [], []
    for fn in (f, torch.compile(f, backend=backend, dynamic=False)):
        out.append(fn(*args))
        grads.append(torch.autograd.grad(out[-1], args))
    torch.testing.assert_close(out[1], out[0])
    for g_compiled, g_eager in zip(grads[1], grads[0]):
        torch.testing.assert_close(g_compiled, g_eager)


@pytest.mark.parametrize("rows", ["fused", "looped"])
def test_every_launch_says_fp_fusion(rows, request, monkeypatch):
    """Every kernel launch passes enable_fp_fusion (kernels.FP_FUSION: FMA contraction, as the kernels were
    measured), not Triton's default, which 3.10 turns off: LayerNorm and add + LayerNorm (fused and looped), the
    attention's forward, backward and dropout mask, the cross-entropy's two kernels."""
    from triton.runtime.interpreter import GridExecutor
    from triton.runtime.jit import JITFunction

    from megatron_mini.kernels import attention, cross_entropy
    if rows == "looped":
        request.getfixturevalue("looped")
    launches = []
    # a GPU launch's JITFunction.run, an interpreted one's GridExecutor (which every triton's interpreter calls
    # with the launch's arguments: 3.0's InterpretedFunction[grid] skips its run)
    for cls, method in ((GridExecutor, "__call__"), (JITFunction, "run")):
        def run(self, *args, _run=getattr(cls, method), **kw):
            launches.append((getattr(self, "__name__", None) or self.fn.__name__, kw.get("enable_fp_fusion")))
            return _run(self, *args, **kw)
        monkeypatch.setattr(cls, method, run)
    x = _randn(6, 300, dtype=torch.bfloat16).requires_grad_()
    r = _randn(6, 300, dtype=torch.bfloat16, seed=1).requires_grad_()
    w, b = _randn(300, seed=2).requires_grad_(), _randn(300, seed=3).requires_grad_()
    torch.autograd.backward([layer_norm(x, w, b).float().sum(), *(t.float().sum() for t in add_layer_norm(x, r, w, b))])
    if rows == "fused":
        q, k, v = (_randn(1, 2, 16, 16, dtype=torch.bfloat16, seed=s).requires_grad_() for s in (4, 5, 6))
        attention.flash_attention(q, k, v, dropout_p=0.1).float().sum().backward()
        attention.dropout_keep_mask(torch.zeros((), dtype=torch.int64, device=DEVICE), 1, 2, 16, 0.1)
        logits, targets = _randn(4, 64, dtype=torch.bfloat16), torch.arange(4, device=DEVICE)
        stats = cross_entropy.row_stats(logits, targets, 64, True)
        cross_entropy.logits_grad(logits, targets, stats[:2], torch.ones(4, device=DEVICE), 64, 0.1, 64)
    names = {name for name, _ in launches}
    assert names >= ({"_fwd_looped", "_bwd_row_sums", "_bwd_looped"} if rows == "looped" else
                     {"_fwd", "_bwd", "_bwd_delta", "_bwd_dkdv", "_bwd_dq", "_keep_mask", "_stats", "_grad"}), names
    assert all(fusion is True for _, fusion in launches), [name for name, fusion in launches if fusion is not True]
