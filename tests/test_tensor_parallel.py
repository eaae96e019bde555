"""Tensor and sequence parallelism against single-process references (CPU, gloo, fp32).

Process start-up dominates on a small machine, so ONE 8-rank spawn (the module fixture `res`)
builds three meshes over the same processes -- tp=4 x dp=2, tp=2 x dp=4 and tp=1 x dp=8 --
runs every check on each and returns plain numbers and numpy arrays; the tests below assert
on them. Several TP groups exist in every mesh and each DP replica gets its own data, so a
collective that leaks across TP groups shows up as a wrong value.

- mappings: rank-valued inputs, forward and backward, compared with values computed here
  analytically; the (group, op) -> (calls, bytes) ledger of the forward and of the backward.
- layers: Column/RowParallelLinear, VocabParallelEmbedding vs nn.Linear / nn.Embedding with
  the full weight (outputs, input grads, gathered weight grads, bias grads).
- vocab-parallel cross entropy vs F.cross_entropy (padded vocabulary, label smoothing).
- a transformer Block: sp on vs off, and tp>1 vs tp=1 with the same full weights.
- RNGTracker: which streams agree across TP / DP ranks.

A section that raises on every rank fails only the tests that read it; one that raises on some
ranks only ends the spawn within a minute with that traceback (see `_guard`), never a hang.
"""
from __future__ import annotations

import functools
import itertools
import traceback
import zlib

import numpy as np
import pytest
import torch

from harness import HAS_TRITON, needs_triton
from ranks import spawn

WORLD = 8
MESHES = {"tp4dp2": (4, 2), "tp2dp4": (2, 4), "tp1dp8": (1, 8)}
TP_MESHES = ["tp4dp2", "tp2dp4"]
X_SHAPE = (8, 2, 8)        # [s, b, h]: s and h divisible by every tp used here
MAPPINGS = [
    "copy_to_tensor_parallel_region",
    "reduce_from_tensor_parallel_region",
    "gather_from_tensor_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
]
LAYER_TOL = 1e-6           # fp32, relative to the reference's largest entry
BARRIER_TIMEOUT_S = 60     # between sections; generous for a loaded machine
BLOCK_TOL = 1e-5
CE_VOCAB, CE_PADDED = 50, 64
# (name, label smoothing, dtype, real classes): 20 of 64 leaves tp=4's last two shards only padding; "masked":
# half the rows -inf over the first 16 columns (tp=4's first shard whole), their targets past them
CE_CASES = (("ls=0", 0.0, torch.float32, CE_VOCAB), ("ls=0.1", 0.1, torch.float32, CE_VOCAB),
            ("ls=0.1,bf16", 0.1, torch.bfloat16, CE_VOCAB), ("ls=0.1,V=20", 0.1, torch.float32, 20),
            ("ls=0,masked", 0.0, torch.float32, CE_VOCAB))


def rank_tensor(g: int, shape, offset: float = 0.0) -> torch.Tensor:
    """(g + 1) * (1 + offset + arange): integer-valued, distinct per global rank, exact sums in fp32."""
    n = int(np.prod(shape))
    return ((g + 1) * (torch.arange(n, dtype=torch.float32) + 1 + offset)).reshape(shape)


def _summary(ledger) -> dict:
    return dict(ledger.summary())


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to the reference's largest entry (absolute below 1)."""
    a, b = a.detach().float(), b.detach().float()
    if a.shape != b.shape:
        return float("inf")
    return (a - b).abs().max().item() / max(1.0, b.abs().max().item())


# ============================================================================ rank-side checks
def _mapping_checks(mesh) -> dict:
    from megatron_mini import tensor_parallel as tp

    g = mesh.rank
    out = {}
    for name in MAPPINGS:
        fn = getattr(tp, name)
        x = rank_tensor(g, X_SHAPE).requires_grad_()
        mesh.ledger.reset()
        y = fn(x.clone(), mesh.tp_group)          # reduce_from consumes its input: hand it a copy
        fwd = _summary(mesh.ledger)
        mesh.ledger.reset()
        y.backward(rank_tensor(g, y.shape, 1000))
        out[name] = dict(y=y.detach().numpy().copy(), dx=x.grad.numpy().copy(), fwd=fwd, bwd=_summary(mesh.ledger))
        if mesh.tp == 1:                          # a no-op: the very same tensor, no autograd node
            x1 = rank_tensor(g, X_SHAPE).requires_grad_()
            y1 = fn(x1, mesh.tp_group)
            out[name]["identity"] = y1 is x1
    # copy_to must not all-reduce a gradient buffer another branch of the graph also reads:
    # h is created before y, so its MulBackward runs after _CopyToTP.backward and sees the same buffer.
    p = torch.ones(X_SHAPE, requires_grad=True)
    x = torch.ones(X_SHAPE, requires_grad=True)
    h = p * 2
    y = tp.copy_to_tensor_parallel_region(x, mesh.tp_group)
    w = rank_tensor(g, X_SHAPE, 7)
    ((y + h) * w).sum().backward()
    out["alias"] = dict(p_grad=p.grad.numpy().copy(), x_grad=x.grad.numpy().copy())
    return out


def _shard_cols(t: torch.Tensor, tp: int, r: int, groups: int = 1) -> torch.Tensor:
    """Rank r's slice of the last dim of t when it is `groups` blocks each split over tp (independent of tp.shard)."""
    return torch.cat([blk.chunk(tp, -1)[r] for blk in t.chunk(groups, -1)], -1)


def gather_full(t, spec, tp_group):
    """All-gather a TP-sharded tensor (a parameter or its gradient) to its full value."""
    from megatron_mini import comm
    from megatron_mini.tensor_parallel import unshard
    if spec.tp_dim is None or tp_group.size == 1:
        return t
    return unshard(list(comm.all_gather(t.unsqueeze(0), tp_group, dim=0).unbind(0)), spec)


