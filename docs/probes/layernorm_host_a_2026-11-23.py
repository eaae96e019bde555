"""Record of a probe run on one H100, 2026-11-23 (figures: docs/benchmarks.md, "First GPU run").
Where the LayerNorm wrapper's time goes (throwaway, GPU): CPU us per call of each layer, do_bench of the
autograd path, and a torch.profiler table of one fwd+bwd."""
import time

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from megatron_mini.kernels import layernorm as L

M, N = 16384, 768
x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
b = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)


def cpu_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    cpu = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return cpu


def gpu_us(fn):
    return do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e3


x2 = x.detach()
y = torch.empty_like(x2)
stats = torch.empty(2, M, device="cuda")
mu, rstd = stats[0], stats[1]
L.layer_norm(x, w, b)  # autotune
cfg = L._fwd.best_config
print("fwd best config", cfg)
y0 = L.layer_norm(x, w, b)
torch.autograd.grad(y0, (x, w, b), dy)
print("bwd best config", L._bwd.best_config)
args = (x2, x2, x2, y, w.detach(), b.detach(), mu, rstd, N, N, N, N, M, N, 1e-5)
bm = cfg.kwargs["BLOCK_M"]
rows = [
    ("torch.empty", lambda: torch.empty((M, N), dtype=torch.bfloat16, device="cuda")),
    ("_fwd.fn plain launch", lambda: L._fwd.fn[(triton.cdiv(M, bm),)](*args, HAS_RESIDUAL=False, BLOCK_M=bm,
                                                                        BLOCK_N=1024, num_warps=cfg.num_warps)),
    ("_fwd tuned launch", lambda: L._fwd[lambda m: (triton.cdiv(M, m["BLOCK_M"]),)](*args, HAS_RESIDUAL=False,
                                                                                     BLOCK_N=1024)),
    ("_forward", lambda: L._forward(x2, None, w.detach(), b.detach(), 1e-5)),
    ("layer_norm no grad", lambda: L.layer_norm(x2, w.detach(), b.detach())),
    ("layer_norm with grad", lambda: L.layer_norm(x, w, b)),
    ("_backward", lambda: L._backward(x2, dy, None, w.detach(), stats)),   # (mu, rstd then; stats since)
    ("layer_norm fwd+bwd", lambda: torch.autograd.grad(L.layer_norm(x, w, b), (x, w, b), dy)),
    ("F.layer_norm fwd+bwd", lambda: torch.autograd.grad(F.layer_norm(x, (N,), w, b), (x, w, b), dy)),
]
print(f"{'what':28} {'CPU us/call':>12} {'do_bench us':>12}")
for name, fn in rows:
    print(f"{name:28} {cpu_us(fn):12.1f} {gpu_us(fn):12.1f}", flush=True)

from torch.profiler import ProfilerActivity, profile  # noqa: E402
for name, fn in (("ours", lambda: torch.autograd.grad(L.layer_norm(x, w, b), (x, w, b), dy)),
                 ("torch", lambda: torch.autograd.grad(F.layer_norm(x, (N,), w, b), (x, w, b), dy))):
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    print(f"==== profile {name} (10 fwd+bwd)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=48))
    print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=8, max_name_column_width=48))
