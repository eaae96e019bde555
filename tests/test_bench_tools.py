"""Smoke tests of the benchmark tools: tools/bench_kernels.py and tools/bench_gpu.py run in --smoke
mode (tiny shapes, no torch.compile; on a CPU through the Triton interpreter, on the GPU when there is
one) in subprocesses, and their tables, JSON and doc sections hold the expected rows with finite
numbers (every LayerNorm, add+LayerNorm and attention row, and the kernels=triton training row);
tools/bench_train.py (make bench) runs its four sections and its figures that no clock sets are right;
tools/baseline_gpt2.py's new device/dtype/compile options keep its CPU defaults; the docs/benchmarks.md
writers of bench_gpu and bench_train keep what a run did not redo. No speed is checked here (only a
GPU says that).
"""
import json
import math
import os
import re
import subprocess
import sys
import types

import pytest
import torch

from harness import needs_triton

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args, timeout=300, **env_vars):
    env = dict(os.environ, WANDB_MODE="disabled", PYTHONUNBUFFERED="1", **env_vars)  # the scripts set TRITON_INTERPRET
    proc = subprocess.run([sys.executable] + args, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.mark.parametrize("tool", ["bench_kernels", "check_kernels"])
def test_the_kernel_tools_without_triton_say_so_in_one_line(tool, monkeypatch, capsys):
    """Where the triton package is not installed (macOS, Windows, an environment of one's own; hidden here: None in
    sys.modules, as import and find_spec read an absent module), tools/bench_kernels.py and check_kernels.py, imported
    and run as `python tools/<tool>.py` runs them, say in one line that they need it and how to get it, and exit 2
    before any work (an import in a kernel module was a traceback: bench_kernels's after its first lines of output,
    check_kernels's at its start)."""
    import importlib
    for name in (tool, "megatron_mini.kernels.compile_check"):       # (imported afresh, without triton)
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setattr(sys, "argv", [f"tools/{tool}.py"])
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", ""))   # (check_kernels pops it)
    with pytest.raises(SystemExit) as stop:
        importlib.import_module(tool).main()        # (tools/, on pytest's pythonpath)
    out, err = capsys.readouterr()
    assert (stop.value.code, out) == (2, "") and err == (
        f"error: {tool}.py needs the triton package, which this Python does not have: pip install 'triton>=3.0' "
        f"(Linux; there are no wheels for macOS or Windows)\n"), (out[-2000:], err[-2000:])


@needs_triton
def test_bench_kernels_smoke(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("# Benchmarks\n\nkept text\n")
    out = _run(["tools/bench_kernels.py", "--smoke", "--out", str(tmp_path), "--doc", str(doc)])
    data = json.loads((tmp_path / "bench_kernels.json").read_text())
    assert data["smoke"] is True and data["done"] is True     # (rewritten after each row, done at the end)
    rows = {(r["op"], tuple(r["shape"])): r for r in data["results"]}
    assert {op for op, _ in rows} == {"ln", "addln", "attn", "ce"}
    for (op, shape), row in rows.items():
        ours, eager = row["cells"]["ours (Triton)"], row["cells"]["torch eager"]
        for name, cell in (("ours", ours), ("eager", eager)):
            assert "fwd_ms" in cell, f"{op} {shape} {name} did not run: {cell.get('reason')}\n{out[-3000:]}"
            assert all(_finite(cell[k]) and cell[k] > 0 for k in ("fwd_ms", "fwdbwd_ms", "rate")), (op, shape, name)
        assert _finite(ours["max_rel_err"]) and ours["max_rel_err"] < 3e-2, (op, shape, ours["max_rel_err"])
        assert _finite(ours["x_best_torch"])
        assert row["cells"]["torch.compile"]["reason"].startswith("skipped")
        if op == "attn":   # the SDPA columns each ran or say why not (on a CPU, cuDNN / efficient cannot)
            for col in ("cuDNN SDPA", "flash SDPA", "efficient SDPA"):
                assert "fwdbwd_ms" in row["cells"][col] or row["cells"][col].get("reason")
    for op in ("ln", "addln"):
        assert (op, (64, 128)) in rows and (op, (48, 200)) in rows
    table = out[out.index("| op | shape |"):]
    assert "| LayerNorm | [64, 128] |" in table and "| add+LayerNorm |" in table and "| attention |" in table
    assert "| cross-entropy | [64, 300] |" in table
    assert "n/a (smoke run" in table                  # goals are never judged on a smoke run
    text = doc.read_text()
    assert text.startswith("# Benchmarks\n\nkept text\n")
    assert text.count("<!-- bench_kernels begin -->") == 1 and text.count("<!-- bench_kernels end -->") == 1
    assert "smoke run" in text and "| LayerNorm | [64, 128] |" in text


def test_bench_kernels_reports_cuda_graph_times_beside_do_bench(monkeypatch):
    """--graph's figures (GPU time alone) get their own best torch path, ratios, table and goal lines, and
    leave the do_bench ratios and verdicts (the issue's method) as they were; a path that could not be
    captured says why."""
    monkeypatch.syspath_prepend(os.path.join(REPO, "tools"))
    import bench_kernels as bk
    row = {"op": "ln", "label": "LayerNorm", "shape": [16384, 768], "shape_text": "[16384, 768]", "unit": "GB/s",
           "cells": {"ours (Triton)": {"fwdbwd_ms": 0.40, "graph_ms": 0.06},
                     "torch eager": {"fwdbwd_ms": 0.18, "graph_ms": 0.15},
                     "torch.compile": {"fwdbwd_ms": 0.20, "graph_reason": "a host sync"}}}
    bk.rank_against_torch(row)
    assert row["best_torch"] == "torch eager" and row["best_torch_graph"] == "torch eager"
    assert row["cells"]["ours (Triton)"]["x_best_torch"] == pytest.approx(0.45)
    assert row["cells"]["ours (Triton)"]["x_best_torch_graph"] == pytest.approx(2.5)
    goals = bk.goals([row], smoke=False)
    assert [g[3] for g in goals] == ["MISSED by 78%", "met"]
    assert "CUDA graph" in goals[1][0] and goals[1][1].startswith("2.50x")
    table = bk.graph_table([row])
    assert "| LayerNorm | [16384, 768] | 0.06 ms | 0.15 ms | - |" in table and "| 2.50x |" in table
    assert "torch.compile under a CUDA graph at LayerNorm [16384, 768]: a host sync" in bk.missing_notes([row])
    del row["cells"]["ours (Triton)"]["graph_ms"], row["cells"]["torch eager"]["graph_ms"]
    del row["cells"]["torch.compile"]["graph_reason"]
    assert len(bk.goals([row], smoke=False)) == 1 and bk.graph_table([row]) == ""     # without --graph


@needs_triton
def test_bench_train_smoke(tmp_path):
    """tools/bench_train.py --smoke (all four sections, one measured step a row, into a doc of its own) runs,
    and what it reports that timing does not set agrees with an independent count: dp=2 ends at the one device's
    loss; the tp=2 ledger's all-reduce bytes are the analytic m (4L + 2) s b h 4; every pipeline row's measured
    peak of in-flight microbatches is the schedule simulator's (GPipe: all m); the memory table counts the
    model's analytic parameters, with Adam's fp32 state (8 bytes a parameter, 12 with bf16's fp32 master) / dp
    under ZeRO-1."""
    from bench.workload import GBS, MBS, SMOKE
    doc = tmp_path / "benchmarks.md"
    out = _run(["tools/bench_train.py", "--smoke", "--steps", "1", "--doc", str(doc)])
    assert all(f"Section {n}" in doc.read_text() for n in (1, 2, 3, 4))
    losses = re.search(r"framework (\d+\.\d+), dp=2 (\d+\.\d+)\.", out)
    assert losses and losses[1] == losses[2], out
    m, L, s, h = GBS // MBS, SMOKE.num_layers, SMOKE.seq_len, SMOKE.hidden_size
    tp_ledger = re.search(r"^\s*tp\.all_reduce\s+\d+\s+([\d.]+)\s", out, re.M)     # (tp=2's table comes first)
    assert tp_ledger and tp_ledger[1] == f"{m * (4 * L + 2) * s * MBS * h * 4 / 2**20:.1f}", out
    in_flight = re.findall(r"^\s*(gpipe|1f1b)\s+(\d+)\s+[\d.]+ / [\d.]+\s+(\d+ / \d+)\s+(\d+ / \d+)\s", out, re.M)
    assert len(in_flight) == 6 and all(measured == simulated for _, _, measured, simulated in in_flight), in_flight
    gpipe = [(m, measured) for schedule, m, measured, _ in in_flight if schedule == "gpipe"]
    assert gpipe and all(measured == f"{m} / {m}" for m, measured in gpipe), in_flight
    memory = re.findall(r"^\s*(fp32|bf16)\s+([01])\s+(\d)\s+([\d,]+)\s.*\s([\d.]+)\s*$", out, re.M)
    assert len(memory) == 10, out
    for dtype, zero, dp, params, per_param in memory:
        assert int(params.replace(",", "")) == SMOKE.num_params()
        state = 8 if dtype == "fp32" else 12
        assert float(per_param) == pytest.approx(state / (int(dp) if zero == "1" else 1), abs=0.005)


def test_bench_gpu_smoke(tmp_path):
    doc = tmp_path / "doc.md"
    out = _run(["tools/bench_gpu.py", "--smoke", "--out", str(tmp_path), "--doc", str(doc)])
    data = json.loads((tmp_path / "bench_gpu.json").read_text())
    recs = {r["row"]: r for r in data["results"]}
    assert list(recs) == ["default", "eager", "torch", "triton", "layer_norm", "cross_entropy", "fp16", "baseline",
                          "baseline-compile"]
    must_run = ["default", "eager", "torch", "triton", "layer_norm", "cross_entropy", "fp16", "baseline"]
    for row in must_run:
        r = recs[row]
        assert r["status"] == "ok", (row, r.get("reason"))
        assert r["steps"] == 2 and all(_finite(t) and t > 0 for t in r["step_s"])
        assert _finite(r["tokens_per_s"]) and r["tokens_per_s"] > 0 and _finite(r["model_tflops"])
        assert _finite(r["first_loss"]) and _finite(r["last_loss"]) and 4 < r["first_loss"] < 7   # ~ln(256)
    assert recs["baseline-compile"]["status"] == "skipped"
    assert not any(recs[row]["compiled"] for row in must_run)          # a smoke run compiles nothing
    assert recs["default"]["triton_ops"] == recs["torch"]["triton_ops"] == []    # auto on a CPU: torch's
    assert recs["triton"]["triton_ops"] == ["layer_norm", "attention", "cross_entropy"]
    for row in must_run:
        assert f"| {row} | " in out
    text = doc.read_text()
    assert "<!-- bench_gpu begin -->" in text and "<!-- bench_gpu smoke begin -->" in text
    assert "smoke run" in text


def test_bench_gpu_profile_smoke():
    out = _run(["tools/bench_gpu.py", "--smoke", "--profile", "torch", "--profile-top", "5", "--profile-steps", "1"])
    busy = float(out.split(" busy ")[1].split(" ms per step")[0])
    table, kinds = out[out.index("| name | calls |"):].split("All ")
    table = table.strip().splitlines()
    assert len(table) == 2 + 5
    assert all(_finite(float(line.split("|")[3])) for line in table[2:])
    rows = [line.split("|") for line in kinds[kinds.index("| kind |"):].strip().splitlines()[2:]]
    assert {r[1].strip() for r in rows} >= {"GEMM"}         # every op counted once, under one kind
    assert sum(float(r[2]) for r in rows) == pytest.approx(busy, abs=0.01 * len(rows) + 0.05)


@pytest.mark.parametrize("name, kind", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel"
     "__5x_cublas", "GEMM"),
    ("nvjet_hsh_128x256_64x4_2x1_v_bz_coopA_NTN", "GEMM"),
    ("void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, float, 128, 16, 4, 4, false, false>",
     "GEMM"),
    ("void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float, __nv_bfloat16, true, false, false>", "GEMM"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "collectives"),
    ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0",
     "attention (SDPA)"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float, false>",
     "LayerNorm (torch)"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t<float>>>",
     "reductions"),
    ("triton_poi_fused_add_mul_0", "inductor's fused kernels"),
])
def test_a_profile_files_gpu_kernels_under_their_kind(name, kind):
    """A profile's table by kind (profiling.KERNEL_KINDS: bench_gpu --profile, profile.*) files the kernels of an
    H100 step where they belong: cuBLAS's GEMV (a one-row bias-gradient product) and split-K sum are GEMM work,
    not "other" or "reductions"."""
    from megatron_mini.profiling import kernel_kind
    assert kernel_kind(name) == kind