def _layer_checks(mesh) -> dict:
    import torch.distributed as dist
    import torch.nn as nn

    from megatron_mini.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, shard

    T, r, grp = mesh.tp, mesh.tp_rank, mesh.tp_group
    S, B, IN, OUT = 8, 2, 16, 24
    gen = torch.Generator().manual_seed(100 + mesh.dp_rank)     # each DP replica its own problem
    X, W = torch.randn(S, B, IN, generator=gen), torch.randn(OUT, IN, generator=gen) * 0.3
    b, G = torch.randn(OUT, generator=gen), torch.randn(S, B, OUT, generator=gen)

    ref = nn.Linear(IN, OUT)
    with torch.no_grad():
        ref.weight.copy_(W)
        ref.bias.copy_(b)
    Xr = X.clone().requires_grad_()
    yr = ref(Xr)
    yr.backward(G)
    res = {}

    def seq(t):
        return t.chunk(T, 0)[r]

    # ColumnParallelLinear: weight [OUT/tp, IN]; input full (or a sequence shard with sp)
    for sp in (False, True):
        for groups in (1, 3):
            layer = ColumnParallelLinear(IN, OUT, grp, sequence_parallel=sp, tp_groups=groups)
            with torch.no_grad():
                layer.weight.copy_(shard(W, layer.weight.spec, T, r))
                layer.bias.copy_(shard(b, layer.bias.spec, T, r))
            x = (seq(X) if sp else X).clone().requires_grad_()
            y = layer(x)
            y.backward(_shard_cols(G, T, r, groups))           # each rank's loss is its slice's
            res[f"column[sp={sp:d},tp_groups={groups}]"] = dict(
                y=_err(y, _shard_cols(yr, T, r, groups)),
                dx=_err(x.grad, seq(Xr.grad) if sp else Xr.grad),
                dw=_err(gather_full(layer.weight.grad, layer.weight.spec, grp), ref.weight.grad),
                db=_err(gather_full(layer.bias.grad, layer.bias.spec, grp), ref.bias.grad),
                w_roundtrip=_err(gather_full(layer.weight.detach(), layer.weight.spec, grp), W),
            )

    # RowParallelLinear: weight [OUT, IN/tp]; bias replicated (marked sequence_parallel with sp)
    for sp in (False, True):
        layer = RowParallelLinear(IN, OUT, grp, sequence_parallel=sp)
        with torch.no_grad():
            layer.weight.copy_(shard(W, layer.weight.spec, T, r))
            layer.bias.copy_(b)
        x = _shard_cols(X, T, r).clone().requires_grad_()
        y = layer(x)
        y.backward(seq(G) if sp else G)
        bias_grad = layer.bias.grad.clone()
        summed = bias_grad.clone()
        if sp and T > 1:                         # sees only local tokens: sum over TP, then compare
            dist.all_reduce(summed, group=grp.pg)
        res[f"row[sp={sp:d}]"] = dict(
            y=_err(y, seq(yr) if sp else yr),
            dx=_err(x.grad, _shard_cols(Xr.grad, T, r)),
            dw=_err(gather_full(layer.weight.grad, layer.weight.spec, grp), ref.weight.grad),
            db=_err(summed, ref.bias.grad),
            db_local=_err(bias_grad, (seq(G) if sp else G).sum((0, 1))),
            spec_sp=float(layer.bias.spec.sequence_parallel != sp),
        )

    # VocabParallelEmbedding: rank i owns rows [i V/tp, (i+1) V/tp); ids on every shard edge, repeats
    V, H = 64, 8
    Wemb, Ge = torch.randn(V, H, generator=gen), torch.randn(S, B, H, generator=gen)
    ids = torch.tensor([0, 15, 16, 31, 32, 47, 48, 63, 5, 5, 40, 63, 17, 33, 0, 62])
    ids = ids[torch.randperm(ids.numel(), generator=gen)].reshape(S, B)
    emb_ref = nn.Embedding(V, H)
    with torch.no_grad():
        emb_ref.weight.copy_(Wemb)
    ye_ref = emb_ref(ids)
    ye_ref.backward(Ge)
    for sp in (False, True):
        emb = VocabParallelEmbedding(V, H, grp, sequence_parallel=sp)
        with torch.no_grad():
            emb.weight.copy_(shard(Wemb, emb.weight.spec, T, r))
        y = emb(ids)
        y.backward(seq(Ge) if sp else Ge)
        res[f"embedding[sp={sp:d}]"] = dict(
            y=_err(y, seq(ye_ref) if sp else ye_ref),
            dw=_err(gather_full(emb.weight.grad, emb.weight.spec, grp), emb_ref.weight.grad),
        )
    # the model's Embedding with sp, fed T tokens more than its context: this rank's outcome
    from megatron_mini.config import ModelConfig
    from megatron_mini.model import Embedding, ParallelContext
    from megatron_mini.rng import RNGTracker
    cpu = torch.device("cpu")
    model = ModelConfig(name="t", num_layers=1, hidden_size=H, num_heads=1, seq_len=S, vocab_size=V,
                        vocab_pad_multiple=V)
    embedding = Embedding(model, ParallelContext(grp, RNGTracker(1, r, cpu), True, "none"), cpu)
    try:
        embedding(torch.zeros(B, S + T, dtype=torch.long))
        res["too_long"] = "accepted"
    except ValueError as e:
        res["too_long"] = str(e)
    return res


