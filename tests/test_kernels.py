"""Triton LayerNorm and scaled masked softmax against independent fp32 torch references.

Runs on a GPU when there is one, else on CPU under the Triton interpreter (conftest sets
TRITON_INTERPRET=1 before anything imports triton). Shapes stay small for the interpreter.
Tolerances: 16-bit outputs are compared with ~2 ulp of the output dtype (the kernels do fp32
math on the same rounded inputs as the reference, so the rounding of the result dominates).
"""
import math
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch
import torch.nn.functional as F

from kernels import layernorm, softmax
from kernels.layernorm import FusedLayerNorm, layer_norm
from kernels.softmax import scaled_masked_softmax, torch_scaled_masked_softmax

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
    """Forward and backward of the kernel vs F.layer_norm on fp32 copies of the same values."""
    dtype = x.dtype
    x, w, b = (t.detach().requires_grad_() for t in (x, w, b))
    y = layer_norm(x, w, b, eps)
    dy = _randn(*y.shape, dtype=dtype, seed=1)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), dy)

    xr, wr, br = (t.detach().float().requires_grad_() for t in (x, w, b))
    yr = F.layer_norm(xr, wr.shape, wr, br, eps)
    dxr, dwr, dbr = torch.autograd.grad(yr, (xr, wr, br), dy.float())

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


def test_layer_norm_looped_path_many_rows(monkeypatch):
    """Rows wider than MAX_FUSED_N go through the chunked kernels; shrink the limit so several
    rows per backward program accumulate into the partial dw/db buffers."""
    monkeypatch.setattr(layernorm, "MAX_FUSED_N", 256)
    monkeypatch.setattr(layernorm, "LOOP_BLOCK_N", 128)
    assert layernorm._config(9, 1000)[3]  # looped
    _check_layer_norm(_randn(9, 1000) * 2 - 1, _randn(1000, seed=2), _randn(1000, seed=3))


@pytest.fixture
def gpu_launch_config(monkeypatch):
    """On CPU, make the wrappers choose the launch configuration they use on a GPU (one row per
    program for long rows, backward programs from an SM count) so the interpreter checks it."""
    if DEVICE == "cpu":
        for module in (layernorm, softmax):
            monkeypatch.setattr(module, "_INTERPRET", False)
            monkeypatch.setattr(module, "_check_device", lambda x: None)
        monkeypatch.setattr(layernorm, "_sm_count", lambda device: 4)


@pytest.mark.parametrize("shape", [(48, 1000), (40, 3000), (32, 20000)], ids=str)
def test_layer_norm_gpu_launch_config(gpu_launch_config, shape):
    _check_layer_norm(_randn(*shape), _randn(shape[-1], seed=2), _randn(shape[-1], seed=3))


def test_layer_norm_constant_rows_give_bias():
    x = torch.full((4, 300), 3.0, device=DEVICE)
    w, b = _randn(300, seed=2), _randn(300, seed=3)
    y = layer_norm(x, w, b, 1e-5)
    torch.testing.assert_close(y, b.expand_as(y), atol=0, rtol=0)


def test_fused_layer_norm_is_a_drop_in_for_nn_layer_norm():
    ref = torch.nn.LayerNorm(64, eps=1e-6, device=DEVICE)
    fused = FusedLayerNorm(64, eps=1e-6, device=DEVICE)
    assert list(fused.state_dict()) == list(ref.state_dict()) == ["weight", "bias"]
    assert [n for n, _ in fused.named_parameters()] == ["weight", "bias"]
    torch.testing.assert_close(fused.state_dict(), ref.state_dict(), atol=0, rtol=0)
    with torch.no_grad():
        ref.weight.normal_()
        ref.bias.normal_()
    fused.load_state_dict(ref.state_dict())
    x = _randn(5, 3, 64)
    torch.testing.assert_close(fused(x), ref(x), atol=1e-5, rtol=1e-5)
    half = FusedLayerNorm(64, dtype=torch.bfloat16, device=DEVICE)
    assert half.weight.dtype == torch.bfloat16 and half.weight.device.type == DEVICE


# ------------------------------------------------------------------------------------- softmax
def _reference_softmax(x, scale, masked):
    """fp32 softmax(scale * x) with `masked` (bool, broadcastable) positions removed -> 0."""
    z = x.float() * scale
    if masked is None:
        return torch.softmax(z, -1)
    z = z.masked_fill(masked, float("-inf"))
    e = torch.exp(z - z.amax(-1, keepdim=True).clamp_min(-1e30))  # finite max for full masks
    s = e.sum(-1, keepdim=True)
    return e / torch.where(s == 0, torch.ones_like(s), s)


def _causal(sq, sk):
    i = torch.arange(sq, device=DEVICE)[:, None]
    j = torch.arange(sk, device=DEVICE)[None, :]
    return j > i + (sk - sq)


def _check_softmax(fn, x, scale, causal=False, mask=None):
    """Forward and backward of `fn` vs the fp32 reference; masked entries exactly 0."""
    dtype = x.dtype
    masked = mask
    if causal:
        c = _causal(*x.shape[-2:])
        masked = c if masked is None else masked | c
    x = x.detach().requires_grad_()
    y = fn(x, scale, causal=causal, mask=mask)
    dy = _randn(*y.shape, dtype=dtype, seed=1)
    (dx,) = torch.autograd.grad(y, x, dy)
    xr = x.detach().float().requires_grad_()
    yr = _reference_softmax(xr, scale, masked)
    (dxr,) = torch.autograd.grad(yr, xr, dy.float())

    assert y.dtype == dtype and y.shape == x.shape and dx.dtype == dtype
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    _close(y, yr, dtype)
    # dx = scale*y*(dy - sum(dy*y)) from the 16-bit y: the rounding of y and of sum(dy*y)
    # costs ~1 ulp of the largest |dx|, also where dy - sum(dy*y) cancels
    atol, rtol = TOL[dtype]
    _close(dx, dxr, dtype, atol=atol + rtol * dxr.abs().max().item())
    if masked is not None:
        full = masked.expand(x.shape)
        assert (y[full] == 0).all() and (dx[full] == 0).all()
    return y