def test_bench_gpu_auto_vs_torch_on_one_code_path_is_no_verdict():
    """When kernels=auto selects no Triton kernel, its row and kernels=torch's run the same code: their
    ratio (0.992 in the second H100 run) is noise, not a goal met or missed."""
    import bench_gpu

    def rec(row, tokens, ops):
        return {"row": row, "status": "ok", "model_name": "gpt2-small", "tokens_per_s": tokens, "triton_ops": ops}
    verdict = lambda recs: next(g[3] for g in bench_gpu.model_goals("small", recs, smoke=False)   # noqa: E731
                                if "kernels=auto / kernels=torch" in g[0])
    assert verdict([rec("default", 480_508, []), rec("torch", 484_592, [])]).startswith("same code path")
    assert verdict([rec("default", 480_508, ["attention"]), rec("torch", 484_592, [])]) == "MISSED by 0.8%"


def test_bench_gpu_doc_merge_keeps_the_same_code_path_verdict(tmp_path):
    """--doc merges the rows of an earlier command back with what each used (triton_ops): a later command that
    runs another row must not turn "same code path" into a verdict on noise."""
    import bench_gpu

    def rec(row, tokens, command):
        return {"model": "small", "model_name": "gpt2-small", "row": row, "config": row, "status": "ok",
                "dtype": "bf16", "mbs": 16, "microbatches": 8, "seq_len": 1024, "tokens_per_step": 131072,
                "steps": 8, "warmup_steps": 3, "skipped_steps": 0, "median_s": 131072 / tokens, "tokens_per_s": tokens,
                "model_tflops": 300.0, "peak_tflops": 989.4, "mfu": 0.32, "first_loss": 9.1, "last_loss": 8.0,
                "triton_ops": [], "command": command, "date": "d", "device": "H100"}
    path = str(tmp_path / "doc.md")
    with open(path, "w") as f:
        f.write("# doc\n")
    bench_gpu.write_doc(path, {"small": [rec("default", 480_508, "cmd1"), rec("torch", 484_592, "cmd1")]})
    bench_gpu.write_doc(path, {"small": [rec("fp16", 475_355, "cmd2")]})
    goal = [line for line in open(path).read().splitlines() if "kernels=auto / kernels=torch" in line]
    assert len(goal) == 1 and "same code path" in goal[0], goal


