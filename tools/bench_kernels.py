"""Benchmark the Triton LayerNorm and scaled masked softmax against torch eager, torch.compile
and Liger-Kernel (when installed): forward and backward time, achieved bandwidth, speedup.

    python tools/bench_kernels.py --out bench_out/kernels [--dtype bf16]

On a GPU: LayerNorm [4096, hidden] for hidden 1024..16384, causal softmax [1, heads, sq, sk]
for sk 512..16384 (heads chosen so each tensor has 2^26 elements); median time of
triton.testing.do_bench. Without a GPU the kernels run under the Triton interpreter: one small
size per op, timed with perf_counter, only to exercise the script (never a speed claim).

Byte model (each tensor crossing memory once; the same bytes for every implementation, so
GB/s = bytes / time compares them). e = activation bytes/element, ew = weight bytes/element:
  LayerNorm [M, N]  fwd: read x, write y = 2*M*N*e; read w, b = 2*N*ew; write mean, rstd = 8*M
                    bwd: read x, dy, write dx = 3*M*N*e; read w, write dw, db = 3*N*ew; read mean, rstd = 8*M
  softmax [R rows, sk] (causal, no mask tensor)
                    fwd: read x, write y = 2*R*sk*e;  bwd: read y, dy, write dx = 3*R*sk*e
  The Triton softmax skips reading the causally masked x (and y, dy) above the diagonal, so
  for it these GB/s are effective bandwidth: it moves fewer bytes than the model counts.
"""
import argparse
import os
import statistics
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU = torch.cuda.is_available()
if not GPU:  # must precede the first triton import (the kernels are interpreted on CPU)
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, REPO)

import torch.nn.functional as F  # noqa: E402

from kernels.layernorm import layer_norm  # noqa: E402
from kernels.softmax import scaled_masked_softmax, torch_scaled_masked_softmax  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# H100 goals (GB/s) and where they apply; each also asks for >= 1.5x torch eager
GOALS = {("layernorm", "fwd"): 2300, ("layernorm", "bwd"): 1500,
         ("softmax", "fwd"): 2700, ("softmax", "bwd"): 2400}
GOAL_SPEEDUP = 1.5


def _goal_applies(op: str, size: int) -> bool:
    return size == 4096 if op == "layernorm" else size <= 16384


def goals_text() -> str:
    where = {"layernorm": "at [4096, 4096]", "softmax": "for sk <= 16384"}
    return "Goals on an H100 (bf16), each also >= {}x torch eager: ".format(GOAL_SPEEDUP) + "; ".join(
        f"{op} {pass_} {where[op]} >= {gbps} GB/s" for (op, pass_), gbps in GOALS.items())


def _liger():
    """Liger-Kernel's LayerNorm and (plain, unscaled, unmasked) softmax, or None."""
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.softmax import LigerSoftmaxFunction
    except ImportError:
        return None
    return LigerLayerNormFunction.apply, LigerSoftmaxFunction.apply


def _median_ms(fn, reps: int) -> float:
    if GPU:
        import triton.testing
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _time_fwd_bwd(fn, inputs, reps):
    """(forward ms, backward ms, output) of fn(*inputs); backward = autograd.grad of all inputs."""
    leaves = [t for t in inputs if t.requires_grad]
    fwd = _median_ms(lambda: fn(*inputs), reps)
    y = fn(*inputs)
    dy = torch.randn_like(y)
    bwd = _median_ms(lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True), reps)
    return fwd, bwd, y.detach()


def _implementations(op: str):
    """name -> callable taking (x, w, b) for LayerNorm, (x,) for softmax; torch eager first."""
    if op == "layernorm":
        impls = {"torch": lambda x, w, b: F.layer_norm(x, w.shape, w, b, 1e-5),
                 "triton": lambda x, w, b: layer_norm(x, w, b, 1e-5)}
    else:
        impls = {"torch": lambda x: torch_scaled_masked_softmax(x, 0.125, causal=True),
                 "triton": lambda x: scaled_masked_softmax(x, 0.125, causal=True)}
    if not GPU:
        return impls
    impls["compile"] = torch.compile(impls["torch"], dynamic=False)
    liger = _liger()
    if liger is not None and op == "layernorm":
        impls["liger"] = lambda x, w, b: liger[0](x, w, b, 1e-5)
    elif liger is not None:  # not the same op: no scale, no causal mask
        impls["liger (plain softmax)"] = lambda x: liger[1](x)
    return impls