@pytest.mark.parametrize("fn", [scaled_masked_softmax, torch_scaled_masked_softmax],
                         ids=["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", ["plain", "causal", "mask", "mask+causal"])
def test_softmax_matches_reference(mode, dtype, fn):
    x = (_randn(2, 3, 24, 24) * 4).to(dtype)
    mask = (_randn(2, 1, 24, 24, seed=5) > 0.5) if "mask" in mode else None
    _check_softmax(fn, x, 0.37, causal="causal" in mode, mask=mask)


@pytest.mark.parametrize("mask_shape", [(2, 3, 5, 1000), (2, 1, 5, 1000), (1, 3, 5, 1000), (5, 1000)],
                         ids=str)
def test_softmax_mask_broadcast_odd_sk(mask_shape):
    mask = _randn(*mask_shape, seed=5) > 0.0
    _check_softmax(scaled_masked_softmax, _randn(2, 3, 5, 1000), 0.125, mask=mask)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_causal_sq_shorter_than_sk(dtype):
    """Bottom-right aligned: query i of sq sees keys j <= i + sk - sq (the last query sees all)."""
    y = _check_softmax(scaled_masked_softmax, _randn(1, 2, 16, 40).to(dtype), 1.0, causal=True)
    assert (y[..., -1, :] > 0).all() and (y[..., 0, 25:] == 0).all() and (y[..., 0, :25] > 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_longest_supported_row(dtype):
    _check_softmax(scaled_masked_softmax, _randn(1, 1, 2, softmax.MAX_SK).to(dtype), 0.5, causal=True)


@pytest.mark.parametrize("layout", ["heads_seq_swapped", "row_strided", "transposed"])
def test_softmax_non_contiguous(layout):
    base = _randn(2, 6, 4, 40)
    x = {"heads_seq_swapped": base.transpose(1, 2),  # [2, 4, 6, 40], unit last stride
         "row_strided": base[..., 3:33],              # rows 40 apart
         "transposed": base.transpose(2, 3)}[layout]  # last stride 40
    assert not x.is_contiguous()
    _check_softmax(scaled_masked_softmax, x, 0.7, causal=(layout != "transposed"),
                   mask=_randn(x.shape[-2], x.shape[-1], seed=4) > 1.0)


def test_softmax_gpu_launch_config(gpu_launch_config):
    _check_softmax(scaled_masked_softmax, _randn(2, 2, 16, 1000), 0.3, causal=True,
                   mask=_randn(2, 1, 16, 1000, seed=4) > 1.0)


def test_softmax_all_zero_causal_input_is_uniform_over_the_past():
    y = scaled_masked_softmax(torch.zeros(2, 3, 33, 33, device=DEVICE), 1.0, causal=True)
    i = torch.arange(33, device=DEVICE)[:, None]
    expected = torch.where(_causal(33, 33), 0.0, 1.0 / (i + 1.0)).expand_as(y)
    torch.testing.assert_close(y, expected, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("fn", [scaled_masked_softmax, torch_scaled_masked_softmax],
                         ids=["triton", "torch"])
def test_softmax_fully_masked_rows_are_zero_not_nan(fn):
    mask = torch.zeros(1, 1, 6, 50, dtype=torch.bool, device=DEVICE)
    mask[..., 2, :] = True  # row 2 sees nothing
    x = _randn(2, 2, 6, 50).requires_grad_()
    y = fn(x, 0.5, mask=mask)
    y.backward(_randn(*y.shape, seed=1))
    assert (y[:, :, 2] == 0).all() and (x.grad[:, :, 2] == 0).all()
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    torch.testing.assert_close(y.sum(-1)[:, :, [0, 1, 3, 4, 5]], torch.ones(2, 2, 5, device=DEVICE))


def test_softmax_falls_back_to_torch_above_max_sk_and_warns_once(monkeypatch):
    monkeypatch.setattr(softmax, "MAX_SK", 32)
    monkeypatch.setattr(softmax, "_warned_fallback", False)

    def kernel_path(*args):
        raise AssertionError("the Triton path was taken above MAX_SK")

    monkeypatch.setattr(softmax, "_SoftmaxFn", types.SimpleNamespace(apply=kernel_path))
    x = _randn(1, 2, 8, 48)
    with pytest.warns(UserWarning, match="sk=48"):
        _check_softmax(scaled_masked_softmax, x, 0.3, causal=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _check_softmax(scaled_masked_softmax, x, 0.3, mask=_randn(8, 48, seed=3) > 0)


def test_softmax_rejects_non_bool_mask():
    with pytest.raises(TypeError, match="bool"):
        scaled_masked_softmax(_randn(1, 1, 4, 4), 1.0, mask=torch.zeros(4, 4, device=DEVICE))


def test_importing_kernels_package_does_not_import_triton():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = "import sys, kernels; assert 'triton' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=repo, check=True)