def test_bench_gpu_section_states_each_kind_of_rows_warmup(tmp_path):
    """Compiled rows warm up longer than eager ones: the section says both counts, not the first row's, also
    for rows that --doc reads back from an earlier command."""
    import bench_gpu

    def rec(row, warmup, compiled):
        return {"model": "small", "model_name": "gpt2-small", "row": row, "config": row, "status": "ok",
                "dtype": "bf16", "steps": 8, "warmup_steps": warmup, "compiled": compiled, "peak_tflops": 989.4,
                "command": "c", "date": "d", "device": "H100", "mbs": 16, "microbatches": 8, "seq_len": 1024,
                "first_loss": 9.0, "last_loss": 8.0, "tokens_per_s": 5e5, "median_s": 0.26, "model_tflops": 300.0,
                "mfu": 0.3, "triton_ops": []}

    def section(recs):
        text = bench_gpu.model_section("small", recs, smoke=False)
        return next(line for line in text.splitlines() if "timed steps per row" in line)
    assert "after 3 warmup steps (compiled rows: 5);" in section([rec("default", 5, True), rec("eager", 3, False)])
    assert "after 4 warmup steps;" in section([rec("default", 4, True), rec("eager", 4, False)])
    assert "after 1 warmup step;" in section([rec("eager", 1, False)])
    path = str(tmp_path / "doc.md")
    with open(path, "w") as f:
        f.write("# doc\n")
    bench_gpu.write_doc(path, {"small": [rec("default", 5, True), rec("baseline-compile", 5, True)]})
    bench_gpu.write_doc(path, {"small": [rec("eager", 3, False)]})
    assert "after 3 warmup steps (compiled rows: 5);" in open(path).read()


