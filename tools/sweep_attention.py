"""Sweep the launch configurations of the Triton flash attention on a GPU (picks GPU_CONFIGS, or
DROPOUT_CONFIGS with --dropout).

    python tools/sweep_attention.py [--shapes 16,12,1024,64 8,16,2048,128] [--quick] [--dropout 0.1]

For each shape (b, heads, s, d), causal, bf16: checks the kernel against fp32 SDPA math (relative
error of o, dq, dk, dv), then times, as medians of triton.testing.do_bench with rotating inputs,
the forward, the dk/dv kernel and the dq kernel for each candidate (BLOCK_M, BLOCK_N, warps,
stages), and prints the best of each next to cuDNN and flash SDPA (fwd+bwd). FLOPs: causal
fwd 2*b*h*s^2*d (half of 4*b*h*s^2*d), bwd 2.5x fwd. With --dropout the kernels and SDPA drop
probabilities (the value check is skipped: tests/test_attention.py checks dropout against its mask).
A fast candidate may still spill registers: check the winner with
`python tools/check_kernels.py --attention KIND=M,N,WARPS,STAGES` before putting it in the table.
"""
import argparse
import functools
import itertools
import sys

import torch

from bench.report import positive_ints
from defaults_help import RawDescriptionDefaultsHelp
from megatron_mini.errors import run_tool


def _shape(text: str) -> str:
    """An argparse type: B,HEADS,S,D, four positive integers (kept as the text, which the tables print)."""
    if positive_ints(text, 4) is None:
        raise argparse.ArgumentTypeError(f"wants B,HEADS,S,D (four positive integers), got {text!r}")
    return text


def _probability(text: str) -> float:
    """An argparse type: a dropout probability in [0, 1)."""
    try:
        p = float(text)
    except ValueError:
        p = float("nan")
    if not 0 <= p < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text!r}")
    return p


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=RawDescriptionDefaultsHelp)
    ap.add_argument("--shapes", nargs="*", type=_shape, default=["16,12,1024,64", "8,16,2048,128"],
                    metavar="B,HEADS,S,D", help="causal attention shapes")
    ap.add_argument("--quick", action="store_true", help="fewer candidates")
    ap.add_argument("--dropout", type=_probability, default=0.0,
                    help="attention dropout of the sweep (tunes DROPOUT_CONFIGS)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("sweep_attention.py needs a CUDA GPU")
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    from megatron_mini.kernels import attention as A

    table = A.DROPOUT_CONFIGS if args.dropout > 0 else A.GPU_CONFIGS   # the table _config reads (mutated here)
    ours = functools.partial(A.flash_attention, dropout_p=args.dropout)

    def bench(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")

    for shape in args.shapes:
        b, h, s, d = map(int, shape.split(","))
        flops_fwd = 2 * b * h * s * s * d
        sets = [[torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(4)]
                for _ in range(3)]
        do = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
        if args.dropout == 0:  # correctness
            q, k, v = sets[0][:3]
            o = A.flash_attention(q, k, v)
            g = torch.autograd.grad(o, (q, k, v), do)
            qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
            with sdpa_kernel(SDPBackend.MATH):
                orf = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
            gr = torch.autograd.grad(orf, (qf, kf, vf), do.float())
            err = lambda a, r: ((a.float() - r).norm() / r.norm()).item()   # noqa: E731
            print(f"shape {shape}: rel err o {err(o, orf):.2e} dq {err(g[0], gr[0]):.2e} dk {err(g[1], gr[1]):.2e} "
                  f"dv {err(g[2], gr[2]):.2e}", flush=True)
            del qf, kf, vf, orf, gr

        it = itertools.cycle(range(3))

        def rot():
            i = next(it)
            return sets[i][0], sets[i][1], sets[i][2]

        def fwd_bwd(attn):
            def run():
                q, k, v = rot()
                o = attn(q, k, v)
                torch.autograd.grad(o, (q, k, v), do)
            return run

        def fwd_only(attn):
            def run():
                q, k, v = rot()
                with torch.no_grad():
                    attn(q, k, v)
            return run

        rows = []
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            def sdpa(q, k, v, backend=backend):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=args.dropout)
            try:
                fb, f = bench(fwd_bwd(sdpa)), bench(fwd_only(sdpa))
                rows.append((f"SDPA {name}", f, fb - f, fb))
            except Exception as e:  # noqa: BLE001
                print(f"SDPA {name}: {type(e).__name__}: {str(e)[:100]}")
        default = {k: dict(v) for k, v in table.items()}
        fb, f = bench(fwd_bwd(ours)), bench(fwd_only(ours))
        rows.append(("triton (defaults)", f, fb - f, fb))
        stages = [3] if args.quick else [2, 3]
        candidates = {
            "fwd": [(m, n, w, st) for m in (64, 128) for n in (64, 128) for w in (4, 8) for st in stages],
            "dkdv": [(m, n, w, st) for m, n in ((32, 128), (64, 64), (64, 128), (128, 128)) for w in (4, 8)
                     for st in stages],
            "dq": [(m, n, w, st) for m in (64, 128) for n in (32, 64) for w in (4, 8) for st in stages],
        }
        results = {kind: [] for kind in candidates}
        for kind, cfgs in candidates.items():
            for cfg in cfgs:
                table.update({k: dict(v) for k, v in default.items()})
                table[kind][d] = cfg
                try:
                    t = bench(fwd_only(ours) if kind == "fwd" else fwd_bwd(ours))
                except Exception:  # noqa: BLE001 (out of shared memory etc.)
                    continue
                results[kind].append((round(t, 4), cfg))
        table.update({k: dict(v) for k, v in default.items()})
        best = {}
        for kind, res in results.items():
            res.sort()
            best[kind] = res[0][1] if res else None
            print(f"  {kind}: best {res[:4]}", flush=True)
        for kind, cfg in best.items():
            if cfg:
                table[kind][d] = cfg
        fb, f = bench(fwd_bwd(ours)), bench(fwd_only(ours))
        rows.append((f"triton (best {best})", f, fb - f, fb))
        table.update({k: dict(v) for k, v in default.items()})
        print(f"| {shape} | fwd ms | bwd ms | fwd+bwd ms | TFLOP/s |")
        for name, f, bw, fb in rows:
            print(f"| {name} | {f:.3f} | {bw:.3f} | {fb:.3f} | {3.5 * flops_fwd / fb / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    run_tool(main)