def _cases(dtype):
    """(op, size, shape text, inputs, fwd bytes, bwd bytes) for each benchmarked problem."""
    e = torch.finfo(dtype).bits // 8
    dev = "cuda" if GPU else "cpu"
    ln_sizes = [(4096, h) for h in (1024, 2048, 4096, 8192, 16384)] if GPU else [(64, 1024)]
    for m, n in ln_sizes:
        x = torch.randn(m, n, device=dev, dtype=dtype, requires_grad=True)
        w = torch.randn(n, device=dev, dtype=dtype, requires_grad=True)
        b = torch.randn(n, device=dev, dtype=dtype, requires_grad=True)
        yield ("layernorm", n, f"[{m}, {n}]", (x, w, b),
               2 * m * n * e + 2 * n * e + 8 * m, 3 * m * n * e + 3 * n * e + 8 * m)
    sm_sizes = [512, 1024, 2048, 4096, 8192, 16384] if GPU else [256]
    for sk in sm_sizes:
        sq = min(sk, 2048) if GPU else 64
        heads = max(1, 2**26 // (sq * sk)) if GPU else 4
        x = torch.randn(1, heads, sq, sk, device=dev, dtype=dtype, requires_grad=True)
        rows = heads * sq
        yield ("softmax", sk, f"[1, {heads}, {sq}, {sk}]", (x,), 2 * rows * sk * e, 3 * rows * sk * e)


def run(dtype, reps):
    results = []
    for op, size, shape, inputs, fwd_bytes, bwd_bytes in _cases(dtype):
        if GPU:
            torch._dynamo.reset()  # fresh torch.compile caches for each shape
        reference = None  # torch eager's output, to report the kernel's max |difference|
        for name, fn in _implementations(op).items():
            try:
                fwd, bwd, y = _time_fwd_bwd(fn, inputs, reps)
            except Exception as err:  # e.g. torch.compile without a working compiler
                print(f"  {op} {shape} {name}: failed ({type(err).__name__}: {err})")
                continue
            reference = y if reference is None else reference
            diff = (y.float() - reference.float()).abs().max().item()
            for pass_, ms, nbytes in (("fwd", fwd, fwd_bytes), ("bwd", bwd, bwd_bytes)):
                results.append(dict(op=op, size=size, shape=shape, pass_=pass_, impl=name, ms=ms,
                                    gbps=nbytes / ms / 1e6, diff=diff))
    return results


def table(results):
    """Markdown table: one line per (op, size, pass) with every implementation's GB/s."""
    impls = list(dict.fromkeys(r["impl"] for r in results))
    head = (["op", "shape", "pass", "triton ms", "max abs diff y"] + [f"{i} GB/s" for i in impls]
            + ["x torch"] + (["x compile"] if "compile" in impls else []) + ["goal (H100)", "met"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    keys = list(dict.fromkeys((r["op"], r["size"], r["shape"], r["pass_"]) for r in results))
    for op, size, shape, pass_ in keys:
        row = {r["impl"]: r for r in results if (r["op"], r["size"], r["pass_"]) == (op, size, pass_)}
        tri = row.get("triton")
        cells = [op, shape, pass_, f"{tri['ms']:.4g}" if tri else "-", f"{tri['diff']:.2g}" if tri else "-"]
        cells += [f"{row[i]['gbps']:.4g}" if i in row else "-" for i in impls]
        speed = {other: row[other]["ms"] / tri["ms"] if tri and other in row else None
                 for other in ("torch", "compile")}
        cells += [f"{speed['torch']:.3g}x" if speed["torch"] else "-"]
        if "compile" in impls:
            cells += [f"{speed['compile']:.3g}x" if speed["compile"] else "-"]
        goal = GOALS[(op, pass_)] if _goal_applies(op, size) else None
        cells += [f">= {goal} GB/s, >= {GOAL_SPEEDUP}x" if goal else "-"]
        met = "-"
        if goal and GPU and tri and speed["torch"]:
            met = "yes" if tri["gbps"] >= goal and speed["torch"] >= GOAL_SPEEDUP else "NO"
        cells += [met if GPU else "n/a (no GPU)"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results, path, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    for ax, (op, pass_) in zip(axes.flat, GOALS):
        sub = [r for r in results if r["op"] == op and r["pass_"] == pass_]
        for impl in dict.fromkeys(r["impl"] for r in sub):
            pts = sorted((r["size"], r["gbps"]) for r in sub if r["impl"] == impl)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=impl)
        if GPU:
            ax.axhline(GOALS[(op, pass_)], color="gray", linestyle="--", label="goal (H100)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("linear" if GPU else "log")
        ax.set_xlabel("hidden size" if op == "layernorm" else "sk")
        ax.set_ylabel("GB/s (byte model)")
        ax.set_title(f"{op} {pass_}")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_out/kernels", help="directory for the PNG and table")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--reps", type=int, default=5, help="CPU only: timed repetitions")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    if GPU:
        device = torch.cuda.get_device_name()
        print(f"GPU: {device}, dtype {args.dtype}; median of triton.testing.do_bench")
    else:
        device = "CPU, Triton interpreter"
        torch.set_num_threads(1)  # a shared small CPU: avoid thread oversubscription noise
        print("No CUDA GPU: the Triton kernels run under TRITON_INTERPRET=1 on the CPU. Timings cover "
              "one small size per op and only exercise this script; they say nothing about GPU speed.")
    results = run(dtype, args.reps)
    text = table(results) + "\n\n" + goals_text()
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_kernels.md"), "w") as f:
        f.write(f"device: {device}, dtype {args.dtype}\n\n{text}\n")
    png = os.path.join(args.out, "bench_kernels.png")
    plot(results, png, f"Triton kernels vs torch ({device}, {args.dtype})")
    print(f"wrote {png} and bench_kernels.md")


if __name__ == "__main__":
    main()