def test_the_train_step_host_probe_runs():
    """docs/probes/train_step_host_2026-11-23.py, left for a GPU run, builds its rows through bench_gpu: a smoke
    run of the tiny model on a CPU (on a GPU machine too: not gpt2-small, compiled) keeps it in step with bench_gpu's
    API."""
    out = _run(["docs/probes/train_step_host_2026-11-23.py", "default", "2"], timeout=120, CUDA_VISIBLE_DEVICES="")
    row = out.strip().splitlines()[-1].split()
    assert row[:2] == ["default", "2"] and all(_finite(float(x)) and float(x) > 0 for x in row[2:])


def test_bench_gpu_doc_keeps_models_and_rows_not_rerun(tmp_path):
    import bench_gpu

    def rec(model, row, reason, command):
        return {"model": model, "model_name": model, "row": row, "config": row, "status": "skipped",
                "reason": reason, "command": command, "date": "today", "device": "a GPU"}

    path = str(tmp_path / "doc.md")
    with open(path, "w") as f:
        f.write("# head\n\n<!-- bench_train goals end -->\n")
    bench_gpu.write_doc(path, {"small": [rec("small", "torch", "SMALL-torch-v1 -->", "cmd1"),
                                         rec("small", "baseline", "SMALL-baseline-v1", "cmd1")]})
    bench_gpu.write_doc(path, {"1.3b": [rec("1.3b", "torch", "BIG-torch-v1", "cmd2")]})
    bench_gpu.write_doc(path, {"small": [rec("small", "torch", "SMALL-torch-v2", "cmd3")]})
    text = open(path).read()
    assert text.startswith("# head\n\n<!-- bench_train goals end -->\n")
    assert "SMALL-torch-v2" in text and "SMALL-torch-v1" not in text        # a rerun row is replaced
    assert "SMALL-baseline-v1" in text and "BIG-torch-v1" in text           # rows and models not rerun are kept
    assert "`cmd1`" in text and "`cmd3`" in text                            # each kept row names its command
    assert text.index("SMALL-torch-v2") < text.index("BIG-torch-v1")        # presets in order: small, medium, 1.3b
    assert text.count("<!-- bench_gpu begin -->") == 1 and text.count("<!-- bench_gpu small begin -->") == 1
    small = text[text.index("<!-- bench_gpu small begin -->"):text.index("<!-- bench_gpu small end -->")]
    assert small.index("| torch |") < small.index("| baseline |")          # rows in the benchmark's order


