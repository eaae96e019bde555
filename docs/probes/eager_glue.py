"""(Run as python docs/probes/eager_glue.py from the repository root; on a GPU for figures, on CPU as a smoke
run at small sizes.) Written after the 2026-11-23 profile of the eager step; run on an H100 on 2026-11-24
(docs/benchmarks.md, "Third GPU run"). Two pieces of the eager step's glue, each way side by side (median of
do_bench, ms):

1. bias gradients into the fp32 main grad, dy [T, N] bf16 -> main [N] fp32 (15.7 ms a gpt2-small step):
   "sum+add"  main += dy.sum(0, fp32)     (what tensor_parallel.linear did then; now where gemm_into_fp32 is not addmm)
   "gemv"     main += 1^T dy as one GEMM with an fp32 output (accumulate_matmul with a ones row; now linear's way
              where gemm_into_fp32 is addmm, as on the H100 it ran on)
2. the attention core's fwd+bwd at gpt2-small's shape, [s, b, 3h] -> [s, b, h], with q, k, v taken from the
   qkv columns as model.Attention does ("split": the qkv gradient is one cat) or as it did before
   ("unbind" of a [s, b, 3, heads, d] view: a stack and a copy), under each SDPA backend and model.sdpa.
"""
import statistics
import time

import torch
import torch.nn.functional as F

from megatron_mini.model import sdpa
from megatron_mini.tensor_parallel import accumulate_matmul, gemm_into_fp32

cuda = torch.cuda.is_available()
dev = torch.device("cuda" if cuda else "cpu")
dtype = torch.bfloat16


def bench(fn, rep_ms=50):
    if cuda:
        import triton.testing
        return triton.testing.do_bench(fn, warmup=10, rep=rep_ms, return_mode="median")
    times = []
    for _ in range(5):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


T = 16384 if cuda else 512
print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}")
print(f"\n1. bias gradient into fp32, dy [{T}, N] bf16 (ms); 'gemv' is gemm_into_fp32's way: "
      f"{gemm_into_fp32(dev.type, dtype)} (addmm: one GEMM; mm: a GEMM, then an add; cast: a bf16 product)")
print("| N | sum+add | gemv | gemv max err vs sum+add |")
print("|---|---|---|---|")
ones = torch.ones(1, T, dtype=dtype, device=dev)
for n in (768, 2304, 3072, 4096):
    dy = torch.randn(T, n, dtype=dtype, device=dev)
    a, b = torch.zeros(n, device=dev), torch.zeros(1, n, device=dev)
    t_sum = bench(lambda: a.add_(dy.sum(0, dtype=torch.float32)))
    t_gemv = bench(lambda: accumulate_matmul(b, ones, dy))
    a.zero_(), b.zero_()
    a.add_(dy.sum(0, dtype=torch.float32)), accumulate_matmul(b, ones, dy)
    print(f"| {n} | {t_sum:.4f} | {t_gemv:.4f} | {(a - b[0]).abs().max().item():.2e} |")

s, bsz, heads, d = (1024, 16, 12, 64) if cuda else (128, 2, 4, 16)
h = heads * d


def unbind(qkv):
    return qkv.view(s, bsz, 3, heads, d).permute(2, 1, 3, 0, 4).unbind(0)


def split(qkv):
    return [t.view(s, bsz, heads, d).permute(1, 2, 0, 3) for t in qkv.split(h, dim=-1)]


backends = {"default": None}
if cuda:
    from torch.nn.attention import SDPBackend
    backends.update(cudnn=SDPBackend.CUDNN_ATTENTION, flash=SDPBackend.FLASH_ATTENTION)
    backends["model.sdpa (cuDNN first)"] = "model"
qkv = torch.randn(s, bsz, 3 * h, dtype=dtype, device=dev, requires_grad=True)
grad = torch.randn(s, bsz, h, dtype=dtype, device=dev)
print(f"\n2. attention core fwd+bwd, qkv [{s}, {bsz}, {3 * h}] (ms)\n| backend | unbind | split |\n|---|---|---|")
for name, backend in backends.items():
    row = []
    for way in (unbind, split):
        def step():
            y = (sdpa if backend == "model" else F.scaled_dot_product_attention)(*way(qkv), is_causal=True)
            y.permute(2, 0, 1, 3).reshape(s, bsz, h).backward(grad)
        try:
            if backend in (None, "model"):
                row.append(f"{bench(step):.4f}")
            else:
                from torch.nn.attention import sdpa_kernel
                with sdpa_kernel([backend]):
                    row.append(f"{bench(step):.4f}")
        except RuntimeError as e:          # this backend refuses the inputs (or is not built)
            row.append(f"n/a ({str(e).splitlines()[0][:60]})")
    print(f"| {name} | {row[0]} | {row[1]} |")
