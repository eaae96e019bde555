"""Record of a probe run on one H100, 2026-11-23 (figures: docs/benchmarks.md, "First GPU run").
LayerNorm backward: where ~500 us of CPU per call goes when autograd calls it (throwaway, GPU)."""
import collections
import threading
import time

import torch

from megatron_mini.kernels import layernorm as L

M, N = 16384, 768
x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
b = torch.randn(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
acc = collections.defaultdict(float)


def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t
    return wrapper


def cpu_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    acc.clear()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    total = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return total, {k: v / n * 1e6 for k, v in acc.items()}


def fwd_bwd():
    torch.autograd.grad(L.layer_norm(x, w, b), (x, w, b), dy)


print("baseline fwd+bwd CPU us:", cpu_us(fwd_bwd))
# instrument the pieces
orig_backward, orig_bw, orig_launch = L._AddLayerNormFn.backward, L._backward, L._launch
L._AddLayerNormFn.backward = staticmethod(timed("Function.backward", orig_backward))
L._backward = timed("_backward", orig_bw)
L._launch = timed("_launch", orig_launch)
L._sm_count = timed("_sm_count", L._sm_count)
print("instrumented fwd+bwd:", cpu_us(fwd_bwd))

# _backward from a plain thread
_, wd = x.detach(), w.detach()
y = L.layer_norm(x.detach(), wd, b.detach())
stats = torch.empty(2, M, device="cuda")   # (_backward took stats[0], stats[1] then; stats since)
L._forward(x.detach(), None, wd, b.detach(), 1e-5)
res = {}


def in_thread():
    res["t"] = cpu_us(lambda: orig_bw(x.detach(), dy, None, wd, stats))


th = threading.Thread(target=in_thread)
th.start()
th.join()
print("_backward in a thread:", res["t"])
print("_backward in main:", cpu_us(lambda: orig_bw(x.detach(), dy, None, wd, stats)))


class Trivial(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


print("trivial autograd fn fwd+bwd:", cpu_us(lambda: torch.autograd.grad(Trivial.apply(x), (x,), dy)))
# backward launching the plain kernel with the tuned config (no autotuner call)
cfg = L._bwd.best_config
print("bwd config", cfg)


def plain_launch(tuned, grid, *args, n_rows, n_cols, block_n, **meta):
    c = tuned.best_config
    tuned.fn[grid](*args, BLOCK_N=block_n, **meta, **c.all_kwargs())


L._launch = plain_launch
print("fwd+bwd with plain launches:", cpu_us(fwd_bwd))
L._launch = orig_launch
L._AddLayerNormFn.backward = staticmethod(orig_backward)
# the sum of partials in torch vs none
print("part.sum alone:", cpu_us(lambda: torch.empty(264, 2 * N, device="cuda").sum(0).to(torch.bfloat16)))