def _ce_checks(mesh) -> dict:
    import torch.nn.functional as F

    from megatron_mini.tensor_parallel import vocab_parallel_cross_entropy

    T, r, grp = mesh.tp, mesh.tp_rank, mesh.tp_group
    S, B, VP = 8, 2, CE_PADDED
    gen = torch.Generator().manual_seed(300 + mesh.dp_rank)
    randn = torch.randn(S, B, VP, generator=gen) * 3
    base = torch.tensor([0, 15, 16, 31, 32, 47, 48, 49] + torch.randint(0, CE_VOCAB, (8,), generator=gen).tolist())
    base = base[torch.randperm(S * B, generator=gen)].reshape(S, B)   # a target in every shard the vocabulary spans
    grad_loss = torch.rand(S, B, generator=gen) + 0.5
    cols = torch.arange(VP).chunk(T)[r]
    res = {}
    for (case, ls, dtype, V), fused in itertools.product(CE_CASES, (False, True) if HAS_TRITON else (False,)):
        case += ",fused" if fused else ""
        logits, tgt = randn.clone(), base % V
        logits[..., V:] = 30.0                     # large garbage in the padding: must be masked out
        if "masked" in case:
            logits[::2, :, :16] = float("-inf")
            tgt = 16 + base % (V - 16)
        full = logits.to(dtype).float()
        lr = full.clone().requires_grad_()
        loss_ref = F.cross_entropy(lr[..., :V].reshape(-1, V), tgt.reshape(-1), reduction="none",
                                   label_smoothing=ls).reshape(S, B)
        loss_ref.backward(grad_loss)
        # the Triton kernels on the GPU when there is one (each rank's tensors there, over gloo), else on CPU
        # under the interpreter
        dev = torch.device("cuda" if fused and torch.cuda.is_available() else "cpu")
        local = logits.to(dtype).chunk(T, -1)[r].clone().to(dev).requires_grad_()
        before = local.detach().clone()
        mesh.ledger.reset()
        loss = vocab_parallel_cross_entropy(local, tgt.to(dev), grp, V, ls, fused=fused)
        fwd = _summary(mesh.ledger)
        mesh.ledger.reset()
        loss.backward(grad_loss.to(dev))
        grad = local.grad.cpu()
        res[case] = dict(
            loss=_err(loss.cpu(), loss_ref), dlogits=_err(grad, lr.grad.chunk(T, -1)[r]),
            pad_grad=grad[..., cols >= V].abs().max().item() if (cols >= V).any() else 0.0,
            logits_unchanged=bool(torch.equal(local.detach(), before)),
            loss_dtype=str(loss.dtype), loss_shape=tuple(loss.shape), grad_dtype=str(local.grad.dtype),
            fwd=fwd, bwd=_summary(mesh.ledger), tokens=S * B,
        )
    return res


def _seeded_full(name: str, shape, spec) -> torch.Tensor:
    """A test value for every parameter, far from the default init (LayerNorm != 1, biases != 0)."""
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    noise = torch.randn(shape, generator=gen)
    return {"ones": 1 + 0.2 * noise, "zeros": 0.1 * noise}.get(spec.init, 0.1 * noise)


def _block_checks(mesh, mesh1) -> dict:
    import torch.distributed as dist

    from megatron_mini.config import ModelConfig
    from megatron_mini.meter import SavedTensorMeter
    from megatron_mini.model import Block, GPTChunk, ParallelContext, initialize
    from megatron_mini.rng import RNGTracker
    from megatron_mini.tensor_parallel import full_shape, shard

    cpu = torch.device("cpu")
    model = ModelConfig(name="t", num_layers=2, hidden_size=64, num_heads=4, seq_len=16, vocab_size=64,
                        vocab_pad_multiple=64)
    S, B, H = model.seq_len, 2, model.hidden_size
    gen = torch.Generator().manual_seed(500 + mesh.dp_rank)
    X, G = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)

    def build(m, sp, recompute="none", seeded=True):
        ctx = ParallelContext(m.tp_group, RNGTracker(11, m.tp_rank, cpu), sp, recompute)
        chunk = GPTChunk([Block(0, model, ctx, cpu)])
        if seeded:
            with torch.no_grad():
                for name, p in chunk.named_global_parameters():
                    p.copy_(shard(_seeded_full(name, full_shape(p, m.tp), p.spec), p.spec, m.tp, m.tp_rank))
        return chunk

    def run(m, chunk, sp):
        T, r = m.tp, m.tp_rank
        x = (X.chunk(T, 0)[r] if sp else X).clone().requires_grad_()
        m.ledger.reset()
        meter = SavedTensorMeter(exclude=chunk.parameters())
        with meter.hooks():
            y = chunk(x)
        fwd, saved = _summary(m.ledger), meter.live
        m.ledger.reset()
        y.backward(G.chunk(T, 0)[r] if sp else G)
        bwd = _summary(m.ledger)
        grads, sp_names = {}, []
        for name, p in chunk.named_global_parameters():
            g = p.grad.clone()
            if p.spec.sequence_parallel:
                sp_names.append(name)
                if T > 1:
                    dist.all_reduce(g, group=m.tp_group.pg)
            else:
                g = gather_full(g, p.spec, m.tp_group)
            grads[name] = g
        return dict(y=y.detach(), dx=x.grad, grads=grads, fwd=fwd, bwd=bwd, sp_names=sorted(sp_names), saved=saved)

    def compare(a, b, seq_shard_a=False):
        """Max errors of run a against run b (b full-sequence); a may hold a sequence shard."""
        def local(t):
            return t.chunk(mesh.tp, 0)[mesh.tp_rank] if seq_shard_a else t
        errs = dict(y=_err(a["y"], local(b["y"])), dx=_err(a["dx"], local(b["dx"])))
        assert a["grads"].keys() == b["grads"].keys()
        errs["grads"] = max(_err(a["grads"][k], b["grads"][k]) for k in a["grads"])
        errs["worst"] = max(a["grads"], key=lambda k: _err(a["grads"][k], b["grads"][k]))
        return errs

    ref = run(mesh1, build(mesh1, False), False)          # tp=1, full weights, same data
    plain = run(mesh, build(mesh, False), False)
    seqp = run(mesh, build(mesh, True), True)
    seqp_recompute = run(mesh, build(mesh, True, "full"), True)

    # layout-independent init: model.initialize at tp and at tp=1 give the same full tensors
    c_tp, c_1 = build(mesh, True, seeded=False), build(mesh1, True, seeded=False)
    initialize([c_tp], mesh.tp_group, 1234)
    initialize([c_1], mesh1.tp_group, 1234)
    full_1 = dict(c_1.named_global_parameters())
    init_err = max(_err(gather_full(p.detach(), p.spec, mesh.tp_group), full_1[n])
                   for n, p in c_tp.named_global_parameters())

    return dict(
        sp_vs_plain=compare(seqp, plain, seq_shard_a=True),
        plain_vs_tp1=compare(plain, ref),
        sp_vs_tp1=compare(seqp, ref, seq_shard_a=True),
        recompute_vs_sp=compare(seqp_recompute, seqp),
        ledger=dict(plain=(plain["fwd"], plain["bwd"]), sp=(seqp["fwd"], seqp["bwd"]), tp1=(ref["fwd"], ref["bwd"])),
        sp_names=seqp["sp_names"], plain_sp_names=plain["sp_names"], init_err=init_err,
        saved=dict(plain=plain["saved"], sp=seqp["saved"], tp1=ref["saved"]),
        activation_bytes=S * B * H * 4,
    )