def test_bench_gpu_frees_the_trainer():
    """A finished framework row must not keep its parameters or GradBuffers (weights, main grads) alive: none that
    it made is left. (Not a count: what an earlier test left may go meanwhile, as failed planner tests'
    Parameters did.)"""
    import argparse
    import gc
    import weakref
    import bench_gpu
    from megatron_mini.data_parallel import GradBuffer

    def live():
        gc.unfreeze()       # (a Trainer freezes what exists after its first step, training.py: gc lists none of it)
        gc.collect()
        return [o for o in gc.get_objects() if type(o) in (GradBuffer, torch.nn.Parameter)]

    before = {id(o): weakref.ref(o) for o in live()}
    args = argparse.Namespace(smoke=True, steps=1, warmup=0, compile_warmup_extra=0, peak_tflops=None,
                              vocab=bench_gpu.VOCAB)
    rec = bench_gpu.measure_row("torch", "smoke", args, torch.device("cpu"))
    assert rec["status"] == "ok", rec.get("reason")
    made = [type(o).__name__ for o in live() if id(o) not in before or before[id(o)]() is not o]
    assert not made, made


def test_bench_gpu_vocab_sets_the_models_vocabulary():
    """--vocab 50304 (GPT-2's padded vocabulary, where kernels=auto takes the Triton cross-entropy on an H100):
    the preset's model with that vocabulary, for the framework and the baseline alike; a smoke run keeps its own."""
    import bench_gpu
    from megatron_mini.config import ModelConfig
    model, mbs, m = bench_gpu.model_config("small", False, 50304)
    assert (model.vocab_size, model.padded_vocab_size, model.num_layers, model.hidden_size, mbs, m) == \
        (50304, 50304, 12, 768, 16, 8)
    assert bench_gpu.model_config("small", False)[0] == ModelConfig(**{**vars(model), "vocab_size": 8192})
    assert bench_gpu.model_config("small", True, 50304)[0].vocab_size == 256


