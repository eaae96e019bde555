"""Compile the kernels' GPU launches for a GPU architecture, on any machine (no GPU needed).

The Triton interpreter runs the kernels' arithmetic on a CPU but never compiles them, so a kernel
that does not lower (a dot shape the tensor cores refuse, a type the compiler rejects), that needs
more shared memory than a block may have, or that spills registers to local memory passes every
CPU test and fails or crawls on the GPU. Triton compiles without a device: its NVIDIA backend
lowers to PTX and the ptxas it ships assembles a cubin for the target (sm_90 = H100/H200). Per launch:

    mma       the tensor-core instruction the dots became: wgmma (Hopper's asynchronous warpgroup MMA),
              mma (mma.sync, Ampere's), or - (none: CUDA-core FMAs, as fp32 IEEE dots are)
    regs      registers per thread (<= 255; the SM has 64 K)
    spill     local-memory bytes per thread (register spills; 0 is the goal)
    smem      dynamic shared memory per block (<= 227 KiB on sm_90)
    blocks    resident blocks per SM = min(64 K regs / (regs * threads), 228 KiB / (smem + 1 KiB),
              64 warps / warps, 32), with registers allocated per warp in units of 256

`launches(cc=...)` lists what `layernorm.py`, `attention.py` and `cross_entropy.py` launch on a GPU of that
compute capability: the LayerNorm autotune candidates that survive their pruning at LN_WIDTHS (128 to 24576,
x [16384, N], weights in x's dtype, as the model holds them), the attention configurations `_gpu_config` picks
at ATTENTION_SHAPES (head dims 32 to 128, the packed-qkv layout of `flash_attention_qkv`, which the model uses),
and the cross-entropy candidates at vocabulary widths 8192 and 50304 (which hold every candidate), each in bf16,
fp16 and fp32, with and without residual / causal / dropout / label smoothing. The arguments carry the run's
dtypes, strides and sizes, so Triton specialises them as at run time (16-byte alignment, sizes divisible by
16 or not); launches that specialise alike (a width and the power of 2 above it) are compiled once. Run it in
its own process with TRITON_INTERPRET unset (`tools/check_kernels.py`): compiling swaps in a stand-in for
Triton's driver (`driver._active`, as in Triton 3.x).
"""
from __future__ import annotations

import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

import torch
import triton

from . import attention as A
from . import attention_kernels as AK
from . import cross_entropy as CE
from . import layernorm as LN
from . import FP_FUSION, HOPPER, cdiv, next_power_of_2


@dataclass(frozen=True)
class Arch:
    """What one SM of a GPU architecture holds (CUDA occupancy limits)."""
    gpu: str                  # e.g. "A100"
    cc: int                   # compute capability, e.g. 80
    regs_per_sm: int = 65536
    smem_per_block: int = 232448     # opt-in maximum of dynamic shared memory per block (bytes)
    smem_per_sm: int = 233472
    smem_reserved: int = 1024        # per block, by the system
    warps_per_sm: int = 64
    blocks_per_sm: int = 32

    @property
    def name(self) -> str:
        return f"{self.gpu} (sm_{self.cc})"


def arch_key(cc: int) -> str:
    """An architecture's key in ARCHS (check_kernels --arch): sm80 for compute capability 80."""
    return f"sm{cc}"


# the architectures the check compiles for; DEFAULT_ARCH: the one the kernels' configurations were sized on (HOPPER,
# the launches' default cc)
ARCHS = {arch_key(a.cc): a for a in (Arch("H100/H200", HOPPER),
                                     Arch("A100", 80, smem_per_block=166912, smem_per_sm=167936))}
DEFAULT_ARCH = arch_key(HOPPER)


