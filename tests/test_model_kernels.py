"""Which ops each `kernels` setting gives to Triton, and kernels=triton training the same model as the torch
reference path: on the GPU when there is one (fp32 with TF32 off, so both paths do IEEE fp32 math), else on
CPU under the Triton interpreter."""
import contextlib
import dataclasses

import pytest
import torch

from harness import needs_triton, skip_without_cpu_compiler, small_config, train_on_ranks
from ranks import spawn
from megatron_mini import model
from megatron_mini.config import ModelConfig, TrainConfig
from megatron_mini.model import TritonOps, compiles, select_triton_ops


@pytest.mark.parametrize("kernels, ops", [("torch", (False, False, False)), ("triton", (True, True, True)),
                                          ("layer_norm", (True, False, False)), ("attention", (False, True, False)),
                                          ("cross_entropy", (False, False, True))])
def test_kernels_setting_picks_the_ops(kernels, ops):
    cfg = ModelConfig(num_layers=1, hidden_size=64, num_heads=2, seq_len=16, vocab_size=128)
    assert select_triton_ops(kernels, cfg, torch.device("cpu"), 1, "bf16", 4) == TritonOps(*ops)


def test_auto_takes_triton_only_where_measured_faster(monkeypatch):
    """kernels=auto: torch, except (op, GPU, size, dtype, variant) in TRITON_WINS; sizes are hidden for
    LayerNorm, head dim for attention and a rank's vocabulary columns (padded vocabulary / tp) for the
    cross-entropy; a win measured in bf16 without dropout says nothing of fp32 or of attention dropout."""
    cfg = ModelConfig(num_layers=1, hidden_size=64, num_heads=2, seq_len=16, vocab_size=100)   # padded to 128
    monkeypatch.setattr(model, "gpu_key", lambda device: "h100")
    monkeypatch.setattr(model, "triton_installed", lambda: True)      # (where it is not: the next test)

    def auto(tp=1, dtype="bf16"):
        return select_triton_ops("auto", cfg, torch.device("cpu"), tp, dtype, 4)
    assert auto() == TritonOps(False, False, False)
    monkeypatch.setattr(model, "TRITON_WINS", frozenset({("layer_norm", "h100", 64, "bf16", False),
                                                         ("attention", "h100", 64, "bf16", False),
                                                         ("cross_entropy", "h100", 100, "bf16", False)}))
    assert auto() == TritonOps(True, False, False)                   # head dim 32, vocabulary padded to 128
    assert auto(dtype="fp32") == TritonOps(False, False, False)
    monkeypatch.setattr(model, "TRITON_WINS", frozenset({("attention", "h100", 32, "bf16", False),
                                                         ("cross_entropy", "h100", 128, "bf16", False),
                                                         ("layer_norm", "a100", 64, "bf16", False)}))
    assert auto() == TritonOps(False, True, True)
    assert auto(tp=2) == TritonOps(False, True, False)               # 64 columns a rank
    cfg.dropout = 0.1
    assert auto() == TritonOps(False, False, True)                   # the dropout variant was not measured
    monkeypatch.setattr(model, "TRITON_WINS", frozenset({("cross_entropy", "h100", 64, "bf16", False)}))
    assert auto(tp=2) == TritonOps(False, False, True)