@pytest.mark.parametrize("line", ["num_layer: 12", "num_layers: twelve"])
def test_bench_gpu_refuses_a_preset_the_schema_refuses(tmp_path, monkeypatch, line):
    """A preset is merged into ModelConfig as Hydra would: a misspelt key or a value of the wrong type is an
    error, not a field left at its default or a string where a number belongs."""
    import bench_gpu
    from megatron_mini.config import ConfigError
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "typo.yaml").write_text(f"name: typo\n{line}\nvocab_size: ${{data.vocab_size}}\n")
    monkeypatch.setattr(bench_gpu, "REPO", str(tmp_path))
    monkeypatch.setitem(bench_gpu.MODELS, "typo", ("typo", 2, 2))
    with pytest.raises(ConfigError, match="num_layer"):
        bench_gpu.model_config("typo", False)


def test_baseline_options_keep_cpu_defaults():
    import baseline_gpt2 as baseline
    BaselineTrainer, GPTConfig = baseline.BaselineTrainer, baseline.GPTConfig
    cfg = GPTConfig(num_layers=1, num_heads=2, hidden_size=32, seq_len=16, vocab_size=64)
    plain = BaselineTrainer(cfg, 2, 2)
    assert plain.device.type == "cpu" and plain.dtype == "fp32" and plain.forward is plain.model
    expected = torch.randint(0, 64, (2, 2, 17), generator=torch.Generator().manual_seed(1234))
    assert torch.equal(plain.batch(), expected)        # the batch tokens come from the same generator
    bf16 = BaselineTrainer(cfg, 2, 2, device="cpu", dtype="bf16")
    assert all(p.dtype == torch.float32 for p in bf16.model.parameters())   # autocast: fp32 weights
    loss = bf16.train_step()
    assert math.isfinite(loss) and abs(loss - math.log(64)) < 1.0
    with pytest.raises(ValueError):
        BaselineTrainer(cfg, 2, 2, dtype="fp16")


TINY_BASELINE = ["--layers", "1", "--seq", "8", "--mbs", "1", "--accum", "1", "--vocab", "16", "--steps", "1",
                 "--warmup", "0", "--threads", "1"]


