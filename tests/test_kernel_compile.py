"""The kernels compile for an H100 (sm_90) without one: tools/check_kernels.py lowers every launch the
wrappers make (LayerNorm autotune candidates, attention configurations) through Triton's NVIDIA backend
and the ptxas it ships, and reads registers, spills and shared memory from the cubin. The interpreter
the other kernel tests use never compiles, so only this sees a kernel that does not lower, a block
over its shared memory, or register spills. Compiling runs in subprocesses (the kernels must be built with
TRITON_INTERPRET unset, which conftest sets for this process): the `--quick` command line's, and one (the
`compiled` fixture) for the launches the other compile tests read.
"""
import importlib
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="the Triton kernels need the triton package (installed on Linux only)")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _python(args, timeout=600):
    return subprocess.run([sys.executable] + args, cwd=REPO, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def compiler():
    """Skips where Triton cannot compile for a GPU target (compile_check.available: its tools, read here)."""
    from megatron_mini.kernels import compile_check as C
    why = C.available()
    if why:
        pytest.skip(f"cannot compile for a GPU target here: {why}")


def _check_kernels(monkeypatch):
    """tools/check_kernels.py as a module, imported here with this process's TRITON_INTERPRET kept (it pops it)."""
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", ""))
    return importlib.import_module("check_kernels")       # (tools/, on pytest's pythonpath)


def test_every_gpu_launch_compiles_for_sm90_without_spills(compiler):
    """bf16 at the benchmark shapes (`--quick`): LayerNorm at N = 768, 4096 (fused) and 24576 (looped),
    attention at head dims 64 and 128, with and without dropout, the cross-entropy at a vocabulary of 8192;
    `make check-kernels` does every dtype."""
    proc = _python(["tools/check_kernels.py", "--quick", "--workers", "2"])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    for op in ("ln fwd", "ln bwd", "ln bwd sums", "attn fwd", "attn dkdv", "attn dq", "attn delta", "ce stats",
               "ce grad"):
        assert f"\n{op}  " in out, f"no row for {op}:\n{out}"
    assert "PROBLEM" not in out and ", 0 problems," in out


COMPILE = """
import json, torch
from megatron_mini.kernels import compile_check as C
from megatron_mini.kernels import layernorm as LN

# probes of the check itself (sm_90)
x, f = torch.empty(16, dtype=torch.bfloat16), torch.empty(16)
# a backward tile of 8 rows x 1024 in 32 warps: 8 elements per thread need ~100 registers, the block allows 64
spilling = C.Launch("ln bwd", "N=768", LN._bwd.fn, (x, x, x, x, x, f, f, f, 768, 768, 768, 768, 16384, 768),
                    dict(HAS_DRES=False, BLOCK_N=1024, BLOCK_M=8, num_warps=32))
fitting = C.Launch("ln bwd", "N=768", LN._bwd.fn, spilling.args,
                   dict(HAS_DRES=False, BLOCK_N=1024, BLOCK_M=2, num_warps=8))


def fwd(config, d):
    return [l for l in C.attention_launches(shapes=((1, 1, 256, d),), dtypes=("bf16",), causal=(True,),
                                            configs={"fwd": config}) if l.op == "attn fwd"][0]
# 4 stages of 128-key K and V tiles at d = 128 (256 KiB) do not fit a block's 227 KiB of shared memory
big = fwd((128, 128, 8, 4), 128)
# tl.arange needs a power-of-2 length: a 48-key block does not lower
ragged = fwd((64, 48, 4, 1), 64)


# launches the tables as measured on an H100 did not hold, as the wrappers make them
def attention(op, d, dtype, causal, dropout, cc=90):
    case = f"8,16,2048,{d} {dtype}{' causal' if causal else ''}{' dropout' if dropout else ''}"
    return [l for l in C.attention_launches(shapes=((8, 16, 2048, d),), dtypes=(dtype,), causal=(causal,), cc=cc)
            if l.op == op and l.case in (case, case.replace(' causal', ''))][:1]


def layernorm(op, n, cc=90, residual=None):
    return [l for l in C.layernorm_launches(widths=(n,), dtypes=("bf16",), cc=cc)
            if l.op == op and (residual is None or ("+res" in l.case) == residual)]


sm90 = (attention("attn fwd", 40, "bf16", False, True) + attention("attn dkdv", 40, "bf16", True, False)
        + attention("attn delta", 40, "fp16", False, False) + layernorm("ln bwd", 256, residual=True)
        + attention("attn dkdv", 80, "bf16", False, False) + attention("attn dkdv", 80, "bf16", True, True)
        + attention("attn dq", 40, "fp32", False, False))
sm80 = (attention("attn dq", 128, "bf16", True, False, cc=80) + attention("attn dq", 32, "fp32", False, True, cc=80)
        + layernorm("ln fwd", 1024, cc=80, residual=False) + attention("attn dkdv", 32, "bf16", True, False, cc=80)
        + attention("attn fwd", 48, "fp16", False, False, cc=80))
# (group, launch) per architecture: one compile_all, one pool of workers, each
launches = {"sm90": [("probes", l) for l in (spilling, fitting, big, ragged)] + [("sm90", l) for l in sm90],
            "sm80": [("sm80", l) for l in sm80]}
from triton.runtime import driver
fields = {name: id(value) for name, value in vars(driver).items()}      # (Triton's driver config, before)
out = {}
for arch, pairs in launches.items():
    a = C.ARCHS[arch]
    for (group, _), r in zip(pairs, C.compile_all([l for _, l in pairs], a, workers=2)):
        out.setdefault(group, []).append(dict(
            op=r.launch.op, case=r.launch.case, config=r.launch.config, mma=r.mma, regs=r.regs, spill=r.spill,
            smem=r.smem, error=r.error, problems=r.problems(a), blocks=r.blocks_per_sm(a) if not r.error else None))
out["driver"] = [fields, {name: id(value) for name, value in vars(driver).items()}]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled(compiler):
    """{group: [what compile_check made of each launch]}: COMPILE's launches, compiled once in one process for the
    tests that read them."""
    proc = _python(["-c", COMPILE])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_check_reports_spills_and_compile_errors(compiled):
    """The check is not vacuous: a tile too big for its block's register share spills, the same tile in
    a config the pruning keeps does not, a pipeline too deep for shared memory is refused, and a block
    that cannot lower is reported as a compile error."""
    spilling, fitting, big, ragged = compiled["probes"]
    assert spilling["regs"] <= 64 and spilling["spill"] > 0
    assert any("spills" in p for p in spilling["problems"])
    assert fitting["spill"] == 0 and fitting["problems"] == [] and fitting["blocks"] >= 1
    assert 0 < fitting["regs"] <= 255
    assert big["mma"] == "wgmma"          # a 16-bit dot on sm_90 is Hopper's warpgroup MMA
    assert fitting["mma"] == "-"          # LayerNorm has no dot
    assert big["smem"] > 232448 and any("shared memory" in p for p in big["problems"])
    assert ragged["error"] and ragged["problems"][0].startswith("does not compile")


def test_compiling_leaves_tritons_driver_as_it_was(compiled):
    """compile_all makes Triton's driver a stand-in that names the target GPU, then gives back the driver config's
    own fields, whatever a Triton calls them (`_active` from 3.5, `active` in 3.4: reading `active` from 3.5 would
    make the CUDA driver, which needs a GPU)."""
    before, after = compiled["driver"]
    assert before and after == before


def test_launches_the_tables_did_not_hold_compile_without_spills(compiled):
    """What spilled with the tables as measured on an H100 (attention at head dims 64 and 128, LayerNorm's register
    model) compiles clean with the rules for what they do not hold (tools/check_kernels.py, full: every head dim from
    32 to 128, widths 128 to 24576): on sm_90, head dim 40 (not a multiple of 16: 16-112 B a thread in the forward,
    24-40 B in dk/dv, 8 B in the fp16 delta pre-pass, before attention._register_bound and _delta_block_m halved
    their blocks) and LayerNorm's backward at N = 256 with a residual (8 B at 16 elements a thread: now 8 at most,
    NARROW_BWD_N); under Triton 3.6 (the GPU machine's; 3.9 does not spill there), dk/dv at d = 80 in the d = 128
    rows (8 B, with dropout when causal: now the 112 rows) and the fp32 dq at d = 40 with 1 stage (8 B: now 2); on
    an A100 (sm_80, mma.sync) dq at d = 128 (64-96 B at the H100's (128, 64)), the fp32 dq at d = 32 with dropout
    (8 B at 64 registers with 1 stage: 2 with dropout before Hopper), LayerNorm's forward at N = 1024 (8 B at 32
    elements a thread: 16 at most before Hopper) and, under Triton 3.7 (torch 2.12's; not 3.9), 16-bit dk/dv at
    d = 32, causal, and the forward at d = 48 (8 B with 3 stages: 2)."""
    out = [(arch, r) for arch in ("sm90", "sm80") for r in compiled[arch]]
    assert {(arch, r["op"]) for arch, r in out} == {("sm90", "attn fwd"), ("sm90", "attn dkdv"), ("sm90", "attn delta"),
                                                   ("sm90", "ln bwd"), ("sm90", "attn dq"), ("sm80", "attn dq"),
                                                   ("sm80", "ln fwd"), ("sm80", "attn dkdv"), ("sm80", "attn fwd")}
    assert {"8,16,2048,80 bf16", "8,16,2048,80 bf16 causal dropout", "8,16,2048,40 fp32"} <= {r["case"] for _, r in out}
    assert {"8,16,2048,32 fp32 dropout", "8,16,2048,32 bf16 causal", "8,16,2048,48 fp16"} <= {r["case"] for _, r in out}
    assert all(r["spill"] == 0 and r["problems"] == [] for _, r in out), [(arch, r) for arch, r in out if r["spill"]]


def test_check_kernels_compiles_by_default_for_the_gpu_the_kernels_were_sized_on(monkeypatch):
    """--arch takes compile_check's ARCHS, by default the H100's (HOPPER: the compute capability the configurations
    were sized on, and every *_launches' default), so neither can drift from the architectures the check knows."""
    from megatron_mini.kernels import HOPPER
    from megatron_mini.kernels import compile_check as C
    arch = next(a for a in _check_kernels(monkeypatch)._parser(C)._actions if a.dest == "arch")
    assert arch.default == C.DEFAULT_ARCH and C.ARCHS[arch.default].cc == HOPPER
    assert sorted(arch.choices) == sorted(C.ARCHS) and {C.ARCHS[k].cc for k in arch.choices} >= {HOPPER, 80}


@pytest.mark.parametrize("spec", ["fwd=a,b,c,d", "fwd=64,64,4", "bwd=64,64,4,3", "dq=0,64,4,3"])
def test_check_kernels_refuses_a_bad_attention_spec_in_one_line(spec, monkeypatch, capsys):
    """--attention KIND=M,N,WARPS,STAGES: a value that is not a positive integer was int()'s ValueError traceback
    (after the compiler check); now it is argparse's one line, exit 2, like a wrong KIND or count, on any machine
    (main() as `python tools/check_kernels.py` runs it)."""
    monkeypatch.setattr(sys, "argv", ["tools/check_kernels.py", "--attention", spec])
    with pytest.raises(SystemExit) as stop:
        _check_kernels(monkeypatch).main()
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert stop.value.code == 2 and "Traceback" not in err, err[-2000:]
    assert lines[0].startswith("usage: ") and "error: argument --attention: " in lines[-1], lines
    assert repr(spec) in lines[-1] and out == "", out