def test_auto_is_torch_where_the_measured_kernel_cannot_run_as_measured(monkeypatch):
    """kernels=auto falls back to torch, never to an error: without the triton package (import at the first
    forward failed), where the Triton attention cannot take the shape (training refused "kernels=auto: the
    Triton attention supports ..."), and for a variant the bench did not time (a win without label smoothing
    says nothing of the smoothed cross-entropy, as one without dropout says nothing of the attention's)."""
    import sys

    from megatron_mini.kernels import MAX_BATCH_HEADS, MAX_DROPOUT_SEQ
    cfg = ModelConfig(num_layers=1, hidden_size=64, num_heads=2, seq_len=16, vocab_size=128)
    monkeypatch.setattr(model, "gpu_key", lambda device: "h100")
    monkeypatch.setattr(model, "TRITON_WINS", frozenset({("attention", "h100", 32, "bf16", False),
                                                         ("attention", "h100", 32, "bf16", True),
                                                         ("cross_entropy", "h100", 128, "bf16", False)}))
    monkeypatch.setattr(model, "triton_installed", lambda: True)

    def auto(mbs=4, **changes):
        return select_triton_ops("auto", dataclasses.replace(cfg, **changes), torch.device("cpu"), 1, "bf16", mbs)
    assert auto() == TritonOps(False, True, True)
    assert auto(label_smoothing=0.1) == TritonOps(False, True, False)
    assert auto(dropout=0.1) == TritonOps(False, True, True)
    assert auto(dropout=0.1, seq_len=MAX_DROPOUT_SEQ + 1) == TritonOps(False, False, True)
    assert auto(mbs=MAX_BATCH_HEADS // 2 + 1) == TritonOps(False, False, True)     # b x heads past CUDA's grid
    monkeypatch.undo()
    monkeypatch.setattr(model, "gpu_key", lambda device: "h100")
    monkeypatch.setattr(model, "TRITON_WINS", frozenset({("cross_entropy", "h100", 128, "bf16", False)}))
    monkeypatch.setitem(sys.modules, "triton", None)     # (as import and find_spec read a package not installed)
    assert auto() == TritonOps(False, False, False)
    assert select_triton_ops("triton", cfg, torch.device("cpu"), 1, "bf16", 4) == TritonOps(True, True, True)


def test_compile_unset_means_on_cuda_where_a_chunk_is_one_graph():
    """compile=null (the default): compiled on CUDA at tp=1 without full recompute or dropout (a chunk is one
    graph, measured faster than eager), else eager, and eager on a CPU; true and false as set, anywhere."""
    cfg = TrainConfig()
    assert cfg.compile is None and (cfg.tp, cfg.model.dropout) == (1, 0.0)
    assert [compiles(cfg, d) for d in ("cpu", "cuda", torch.device("cuda", 1))] == [False, True, True]
    assert compiles(dataclasses.replace(cfg, recompute="selective"), "cuda")
    for other in (dict(tp=2), dict(recompute="full"), dict(model=dataclasses.replace(cfg.model, dropout=0.1))):
        assert not compiles(dataclasses.replace(cfg, **other), "cuda"), other
        assert compiles(dataclasses.replace(cfg, compile=True, **other), "cpu")
    assert [compiles(dataclasses.replace(cfg, compile=c), d) for c in (True, False) for d in ("cpu", "cuda")] == \
        [True, True, False, False]


@needs_triton
def test_triton_kernels_train_like_torch(small_data, tmp_path):
    overrides = {"model.num_layers": 2, "steps": 3, "gbs": 4, "device": "auto", "precision.tf32": False}
    runs = {k: train_on_ranks(1, small_config(small_data, tmp_path / k, kernels=k, **overrides))
            for k in ("torch", "triton")}
    a, b = torch.tensor(runs["torch"]["loss"]), torch.tensor(runs["triton"]["loss"])
    assert torch.allclose(a, b, rtol=1e-5, atol=0), (a.tolist(), b.tolist())


def _train_counting_graphs(cfg, backend):
    """train(cfg) on this rank with torch.compile's `backend`: (rank 0's history, dynamo's graph breaks, dynamo's
    graphs). Inductor draws random numbers with aten's generator (fallback_random), so a compiled dropout mask
    is eager's; "aot_eager" captures the same graphs (dynamo, AOTAutograd) and runs them op by op, and builds no
    C++, so it runs on a CPU without inductor's toolchain too (which train() refuses for inductor)."""
    import torch._inductor.config
    from torch._dynamo.utils import counters
    from megatron_mini import training
    torch._inductor.config.fallback_random = True
    if backend != "inductor":
        compile_ = torch.compile
        torch.compile = lambda fn, **kw: compile_(fn, backend=backend, **kw)
        training.cpu_compile_missing = lambda: None
    return training.train(cfg), sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


# test_compiled_blocks_train_like_eager's (backend, layout) by name
COMPILED_LAYOUTS = {"one": ("inductor", {"model.num_layers": 2}),        # 2 blocks: a graph each
                    "tp2": ("aot_eager", {"model.num_layers": 1, "tp": 2, "sp": True, "recompute": "selective"}),
                    "dp2-zero": ("aot_eager", {"model.num_layers": 2, "zero": 1})}   # the gathers' hooks: on the chunk


@pytest.mark.parametrize("name", list(COMPILED_LAYOUTS))
def test_compiled_blocks_train_like_eager(small_data, tmp_path, name):
    """compile=true trains the same model as eager, dropout masks included: on one rank with inductor (its fused
    kernels round like eager to ~1e-7 per op), where each block is a graph without a break (with dropout the
    masks are keyed before each block, so the chunk's blocks are not one graph) and the cross-entropy another;
    and at tp=2 with sp and selective recompute,
    where each block is a graph between the collectives and the recompute replays the masks (captured as inductor
    would, run by aot_eager: what is particular to tp=2 is the capture, and inductor's C++ build costs 20 s here);
    and at dp=2 with ZeRO-1, whose weight gathers are waited for outside the chunk's graph.
    On an H100 a break per linear cost more host time than eager's (gpt2-small 538 ms a step against 273), and
    so did a graph per block at gpt2-medium (468 against 387)."""
    overrides = {"steps": 3, "gbs": 4, "kernels": "torch", "model.dropout": 0.1}
    backend, layout = COMPILED_LAYOUTS[name]
    if backend == "inductor":
        skip_without_cpu_compiler("cpu")
    world = layout.get("tp", 1) * (2 if layout.get("zero") else 1)
    eager = train_on_ranks(world, small_config(small_data, tmp_path / "eager", compile=False, **overrides, **layout))
    cfg = small_config(small_data, tmp_path / "compiled", compile=True, **overrides, **layout)
    run, breaks, graphs = spawn(world, _train_counting_graphs, cfg, backend, init_group=False)[0]
    if layout.get("tp", 1) == 1:
        assert (breaks, graphs) == (0, 3)
    a, b = torch.tensor(eager["loss"]), torch.tensor(run["loss"])
    assert torch.allclose(a, b, rtol=1e-5, atol=0), (a.tolist(), b.tolist())


@needs_triton
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_compile_with_the_triton_kernels_trains_like_eager(small_data, tmp_path, dropout):
    """compile=true with kernels=triton: the LayerNorms and the attention are custom ops in the compiled chunk,
    which stays one graph without a break (dynamo cannot trace the kernels under Triton's interpreter, and a
    break per kernel would cut the chunk into pieces), or with dropout a graph per block, whose attention
    draws its mask's seed in the graph where eager draws it; and the run trains as the eager one does, masks
    included (captured by aot_eager, which draws from torch's generator as eager does; inductor draws its own
    numbers, the same in forward and backward but not eager's, as for torch's dropout). On the GPU when there
    is one: kernels=triton on a CPU needs the interpreter, which only the tests' CPU runs set."""
    overrides = {"model.num_layers": 2, "steps": 2, "gbs": 2, "kernels": "triton", "device": "auto",
                 "precision.tf32": False, "model.dropout": dropout}
    eager = train_on_ranks(1, small_config(small_data, tmp_path / "eager", compile=False, **overrides))
    cfg = small_config(small_data, tmp_path / "compiled", compile=True, **overrides)
    run, breaks, graphs = spawn(1, _train_counting_graphs, cfg, "aot_eager", init_group=False)[0]
    # the chunk's two blocks, or each block (the head, with the fused cross-entropy, is eager)
    assert (breaks, graphs) == (0, 2 if dropout else 1)
    a, b = torch.tensor(eager["loss"]), torch.tensor(run["loss"])
    assert torch.allclose(a, b, rtol=1e-5, atol=0), (a.tolist(), b.tolist())


def test_the_cuda_sdpa_order_stays_in_the_graph():
    """model.sdpa's CUDA path, model.sdpa_in_order (sdpa_kernel(CUDA_SDPA_ORDER, set_priority=True)), traced by
    dynamo without a graph break and computing what F.scaled_dot_product_attention does (on CPU tensors: the
    context and its tracing are the same; a break would split the compiled chunk into a graph per block)."""
    import torch.nn.functional as F

    def ordered(q, k, v):
        return model.sdpa_in_order(q, k, v, is_causal=True) * 2
    q, k, v = torch.randn(3, 2, 4, 16, 8).unbind(0)
    explained = torch._dynamo.explain(ordered)(q, k, v)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    assert torch.equal(torch.compile(ordered, backend="aot_eager")(q, k, v),
                       F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_the_compiled_attention_core_runs_the_eager_sdpa_backend_in_bf16(device):
    """Attention.core in bf16 (the training dtype; SDPA's fused backends take no fp32 there) under torch.compile:
    the AOT graphs call the backend the eager call picks (on CUDA through model.sdpa's CUDA_SDPA_ORDER: cuDNN
    first on an H100) and its backward, and the output and the qkv gradient are within bf16 rounding of an fp32
    reference, as eager's are (on CUDA through inductor, which lays out the compiled SDPA's inputs and gradients
    itself; on the CPU through aot_eager)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch.nn.attention import SDPBackend
    cfg = ModelConfig(num_layers=1, hidden_size=128, num_heads=2, seq_len=128, vocab_size=128)
    attn = model.Attention(cfg, model.ParallelContext.one_device(device), device)
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(128, 3, 3 * 128, generator=g).to(device, torch.bfloat16)       # [s, b, 3 * heads * d]
    dy = torch.randn(128, 3, 128, generator=g).to(device, torch.bfloat16)

    def run(core, dtype=torch.bfloat16):
        x = qkv.to(dtype).clone().requires_grad_()
        y = core(x)
        y.backward(dy.to(dtype))
        return y.float(), x.grad.float()

    with torch.nn.attention.sdpa_kernel([SDPBackend.MATH]):
        reference = run(attn.core, torch.float32)                # (the core has no parameters)
    q, k, v = (t.view(128, 3, 2, 64).permute(1, 2, 0, 3) for t in qkv.split(128, dim=-1))
    with (torch.nn.attention.sdpa_kernel(model.CUDA_SDPA_ORDER, set_priority=True) if device == "cuda"
          else contextlib.nullcontext()):
        choice = torch._fused_sdp_choice(q, k, v, is_causal=True)
    kind = {b.value: name for b, name in ((SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.FLASH_ATTENTION,
            "flash"), (SDPBackend.EFFICIENT_ATTENTION, "efficient"), (SDPBackend.MATH, "math"))}[int(choice)]
    graphs = []

    def record(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return make_boxed_func(gm.forward)
    run(torch.compile(attn.core, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True))
    forward, backward = graphs
    if kind != "math":                                  # (the math backend is decomposed into matmuls)
        assert any(f"_scaled_dot_product_{kind}" in op and "backward" not in op for op in forward), forward
        assert any(f"_scaled_dot_product_{kind}" in op and "backward" in op for op in backward), backward
    torch._dynamo.reset()
    compiled = torch.compile(attn.core, backend="inductor" if device == "cuda" else "aot_eager", fullgraph=True)
    for got in (run(attn.core), run(compiled)):
        for a, ref in zip(got, reference):
            assert ((a - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_a_chunk_traces_as_one_graph(recompute):
    """At tp=1 without dropout a chunk's blocks trace without a graph break (what compile_chunks relies on),
    with selective recompute too when nothing is random (no RNG state to save). With dropout each block is
    compiled on its own: its masks are keyed before it (RNGTracker.seed), which a graph cannot do inside."""
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, seq_len=16, vocab_size=128)
    ctx = dataclasses.replace(model.ParallelContext.one_device("cpu"), recompute=recompute)
    (chunk,) = model.build_chunks(cfg, ctx, [(1, 3)], seed=0, device="cpu")
    x = torch.randn(16, 2, 32, requires_grad=True)
    explained = torch._dynamo.explain(chunk.train()._blocks)(x, None)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    compiled = dataclasses.replace(ctx, compile=True)
    assert compiled.compile_chunks(0.0) and not compiled.compile_chunks(0.1)