@pytest.mark.parametrize("argv, fact", [
    (["--hidden", "32", "--heads", "3"], "--hidden 32 is not divisible by --heads 3"),   # (a view()'s RuntimeError)
    (["--hidden", "32", "--heads", "4", "--device", "cuda:x"], "wants auto, cpu, cuda or cuda:N (N the index of "
                                                               "a GPU), got 'cuda:x'"),
    (["--hidden", "32", "--heads", "4", "--device", "tpu"], "wants auto, cpu, cuda or cuda:N"),
] + ([(["--hidden", "32", "--heads", "4", "--device", f"cuda:{torch.cuda.device_count()}"],
       f"this machine has {torch.cuda.device_count()} CUDA device")] if torch.cuda.is_available() else
     [(["--hidden", "32", "--heads", "4", "--device", "cuda"], "--device cuda: this machine has no CUDA device"),
      (["--hidden", "32", "--heads", "4", "--device", "cuda:1"], "--device cuda:1: this machine has no CUDA device")]))
def test_baseline_bad_arguments_are_one_line(argv, fact):
    """tools/baseline_gpt2.py: heads that do not divide the hidden size, or a device this machine cannot give,
    were a traceback from inside the first step or from torch; now argparse's one line and exit 2, before any
    model is built."""
    proc = subprocess.run([sys.executable, "tools/baseline_gpt2.py", *TINY_BASELINE, *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith("usage: ") and "error: " in lines[-1] and fact in lines[-1], lines
    assert proc.stdout == "", proc.stdout                              # (no "device ..." line: nothing ran)


def test_bench_train_help_still_works():
    assert "Training-throughput benchmarks" in _run(["tools/bench_train.py", "--help"])


def test_bench_train_doc_keeps_sections_not_rerun(tmp_path):
    from bench.report import Report, write_train_doc

    def report(section, text, goal):
        rep = Report(section, f"Section {section}", types.SimpleNamespace(loads=[1.0], smoke=False))
        rep.text(text)
        rep.goal(goal, "1.0", ">= 1", True)
        rep.finish()
        return rep

    path = str(tmp_path / "doc.md")
    with open(path, "w") as f:
        f.write("# kept\n")
    write_train_doc(path, [report(1, "S1-v1", "G1-v1"), report(3, "S3-v1", "G3-v1")], "cmd", "a CPU")
    write_train_doc(path, [report(1, "S1-v2", "G1-v2")], "cmd", "a CPU")
    text = open(path).read()
    assert text.startswith("# Training benchmarks") and text.rstrip().endswith("# kept")
    assert "S1-v2" in text and "S1-v1" not in text and "S3-v1" in text
    goals = text[text.index("<!-- bench_train goals begin -->"):text.index("<!-- bench_train goals end -->")]
    assert goals.index("| 1 | G1-v2 |") < goals.index("| 3 | G3-v1 |") and "G1-v1" not in goals
    for s in range(1, 5):
        assert text.count(f"<!-- bench_train section {s} begin -->") == 1


@pytest.mark.parametrize("argv, fact", [
    (["--shapes", "16,12,1024"], "argument --shapes: wants B,HEADS,S,D"),          # (unpacking's ValueError)
    (["--shapes", "16,12,1024,x"], "argument --shapes: wants B,HEADS,S,D"),        # (int()'s ValueError)
    (["--dropout", "1.5"], "argument --dropout: must be in [0, 1)"),
])
def test_sweep_attention_bad_arguments_are_one_line(argv, fact):
    """tools/sweep_attention.py checked its --shapes only when it reached them on the GPU (a traceback after the
    SDPA timings) and never its --dropout; now argparse refuses them in one line, exit 2, on any machine, before
    it asks for a GPU."""
    proc = subprocess.run([sys.executable, "tools/sweep_attention.py", *argv], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[0].startswith("usage: ") and fact in lines[-1] and repr(argv[-1]) in lines[-1], lines