def _rng_checks(mesh) -> dict:
    """The streams as a layer's forward leaves them keyed (RNGTracker.seed(sample, layer)), under four keys;
    "a_again" is key "a" on a new tracker."""
    import torch.nn.functional as F

    from megatron_mini.rng import RNGTracker

    cpu = torch.device("cpu")
    out = {}
    for name, (sample, layer) in {"a": (8, 3), "a_again": (8, 3), "other_sample": (12, 3),
                                  "other_layer": (8, 4)}.items():
        tracker = RNGTracker(1234, mesh.tp_rank, cpu)
        tracker.seed(sample, layer)
        start = torch.get_rng_state()
        default1 = torch.rand(64)
        with tracker.fork():
            mask1 = F.dropout(torch.ones(512), 0.5)
        with tracker.fork():
            mask2 = F.dropout(torch.ones(512), 0.5)
        default2 = torch.rand(64)
        replay = torch.Generator()
        replay.set_state(start)
        undisturbed = torch.rand(128, generator=replay)                   # the default stream without forks
        out[name] = dict(default=torch.cat([default1, default2]).numpy(), undisturbed=undisturbed.numpy(),
                         mask1=mask1.numpy(), mask2=mask2.numpy())
    return out


def _guard(fn, *args) -> dict:
    """Run one section; an exception becomes {"error": traceback} for the tests that read the section.

    Every rank then meets at a monitored barrier: if the section failed on some ranks only, the
    others are stuck in one of its collectives, and this rank ends the job within seconds (its
    traceback becomes the test error) instead of waiting out the collective timeout.
    """
    import time
    from datetime import timedelta

    import torch.distributed as dist

    t0 = time.perf_counter()
    try:
        r = fn(*args)
        r["_t"] = time.perf_counter() - t0          # the section's seconds on this rank (diagnosing slowness)
    except Exception:  # noqa: BLE001
        r = {"error": traceback.format_exc()}
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=BARRIER_TIMEOUT_S))
    except RuntimeError as e:
        raise RuntimeError(f"{fn.__name__} failed on some ranks only; this rank's result:\n"
                           f"{r.get('error', 'no error')}") from e
    return r


def _worker() -> dict:
    from megatron_mini.mesh import ParallelMesh

    meshes = {name: ParallelMesh(tp=t, pp=1, dp=d) for name, (t, d) in MESHES.items()}
    out = {"coords": {name: (m.tp_rank, m.dp_rank) for name, m in meshes.items()}}
    for name, m in meshes.items():
        out[("mappings", name)] = _guard(_mapping_checks, m)
        out[("layers", name)] = _guard(_layer_checks, m)
        out[("ce", name)] = _guard(_ce_checks, m)
    for name in TP_MESHES:
        out[("block", name)] = _guard(_block_checks, meshes[name], meshes["tp1dp8"])
        out[("rng", name)] = _guard(_rng_checks, meshes[name])
    return out


@pytest.fixture(scope="module")
def res():
    return spawn(WORLD, _worker)


def section(res, key) -> list:
    """Per-rank results of one section; a section that raised fails the test with its traceback."""
    for rank, r in enumerate(res):
        if "error" in r[key]:
            pytest.fail(f"rank {rank}, section {key} raised:\n{r[key]['error']}")
    return [r[key] for r in res]


