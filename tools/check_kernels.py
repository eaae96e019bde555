"""Compile the Triton kernels' GPU launches for a GPU, without one (`make check-kernels`).

    python tools/check_kernels.py [--arch ARCH] [--quick] [--all] [--workers N]
    python tools/check_kernels.py --attention fwd=128,64,4,3 dkdv=32,128,8,2   # candidates

Prints, per kernel and configuration, the tensor-core instruction of its dots, registers per thread,
spilled bytes, shared memory, resident blocks per SM and the compile time (what is compiled, and how:
megatron_mini/kernels/compile_check.py), then every launch that would not compile, would not fit,
or spills. Exit status 1 when there is one.
`--arch`: a key of compile_check.ARCHS (`--help` lists them); by default the GPU the configurations were sized on.
`--quick`: bf16 at the benchmark shapes only. `--all`: one row per launch, not per configuration.
`--attention KIND=M,N,WARPS,STAGES`: check an attention configuration instead of GPU_CONFIGS
(e.g. a sweep candidate), at the benchmark shapes.
"""
import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)   # the kernels must be built for a GPU, not the interpreter

from bench.report import positive_ints, require_triton, text_table  # noqa: E402
from defaults_help import DefaultsHelp  # noqa: E402
from megatron_mini.errors import run_tool  # noqa: E402


def _attention_spec(spec: str) -> tuple:
    """An argparse type: KIND=M,N,WARPS,STAGES -> (KIND, (M, N, WARPS, STAGES)), else argparse's one-line error."""
    kind, _, values = spec.partition("=")
    numbers = positive_ints(values, 4)
    if kind not in ("fwd", "dkdv", "dq") or numbers is None:
        raise argparse.ArgumentTypeError(f"wants KIND=M,N,WARPS,STAGES with KIND fwd|dkdv|dq and four positive "
                                         f"integers, got {spec!r}")
    return kind, numbers


def _parser(C) -> argparse.ArgumentParser:
    """The command line, its --arch from C (megatron_mini.kernels.compile_check)'s ARCHS and DEFAULT_ARCH."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelp)
    ap.add_argument("--arch", choices=sorted(C.ARCHS), default=C.DEFAULT_ARCH,
                    help="the GPU to compile for: " + ", ".join(f"{k} ({C.ARCHS[k].gpu})" for k in sorted(C.ARCHS))
                    + f"; the kernels' configurations were sized on the {C.ARCHS[C.DEFAULT_ARCH].gpu}")
    ap.add_argument("--quick", action="store_true", help="bf16 at the benchmark shapes only")
    ap.add_argument("--all", action="store_true", help="one row per launch")
    ap.add_argument("--attention", nargs="*", type=_attention_spec, metavar="KIND=M,N,WARPS,STAGES",
                    help="instead: the attention launches with these configurations (KIND: fwd, dkdv or dq), bf16 at "
                    "the benchmark shapes")
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="compiling processes")
    return ap


def main(argv=None):
    require_triton("check_kernels.py")
    from megatron_mini.kernels import compile_check as C
    args = _parser(C).parse_args(argv)
    why = C.available()
    if why:
        sys.exit(f"error: cannot compile ahead of time here: {why}")
    arch = C.ARCHS[args.arch]
    if args.attention:
        items = C.attention_launches(shapes=C.BENCH_SHAPES, dtypes=("bf16",), causal=(True,),
                                     configs=dict(args.attention), cc=arch.cc)
    else:
        items = C.launches(quick=args.quick, cc=arch.cc)
    print(f"compiling {len(items)} launches for {arch.name} ...", flush=True)
    results = C.compile_all(items, arch, workers=args.workers)
    headers, rows, bad = C.summary(results, arch, per_launch=args.all)
    print(text_table(headers, rows))
    for line in bad:
        print(f"PROBLEM {line}")
    print(f"{len(results)} launches, {len(bad)} problems, {sum(r.seconds for r in results):.0f} s of compiling")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    run_tool(main)