@dataclass
class Launch:
    """One kernel launch: the kernel, its runtime arguments and its constexprs / launch options."""
    op: str                    # e.g. "ln fwd", "attn dkdv"
    case: str                  # e.g. "N=768 bf16 +res"
    kernel: object             # a triton JITFunction
    args: tuple
    meta: dict = field(default_factory=dict)

    @property
    def config(self) -> str:
        keys = ("BLOCK_M", "BLOCK_N", "BLOCK_R", "BLOCK_V", "num_warps", "num_stages")
        return " ".join(f"{k.replace('BLOCK_', '').replace('num_', '')}={self.meta[k]}" for k in keys if k in self.meta)


@dataclass
class Compiled:
    """What the compiler made of one launch (or why it could not)."""
    launch: Launch
    seconds: float
    mma: str = "-"
    regs: int = 0
    spill: int = 0
    smem: int = 0
    error: str = ""

    def blocks_per_sm(self, arch: Arch) -> int:
        warps = self.launch.meta.get("num_warps", 4)
        regs_per_warp = -(-self.regs * 32 // 256) * 256
        by_regs = arch.regs_per_sm // max(1, regs_per_warp * warps)
        by_smem = arch.smem_per_sm // (self.smem + arch.smem_reserved)
        return min(by_regs, by_smem, arch.warps_per_sm // warps, arch.blocks_per_sm)

    def problems(self, arch: Arch) -> list[str]:
        """Why this launch would fail or spill on `arch` (empty when it is fine)."""
        if self.error:
            return [f"does not compile: {self.error}"]
        out = []
        if self.smem > arch.smem_per_block:
            out.append(f"shared memory {self.smem} B > {arch.smem_per_block} B per block")
        if self.spill:
            out.append(f"spills {self.spill} B per thread to local memory")
        if self.blocks_per_sm(arch) < 1:
            out.append("no block fits on an SM")
        return out


# ----------------------------------------------------------------------------------- the launches
def _ptr(dtype: torch.dtype) -> torch.Tensor:
    """A pointer argument: Triton reads only the dtype and the address's alignment (16 B here)."""
    return torch.empty(16, dtype=dtype)


_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BENCH_SHAPES = ((16, 12, 1024, 64), (8, 16, 2048, 128))   # attention (b, heads, s, d) of make bench-kernels
# the head dims (hidden / heads) users train with, powers of 2 or not (the kernels pad d to BLOCK_D): 80 is
# gpt3-2.7b's (20 heads, 1600 wide), 40 is hidden 640 with 16 heads; the others at 16 heads, s = 2048
ATTENTION_SHAPES = tuple(sorted(BENCH_SHAPES + ((8, 20, 2048, 80),)
                                + tuple((8, 16, 2048, d) for d in (32, 40, 48, 56, 96, 112)), key=lambda s: s[3]))
# LayerNorm row widths (hidden sizes) from 128 to past MAX_FUSED_N, powers of 2 or not (640, 1600, 2560, 5120:
# the same fused launches as the power of 2 above them, but a width the wrappers round up there)
LN_WIDTHS = (128, 256, 512, 640, 768, 1024, 1600, 2048, 2560, 4096, 5120, 8192, 12288, 16384, 24576)
H100_SMS = 132


def layernorm_launches(widths=LN_WIDTHS, dtypes=("bf16", "fp16", "fp32"),
                       rows: int = 16384, sms: int = H100_SMS, cc: int = HOPPER) -> list[Launch]:
    """LayerNorm and add+LayerNorm, forward and backward, at each row width: every autotune candidate
    that `LN.candidates` keeps (fused kernels), or the looped kernels past MAX_FUSED_N."""
    out = []
    f32 = _ptr(torch.float32)
    for n in widths:
        for name in dtypes:
            x = _ptr(_DTYPES[name])
            block_n = next_power_of_2(n)
            for res in (False, True):
                case = f"N={n} {name}{' +res' if res else ''}"
                fwd = (x, x, x, x, x, x, f32, f32, n, n, n, n)
                if n > LN.MAX_FUSED_N:
                    out.append(Launch("ln fwd", case, LN._fwd_looped, fwd + (n, 1e-5),
                                      dict(HAS_RESIDUAL=res, BLOCK_N=LN.LOOP_BLOCK_N, num_warps=LN.LOOP_WARPS)))
                else:
                    for c in LN.candidates(False, block_n, cc):
                        out.append(Launch("ln fwd", case, LN._fwd.fn, fwd + (rows, n, 1e-5),
                                          dict(HAS_RESIDUAL=res, BLOCK_N=block_n, **c.all_kwargs())))
                bwd = (x, x, x, x, x, f32, f32, f32, n, n, n, n)
                if n > LN.MAX_FUSED_BWD_N:
                    loop = dict(BLOCK_N=LN.LOOP_BLOCK_N, num_warps=LN.LOOP_WARPS)
                    groups = LN._backward_programs(rows, cdiv(n, LN.LOOP_BLOCK_N), sms)
                    if not res:   # the row sums do not see the residual gradient
                        out.append(Launch("ln bwd sums", case, LN._bwd_row_sums,
                                          (x, x, x, f32, f32, f32, f32, n, n, n), loop))
                    out.append(Launch("ln bwd", case, LN._bwd_looped,
                                      (x, x, x, x, x, f32, f32, f32, f32, f32, n, n, n, n, rows, n,
                                       cdiv(rows, groups)), dict(HAS_DRES=res, **loop)))
                else:
                    for c in LN.candidates(True, block_n, cc):
                        out.append(Launch("ln bwd", case, LN._bwd.fn, bwd + (rows, n),
                                          dict(HAS_DRES=res, BLOCK_N=block_n, **c.all_kwargs())))
    return out


def attention_launches(shapes=ATTENTION_SHAPES,
                       dtypes=("bf16", "fp16", "fp32"), causal=(True, False),
                       configs: dict | None = None, cc: int = HOPPER) -> list[Launch]:
    """The flash attention kernels as `flash_attention_qkv` launches them on a GPU of compute capability cc
    (q, k, v views of one packed [s, b, 3 * heads * d] tensor; o, dq, dk, dv in the [s, b, heads, d] layout),
    for each shape (b, heads, s, d), dtype, causal (or not) and dropout. `configs` ({kind: (BLOCK_M, BLOCK_N,
    warps, stages)}) replaces the wrappers' choice (to check candidates before a sweep)."""
    out = []
    f32, seed = _ptr(torch.float32), _ptr(torch.int64)
    for b, h, s, d in shapes:
        qkv = (3 * h * d, d, b * 3 * h * d)          # (batch, head, seq) strides of q, k, v
        o = (h * d, d, b * h * d)                    # of o, do, dq, dk, dv
        for name in dtypes:
            dtype = _DTYPES[name]
            t, q = _ptr(dtype), torch.empty((1, 1, 1, d), dtype=dtype)   # (q: what _meta reads its choices from)
            for is_causal in causal:
                for dropout in (0.0, 0.1):
                    meta = A._meta(q, is_causal, dropout)
                    case = f"{b},{h},{s},{d} {name}{' causal' if is_causal else ''}{' dropout' if dropout else ''}"

                    def cfg(kind):
                        m, n, w, st = (configs or {}).get(kind) or A._gpu_config(kind, dtype, d, dropout, cc)
                        return dict(meta, BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=st)

                    scales = (0.125 * A.LOG2E, 0.125, dropout)
                    out.append(Launch("attn fwd", case, AK._fwd, (t, t, t, t, f32, seed, *qkv, *qkv, *qkv, *o,
                                                                 h, s, 0.125 * A.LOG2E, dropout), cfg("fwd")))
                    out.append(Launch("attn dkdv", case, AK._bwd_dkdv,
                                      (t, t, t, t, t, t, f32, f32, seed, *qkv, *qkv, *qkv, *o, *qkv, *qkv,
                                       h, s, *scales), cfg("dkdv")))
                    out.append(Launch("attn dq", case, AK._bwd_dq,
                                      (t, t, t, t, t, f32, f32, seed, *qkv, *qkv, *qkv, *o, *qkv, h, s, *scales),
                                      cfg("dq")))
            out.append(Launch("attn delta", f"{b},{h},{s},{d} {name}", AK._bwd_delta, (t, t, f32, *o, *o, h, s),
                              dict(HEAD_DIM=d, BLOCK_D=A._block_d(d), BLOCK_M=A._delta_block_m(d))))
    return out


def cross_entropy_launches(widths=((8192, 8192), (50304, 50257)), dtypes=("bf16", "fp16", "fp32"),
                           smoothing=(False, True), rows: int = 16384) -> list[Launch]:
    """The cross-entropy's stats and gradient kernels at each (padded width, real classes) of logits
    [16384, V] (50257 is GPT-2's vocabulary, which Triton specialises unlike a multiple of 16): every
    autotune candidate `CE.candidates` keeps."""
    out = []
    f32, i64 = _ptr(torch.float32), _ptr(torch.int64)
    for n, real in widths:
        for name in dtypes:
            x = _ptr(_DTYPES[name])
            for smooth in smoothing:
                case = f"V={real}/{n} {name}{' smoothing' if smooth else ''}"
                for kernel, fn, args in (("stats", CE._stats.fn, (x, i64, f32, n, rows, n, real)),
                                         ("grad", CE._grad.fn, (x, i64, f32, f32, x, n, n, rows, n, real, 0.9,
                                                                0.1 / real))):
                    for c in CE.candidates(kernel, n):
                        out.append(Launch(f"ce {kernel}", case, fn, args, dict(SMOOTHING=smooth, **c.all_kwargs())))
    return out


def launches(quick: bool = False, cc: int = HOPPER) -> list[Launch]:
    """Everything the wrappers launch on a GPU of compute capability cc; `quick`: bf16 at the benchmark shapes
    only."""
    if quick:
        return (layernorm_launches(widths=(768, 4096, 24576), dtypes=("bf16",), cc=cc)
                + attention_launches(shapes=BENCH_SHAPES, dtypes=("bf16",), causal=(True,), cc=cc)
                + cross_entropy_launches(widths=((8192, 8192),), dtypes=("bf16",), smoothing=(False,)))
    return layernorm_launches(cc=cc) + attention_launches(cc=cc) + cross_entropy_launches()


# ----------------------------------------------------------------------------------- compiling
class _TargetDriver:
    """Stands in for Triton's CUDA driver: names the target, launches nothing."""

    def __init__(self, cc: int):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", cc, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def _cuobjdump() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _resources(cubin: bytes) -> dict:
    """REG, LOCAL (spill) bytes of a cubin, from the cuobjdump that ships with Triton."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    fields = dict(kv.split(":", 1) for kv in text.split() if ":" in kv and kv.split(":", 1)[1].isdigit())
    return {"regs": int(fields["REG"]), "spill": int(fields.get("LOCAL", 0)) + int(fields.get("STACK", 0))}


def _mma(ptx: str) -> str:
    return "wgmma" if "wgmma.mma_async" in ptx else "mma" if "mma.sync" in ptx else "-"


def _compile(item: Launch) -> tuple:
    """(seconds, mma, regs, spill, smem, error) of one launch compiled for the active (stand-in) target."""
    t0 = time.perf_counter()
    try:
        k = item.kernel.warmup(*item.args, grid=(1,), **item.meta, **FP_FUSION)   # (as the kernels launch)
        res = _resources(k.asm["cubin"])
        return time.perf_counter() - t0, _mma(k.asm["ptx"]), res["regs"], res["spill"], k.metadata.shared, ""
    except Exception as e:  # noqa: BLE001 (a compile error is the finding)
        msg = " ".join(str(e).split())
        return time.perf_counter() - t0, "-", 0, 0, 0, f"{type(e).__name__}: {msg[:300]}"


_FORKED: list = []   # in a forked worker: the launches it compiles, by index (set by its initializer)


def _fork_init(items: list) -> None:
    _FORKED[:] = items


def _compile_forked(i: int) -> tuple:
    return _compile(_FORKED[i])


def _specialized(arg) -> tuple:
    """What Triton's compiled code depends on of a runtime argument: a tensor's dtype and 16-byte alignment,
    an int's being 1, its divisibility by 16 and its width (i32 or wider), a float's type (not its value)."""
    if isinstance(arg, torch.Tensor):
        return (arg.dtype, arg.data_ptr() % 16 == 0)
    if isinstance(arg, int):
        return (int, arg == 1, arg % 16 == 0, -2**31 <= arg < 2**31)
    return (type(arg),)


def _binary(item: Launch) -> tuple:
    """Launches with one key compile to one binary (a LayerNorm width and the power of 2 above it, when both
    are multiples of 16, say): compile_all builds each once."""
    return (item.kernel, tuple(_specialized(a) for a in item.args), tuple(sorted(item.meta.items())))


def compile_all(items: list[Launch], arch: Arch, workers: int = 1) -> list[Compiled]:
    """Compile each launch for `arch` (no GPU needed), in `workers` forked processes, each distinct binary
    once (its copies report its result, at 0 s); a compile error is recorded, not raised."""
    if LN._INTERPRET or A._INTERPRET or CE._INTERPRET:
        raise RuntimeError("compile_check needs TRITON_INTERPRET unset (the kernels were built for the interpreter)")
    first = {}
    for item in items:
        first.setdefault(_binary(item), item)
    unique = list(first.values())
    from triton.runtime import driver
    previous = dict(vars(driver))       # (its fields as they were: reading `active` can make the CUDA driver, which
    driver.set_active(_TargetDriver(arch.cc))   # needs a GPU; their names differ between Tritons)
    try:
        if workers > 1:
            import multiprocessing
            ctx = multiprocessing.get_context("fork")    # the launches reach the workers unpickled
            with ctx.Pool(workers, initializer=_fork_init, initargs=(unique,)) as pool:
                raw = pool.map(_compile_forked, range(len(unique)), chunksize=1)
        else:
            raw = [_compile(item) for item in unique]
    finally:
        vars(driver).update(previous)
    done = {_binary(item): r for item, r in zip(unique, raw)}
    return [Compiled(item, *(done[key] if first[key] is item else (0.0,) + done[key][1:]))
            for item, key in ((item, _binary(item)) for item in items)]


def summary(results: list[Compiled], arch: Arch, per_launch: bool = False) -> tuple[list, list, list]:
    """(headers, rows, problems) for a table: one row per (kernel, config), or per launch; the worst
    case of each column over its launches. problems: "op [case] config: why" lines."""
    groups = {}
    for r in results:
        key = (r.launch.op, r.launch.case, r.launch.config) if per_launch else (r.launch.op, r.launch.config)
        groups.setdefault(key, []).append(r)
    rows = []
    for key, rs in groups.items():
        ok = [r for r in rs if not r.error]
        worst = lambda f, pick=max: pick((f(r) for r in ok), default="-")   # noqa: E731
        rows.append(list(key) + [len(rs), "/".join(sorted({r.mma for r in ok})) or "-", worst(lambda r: r.regs),
                                 worst(lambda r: r.spill), worst(lambda r: round(r.smem / 1024, 1)),
                                 worst(lambda r: r.blocks_per_sm(arch), min), f"{sum(r.seconds for r in rs):.1f}"])
    headers = (["op", "case", "config"] if per_launch else ["op", "config"]) + [
        "launches", "mma", "regs", "spill B", "smem KiB", "blocks/SM", "compile s"]
    problems = [f"{r.launch.op} [{r.launch.case}] {r.launch.config}: {p}" for r in results for p in r.problems(arch)]
    return headers, rows, problems


def available() -> str | None:
    """None when this machine can compile for a GPU target, else why not."""
    for tool in (_cuobjdump(), os.path.join(os.path.dirname(_cuobjdump()), "ptxas")):
        if not os.path.exists(tool):
            return f"Triton's NVIDIA backend has no {tool}"
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
    except ImportError as e:
        return f"this Triton cannot compile ahead of time: {e}"
    return None