# ============================================================================ mappings
def expected_mapping(name: str, tp: int, g: int):
    """(y, dx, forward ledger, backward ledger) of `name` on global rank g, analytically."""
    r, first = g % tp, g - g % tp
    members = range(first, first + tp)                      # this rank's TP group (pp=1: consecutive)
    x = [rank_tensor(m, X_SHAPE) for m in members]
    n = int(np.prod(X_SHAPE)) * 4
    seq_shard = (X_SHAPE[0] // tp,) + X_SHAPE[1:]
    seq_full = (X_SHAPE[0] * tp,) + X_SHAPE[1:]
    col_full = X_SHAPE[:-1] + (X_SHAPE[-1] * tp,)

    def gy(m, shape):
        return rank_tensor(m, shape, 1000)

    AR, AG, RS = ("tp", "all_reduce"), ("tp", "all_gather"), ("tp", "reduce_scatter")
    if name == "copy_to_tensor_parallel_region":
        y, dx = x[r], sum(gy(m, X_SHAPE) for m in members)
        fwd, bwd = {}, {AR: (1, n)}
    elif name == "reduce_from_tensor_parallel_region":
        y, dx = sum(x), gy(g, X_SHAPE)
        fwd, bwd = {AR: (1, n)}, {}
    elif name == "gather_from_tensor_parallel_region":
        y, dx = torch.cat(x, -1), gy(g, col_full).chunk(tp, -1)[r]
        fwd, bwd = {AG: (1, tp * n)}, {}
    elif name == "scatter_to_sequence_parallel_region":
        y, dx = x[r].chunk(tp, 0)[r], torch.cat([gy(m, seq_shard) for m in members], 0)
        fwd, bwd = {}, {AG: (1, n)}
    elif name == "gather_from_sequence_parallel_region":
        y, dx = torch.cat(x, 0), sum(gy(m, seq_full) for m in members).chunk(tp, 0)[r]
        fwd, bwd = {AG: (1, tp * n)}, {RS: (1, tp * n)}
    elif name == "reduce_scatter_to_sequence_parallel_region":
        y, dx = sum(x).chunk(tp, 0)[r], torch.cat([gy(m, seq_shard) for m in members], 0)
        fwd, bwd = {RS: (1, n)}, {AG: (1, n)}
    else:
        raise KeyError(name)
    if tp == 1:
        fwd, bwd = {}, {}
    return y.numpy(), dx.numpy(), fwd, bwd


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("name", MAPPINGS)
def test_mapping_forward_backward(res, mesh, name):
    tp = MESHES[mesh][0]
    for g, r in enumerate(section(res, ("mappings", mesh))):
        got = r[name]
        y, dx, _, _ = expected_mapping(name, tp, g)
        np.testing.assert_array_equal(got["y"], y, err_msg=f"{name} forward, rank {g}, {mesh}")
        np.testing.assert_array_equal(got["dx"], dx, err_msg=f"{name} backward, rank {g}, {mesh}")


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("name", MAPPINGS)
def test_mapping_ledger(res, mesh, name):
    """Exactly the expected (group, op) calls and bytes: forward and backward separately; none at tp=1."""
    tp = MESHES[mesh][0]
    for g, r in enumerate(section(res, ("mappings", mesh))):
        _, _, fwd, bwd = expected_mapping(name, tp, g)
        assert r[name]["fwd"] == fwd, f"{name} forward ledger on rank {g} ({mesh})"
        assert r[name]["bwd"] == bwd, f"{name} backward ledger on rank {g} ({mesh})"


@pytest.mark.parametrize("name", MAPPINGS)
def test_mapping_is_identity_at_tp1(res, name):
    for g, r in enumerate(section(res, ("mappings", "tp1dp8"))):
        assert r[name]["identity"], f"{name} at tp=1 should return its input itself"


@pytest.mark.parametrize("mesh", TP_MESHES)
def test_copy_to_does_not_corrupt_shared_gradient(res, mesh):
    tp = MESHES[mesh][0]
    for g, r in enumerate(section(res, ("mappings", mesh))):
        first = g - g % tp
        w = [rank_tensor(m, X_SHAPE, 7).numpy() for m in range(first, first + tp)]
        np.testing.assert_array_equal(r["alias"]["x_grad"], sum(w))          # f's own gradient is right
        np.testing.assert_array_equal(r["alias"]["p_grad"], 2 * w[g - first],
                                      err_msg="the sibling branch's gradient was all-reduced too")


# ============================================================================ layers
LAYER_CASES = ([f"column[sp={sp},tp_groups={groups}]" for sp in (0, 1) for groups in (1, 3)]
               + [f"row[sp={sp}]" for sp in (0, 1)] + [f"embedding[sp={sp}]" for sp in (0, 1)])


def _check_layer(res, mesh, case):
    for g, r in enumerate(section(res, ("layers", mesh))):
        errs = r[case]
        bad = {k: v for k, v in errs.items() if not v <= LAYER_TOL}
        assert not bad, f"{case} on rank {g} ({mesh}): relative errors {bad} > {LAYER_TOL}"


@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("case", LAYER_CASES)
def test_layer_matches_full_weight_reference(res, mesh, case):
    """Output, input grad, gathered weight grad, bias grad (summed over TP for the sp row bias) vs torch."""
    _check_layer(res, mesh, case)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_a_sequence_longer_than_the_context_is_refused_on_every_rank(res, mesh):
    """With sp each rank embeds s/tp positions: a sequence past the context must be refused by all of them,
    before the embedding's reduce-scatter (rank 0's shard alone fitted, and it went on into the next
    collective while the others had raised)."""
    outcomes = [r["too_long"] for r in section(res, ("layers", mesh))]
    seq_len = 8                                  # _layer_checks' S
    assert all(f"exceed the model's context of {seq_len}" in o for o in outcomes), outcomes


def test_layers_refuse_sizes_tp_does_not_divide():
    """A split that tp does not divide would drop rows silently (ColumnParallelLinear(8, 10) at tp=4 held 8
    of the 10 output rows): refused, naming the size."""
    from megatron_mini.comm import Group, Ledger
    from megatron_mini.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    tp4 = Group("tp", [0, 1, 2, 3], None, Ledger(), me=0)
    for make, what in ((lambda: ColumnParallelLinear(8, 10, tp4), "out_features 10"),
                       (lambda: RowParallelLinear(10, 8, tp4), "in_features 10"),
                       (lambda: VocabParallelEmbedding(63, 8, tp4), "num_embeddings 63")):
        with pytest.raises(ValueError, match=f"{what} is not divisible by tp=4"):
            make()
    assert ColumnParallelLinear(8, 12, tp4).weight.shape == (3, 8)


def test_row_parallel_bias_gradient_goes_into_its_fp32_main_grad():
    """At tp > 1 the row-parallel bias is added after g, outside the linear: its gradient must still be
    summed in fp32 straight into the main grad, as at tp = 1 (a bf16 .grad first: 2.8e-3 relative error
    over 4096 tokens, against 5e-8)."""
    from megatron_mini.comm import Group, Ledger
    from megatron_mini.tensor_parallel import RowParallelLinear
    for grp in (Group("tp", [0], None, Ledger()), Group("tp", [0, 1], None, Ledger(), me=0)):
        layer = RowParallelLinear(64, 16, grp).to(torch.bfloat16)
        ready = []
        for p in layer.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
            p.main_grad_ready = functools.partial(ready.append, p)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 1, 64 // grp.size, generator=gen).bfloat16()
        dy = torch.randn(4096, 1, 16, generator=gen).bfloat16()
        layer(x).backward(dy)
        exact = dy.double().sum((0, 1))
        assert layer.bias.grad is None and sum(p is layer.bias for p in ready) == 1
        err = ((layer.bias.main_grad.double() - exact).abs() / exact.abs()).max().item()
        assert err < 1e-6, (grp.size, err)


def test_the_lookups_fp32_gradient_is_the_same_sum_on_every_run():
    """The word embedding's gradient added straight into its fp32 main grad (`_Embedding`) sums repeated ids in
    one order: four CPU threads give the same bits on every backward (index_put_'s accumulate there did not: 20
    different sums in 20), equal to the fp64 sum to fp32 rounding."""
    from megatron_mini.tensor_parallel import embedding
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 50, (8, 512), generator=gen)         # 4096 tokens of 50 ids: ~80 of each
    dy = torch.randn(8, 512, 64, generator=gen)
    weight = torch.nn.Parameter(torch.randn(64, 64, generator=gen))
    weight.main_grad_ready = lambda: None
    threads = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        sums = set()
        for _ in range(20):
            weight.main_grad = torch.zeros(64, 64)
            embedding(ids, weight).backward(dy)
            sums.add(weight.main_grad.numpy().tobytes())
    finally:
        torch.set_num_threads(threads)
    exact = torch.zeros(64, 64, dtype=torch.float64).index_add_(0, ids.reshape(-1), dy.reshape(-1, 64).double())
    assert weight.grad is None and len(sums) == 1
    torch.testing.assert_close(weight.main_grad.double(), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sp", [False, True], ids=["f", "sp"])
@pytest.mark.parametrize("needs", ["x,W", "x", "W", "x,W,main-grad"])
def test_column_parallel_backward_runs_its_collectives_beside_its_gemms(sp, needs, monkeypatch):
    """A tp=2 column-parallel linear's backward launches each collective before the GEMM it overlaps and
    waits for it after, and records that GEMM's FLOPs: without sp, dx's all-reduce (f's) beside dW's GEMM;
    with sp, the saved input shard gathered again beside dx's GEMM (only when W needs a gradient) and dx's
    reduce-scatter beside dW's. `needs`: which of x and W need a gradient, and whether W's goes into an fp32
    main grad (the gradient-accumulation fusion). On the meta device over a virtual tp=2 group (records,
    moves nothing)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from megatron_mini import comm
    from megatron_mini.tensor_parallel import column_parallel_linear
    events = []

    class Log(comm.Ledger):
        def record(self, group, op, nbytes, beside_flops=0.0):
            events.append(f"launch {op}")
            super().record(group, op, nbytes, beside_flops)

    class GEMMs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__.rstrip("_") in ("mm", "addmm", "bmm"):
                events.append("mm")
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(comm.Work, "wait", lambda self: events.append("wait"))
    ledger = Log()
    group = comm.Group("tp", [0, 1], None, ledger, me=0)
    need_x, need_w = "x" in needs.split(","), "W" in needs
    x = torch.empty(4 if sp else 8, 2, 8, device="meta", requires_grad=need_x)      # [s(/tp), b, in]
    w = torch.empty(6, 8, device="meta", requires_grad=need_w)                      # [out/tp, in]
    if "main-grad" in needs:
        w.main_grad, w.main_grad_ready = torch.zeros(6, 8, device="meta"), lambda: events.append("W ready")
    y = column_parallel_linear(x, w, None, group, sp)
    assert y.shape == (8, 2, 6) and ledger.summary() == ({("tp", "all_gather"): (1, 8 * 2 * 8 * 4)} if sp else {})
    ledger.reset()
    events.clear()
    with GEMMs():
        y.backward(torch.empty_like(y))
    act, gemm = 8 * 2 * 8 * 4, 2 * (8 * 2 * 6) * 8               # bytes of [s, b, in]; FLOPs of dy [s, b, out/tp] W
    dx = ["mm"] if need_x else []
    dw = ["mm"] + ["W ready"] * ("main-grad" in needs) if need_w else []
    expected = {}
    if sp:
        regather = ["launch all_gather"] if need_w else []
        scatter = ["launch reduce_scatter"] + dw + ["wait"] if need_x else dw
        assert events == regather + dx + ["wait"] * need_w + scatter
        expected.update({("tp", "all_gather", act, gemm * need_x): 1} if need_w else {})
        expected.update({("tp", "reduce_scatter", act, gemm * need_w): 1} if need_x else {})
    else:
        assert events == (dx + ["launch all_reduce"] + dw + ["wait"] if need_x else dw)
        expected.update({("tp", "all_reduce", act, gemm * need_w): 1} if need_x else {})
    assert ledger.summary() == {(g, op): (n, n * nbytes) for (g, op, nbytes, _), n in expected.items()}
    assert ledger.overlaps() == {k: n for k, n in expected.items() if k[3]}     # nothing beside a GEMM not run
    assert (x.grad is not None) == need_x and (w.grad is not None) == (need_w and "main-grad" not in needs)


# ============================================================================ cross entropy
@pytest.mark.parametrize("mesh", list(MESHES))
@pytest.mark.parametrize("case", [pytest.param(c[0] + f, marks=needs_triton if f else ())
                                  for c in CE_CASES for f in ("", ",fused")])
def test_vocab_parallel_cross_entropy(res, mesh, case):
    """Loss and d(logits) vs F.cross_entropy on the 50 (or 20) real classes of a vocabulary padded to 64, by the
    torch path and by the Triton kernels (",fused"; on CPU through the interpreter)."""
    tp = MESHES[mesh][0]
    tol = (1e-5, 1e-2) if "bf16" in case else (LAYER_TOL, LAYER_TOL)
    for g, r in enumerate(section(res, ("ce", mesh))):
        c = r[case]
        assert c["loss"] <= tol[0] and c["dlogits"] <= tol[1], f"rank {g} ({mesh}, {case}): {c}"
        assert c["pad_grad"] == 0.0, f"padded columns got gradient {c['pad_grad']} (rank {g})"
        assert c["logits_unchanged"], "the forward modified the logits"
        assert c["loss_dtype"] == "torch.float32" and c["loss_shape"] == (8, 2)
        assert c["grad_dtype"] == ("torch.bfloat16" if "bf16" in case else "torch.float32")
        # two all-reduces: the max [tokens], then sum-exp + target logit (+ the logit sum with label smoothing);
        # none backward
        tokens = c["tokens"] * 4
        expected = {} if tp == 1 else {("tp", "all_reduce"): (2, tokens * (4 if "0.1" in case else 3))}
        assert c["fwd"] == expected, f"forward ledger {c['fwd']} != {expected}"
        assert c["bwd"] == {}, f"backward communicates: {c['bwd']}"


# ============================================================================ transformer block
@pytest.mark.parametrize("mesh", TP_MESHES)
@pytest.mark.parametrize("pair", ["sp_vs_plain", "plain_vs_tp1", "sp_vs_tp1", "recompute_vs_sp"])
def test_block_equivalence(res, mesh, pair):
    """Outputs, input grads and all (gathered; sp-marked summed over TP) parameter grads agree."""
    for g, r in enumerate(section(res, ("block", mesh))):
        errs = r[pair]
        for key in ("y", "dx", "grads"):
            assert errs[key] <= BLOCK_TOL, f"{pair} rank {g} ({mesh}): {key} differs by {errs[key]:.2e} " \
                                           f"(relative) > {BLOCK_TOL} (worst parameter {errs['worst']})"


@pytest.mark.parametrize("mesh", TP_MESHES)
def test_block_sequence_parallel_params_and_init(res, mesh):
    expected = sorted(f"blocks.0.{n}" for n in ("ln1.weight", "ln1.bias", "ln2.weight", "ln2.bias",
                                                 "attn.proj.bias", "mlp.fc2.bias"))
    for g, r in enumerate(section(res, ("block", mesh))):
        assert r["sp_names"] == expected, "parameters whose grads need the TP sum under sp"
        assert r["plain_sp_names"] == [], "without sp nothing is marked sequence_parallel"
        assert r["init_err"] == 0.0, "model.initialize gives different full weights at tp>1 and tp=1"


@pytest.mark.parametrize("mesh", TP_MESHES)
def test_block_ledger(res, mesh):
    """Per block: 2 all-reduces forward + 2 backward; with sp the same volume as all-gather/reduce-scatter,
    plus the two column-parallel linears' inputs gathered again in backward (only their shards are saved)."""
    for g, r in enumerate(section(res, ("block", mesh))):
        n = r["activation_bytes"]
        AR, AG, RS = ("tp", "all_reduce"), ("tp", "all_gather"), ("tp", "reduce_scatter")
        assert r["ledger"]["plain"] == ({AR: (2, 2 * n)}, {AR: (2, 2 * n)})
        assert r["ledger"]["sp"] == ({AG: (2, 2 * n), RS: (2, 2 * n)}, {AG: (4, 4 * n), RS: (2, 2 * n)})
        assert r["ledger"]["tp1"] == ({}, {})


@pytest.mark.parametrize("mesh", TP_MESHES)
def test_block_sequence_parallel_saves_a_tp_th(res, mesh):
    """With sp every tensor a block saves for backward is a 1/tp share of what one device saves
    (Korthikanti et al. 2022, section 4.2): the LayerNorms' and the column-parallel linears' inputs are
    sequence shards, the rest is split by heads or by the MLP's width. Without sp the LayerNorms' and
    the linears' inputs are whole on every rank."""
    tp = MESHES[mesh][0]
    for g, r in enumerate(section(res, ("block", mesh))):
        saved = r["saved"]
        assert saved["sp"] * tp == saved["tp1"], (g, saved)
        assert saved["plain"] > saved["sp"], (g, saved)


# ============================================================================ RNG
@pytest.mark.parametrize("mesh", TP_MESHES)
def test_rng_tracker_streams(res, mesh):
    """A key (sample, layer) gives the default stream the same draws on every rank (replicated regions: the
    TP ranks must agree) and the model-parallel stream a mask of its own per TP rank, the same on a rank with
    the same tp_rank; the same key again gives the same draws, another sample or layer other draws; a fork
    leaves the default stream where it was."""
    rows = section(res, ("rng", mesh))
    coords = [r["coords"][mesh] for r in res]
    for g, (t, d) in enumerate(coords):
        mine = rows[g]["a"]
        assert set(np.unique(mine["mask1"])) <= {0.0, 2.0} and 0 < mine["mask1"].sum() < 2 * 512
        assert not np.array_equal(mine["mask1"], mine["mask2"]), "the model-parallel stream did not advance"
        for key in ("a", "other_sample", "other_layer"):
            np.testing.assert_array_equal(rows[g][key]["default"], rows[g][key]["undisturbed"],
                                          err_msg="fork() disturbed the default stream")
        for what in ("default", "mask1", "mask2"):
            np.testing.assert_array_equal(mine[what], rows[g]["a_again"][what], err_msg="not reproducible")
            for key in ("other_sample", "other_layer"):
                assert not np.array_equal(mine[what], rows[g][key][what]), (key, what)
        np.testing.assert_array_equal(mine["default"], rows[0]["a"]["default"], err_msg="default stream differs")
        for h, (t2, d2) in enumerate(coords):
            if h == g:
                continue
            same = np.array_equal(mine["mask1"], rows[h]["a"]["mask1"])
            if t2 == t:
                assert same, f"ranks {g} and {h} (tp_rank {t}) drew different dropout masks for one key"
            else:
                assert not same, f"ranks {g} and {h} (tp_ranks {t}, {t2}) drew the same dropout mask"


# ----------------------------------------------------------------------------- gradient accumulation GEMM
@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_accumulate_matmul_adds_the_product_into_fp32(device, dtype):
    """main_grad += dy^T x in whatever way this torch offers on the device (gemm_into_fp32): the fp64
    product of the 16-bit inputs added to what was there, to fp32 accumulation rounding, plus one rounding
    of the product to `dtype` where the way is "cast"."""
    from megatron_mini.tensor_parallel import accumulate_matmul, gemm_into_fp32
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(*shape, generator=g).to(device=device, dtype=dtype) for shape in ((64, 96), (96, 48)))
    out = torch.randn(64, 48, generator=g).to(device)
    product = a.double() @ b.double()
    expected = out.double() + product
    bound = 2.0 ** -20 * (a.double().abs() @ b.double().abs() + out.double().abs())
    if gemm_into_fp32(device, dtype) == "cast":
        bound += product.abs() * torch.finfo(dtype).eps / 2
    accumulate_matmul(out, a, b)
    assert out.dtype == torch.float32
    assert ((out.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("way", ["this torch's", "one GEMM"] + (["CUDA"] if torch.cuda.is_available() else []))
def test_bias_gradient_goes_into_the_fp32_main_grad(monkeypatch, way):
    """main_grad_b += the sum of dy over tokens, as the fp64 sum of the 16-bit dy to fp32 rounding, whether
    it is a reduction then an add (the CPU) or the GEMM 1^T dy into fp32 that CUDA takes where torch has
    it ("one GEMM": that branch, its GEMM emulated in fp32 on the CPU; "CUDA": the real one, into the main
    grad's view of a flat buffer at an odd offset, whose neighbours stay as they were), and the parameter
    is told once."""
    from megatron_mini import tensor_parallel as tp_mod
    device = "cuda" if way == "CUDA" else "cpu"
    gemms, real = [], tp_mod.GEMM_INTO_FP32["addmm"]
    tp_mod.gemm_into_fp32(device, torch.bfloat16)   # probed (and cached) before the stand-in, which counts GEMMs
    if way == "one GEMM":
        monkeypatch.setattr(tp_mod, "gemm_into_fp32", lambda device_type, dtype: "addmm")
        real = lambda out, a, b: out.add_(a.float() @ b.float())    # noqa: E731
    monkeypatch.setitem(tp_mod.GEMM_INTO_FP32, "addmm", lambda out, a, b: (gemms.append(out.shape), real(out, a, b)))

    class Bias:                      # what a GradBuffer gives a parameter: a view of the flat fp32 buffer
        flat = torch.randn(100, generator=torch.Generator().manual_seed(1)).to(device)
        main_grad, ready = flat[3:51], 0

        def main_grad_ready(self):
            self.ready += 1

    bias = Bias()
    before = bias.flat.clone()
    dy = torch.randn(300, 48, generator=torch.Generator().manual_seed(0)).to(device, torch.bfloat16)
    expected = bias.main_grad.double() + dy.double().sum(0)
    tp_mod._bias_grad_into_main(bias, dy)
    bound = 2.0 ** -20 * (dy.double().abs().sum(0) + expected.abs())
    assert bias.main_grad.dtype == torch.float32 and bias.ready == 1
    assert ((bias.main_grad.double() - expected).abs() <= bound).all()
    assert torch.equal(bias.flat[:3], before[:3]) and torch.equal(bias.flat[51:], before[51:])
    takes_gemm = way == "one GEMM" or tp_mod.gemm_into_fp32(device, torch.bfloat16) == "addmm"
    assert gemms == ([(1, 48)] if takes_gemm else [])


def test_gemm_probe_skips_ways_that_fail_or_are_wrong(monkeypatch):
    """A way this torch refuses (TypeError, as addmm without out_dtype), that computes something else, or
    that overwrites the fp32 tensor instead of adding into it (gradient accumulation would keep only the
    last microbatch) is not chosen; the 16-bit product then an add always works."""
    from megatron_mini import tensor_parallel as tp_mod

    def refuses(out, a, b):
        raise TypeError("addmm() got an unexpected keyword argument 'out_dtype'")

    def wrong(out, a, b):
        out.add_(1.0)

    monkeypatch.setitem(tp_mod.GEMM_INTO_FP32, "addmm", refuses)
    monkeypatch.setitem(tp_mod.GEMM_INTO_FP32, "mm", wrong)
    tp_mod.gemm_into_fp32.cache_clear()
    def overwrites(out, a, b):
        out.copy_(a.float() @ b.float())

    try:
        assert tp_mod.gemm_into_fp32("cpu", torch.bfloat16) == "cast"
        monkeypatch.setitem(tp_mod.GEMM_INTO_FP32, "mm", overwrites)
        tp_mod.gemm_into_fp32.cache_clear()
        assert tp_mod.gemm_into_fp32("cpu", torch.bfloat16) == "cast"
        monkeypatch.setitem(tp_mod.GEMM_INTO_FP32, "mm", tp_mod._mm_then_add)   # a correct "mm" is taken
        tp_mod.gemm_into_fp32.cache_clear()
        assert tp_mod.gemm_into_fp32("cpu", torch.bfloat16) == "mm"
    finally:
        tp_mod.gemm_into_fp32.cache_clear()
