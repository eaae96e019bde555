"""One training step's gradients, on several layouts, against Hugging Face's GPT-2 in fp64 (an independent model).

ONE 4-rank spawn builds a Trainer per layout (tp x dp, tp x sp, tp x pp x sp; a vocabulary of 512 padded to 768,
so that tp=4's last shard is padding only), runs one step's forward and backward through the pipeline engine and
the optimizer's gradient sums (finalize_grads), and returns every rank's initial weights and fp32 main grads. The
test then builds GPT2LMHeadModel in fp64 from the same full initial weights, takes the mean token loss of the same
global batch (F.cross_entropy, label smoothing where the layout has it) and compares, slice by slice on every rank:

- the initial weights: each rank holds its TP slice of one full init (every parameter, the tied copy on the last
  stage included), bitwise;
- the main grads: the tied embedding's gradient summed from the lookup and the output layer (HF ties them), the
  sequence-parallel LayerNorm and bias gradients summed over TP once, DP averaged over the global batch; the
  padded vocabulary rows get exactly zero;
- the loss: padding never enters the softmax.

The same spawn checks which dropout masks the TP ranks share: the residual stream's without sp (the ranks hold the
same tokens), none with sp (each holds a shard), and never the attention probabilities' (each holds other heads).
"""
import os

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")

from harness import make_trainer, small_config  # noqa: E402
from ranks import spawn  # noqa: E402

WORLD = 4
MODEL = {"model.num_layers": 2, "model.vocab_pad_multiple": 384}      # 512 real rows padded to 768
LAYOUTS = {   # world 4 each: dp = 4 / (tp x pp)
    "tp1-dp4": dict(tp=1),
    "tp2-dp2": dict(tp=2),
    "tp4-sp-ls": dict(tp=4, sp=True, **{"model.label_smoothing": 0.1}),
    "tp2-pp2-vpp2-own-sp-ls": dict(tp=2, pp=2, vpp=2, embedding_stage="own", sp=True,
                                   **{"model.label_smoothing": 0.1}),      # [embedding], [block], [block], [head]
}
GRAD_TOL = 1e-5     # fp32 against fp64, relative to each gradient's largest entry


def _one_step(cfg) -> dict:
    """This rank's initial weights and main grads after one step's backward and gradient sums, {global name:
    tensor}, with its coordinates, the specs and its samples' summed token losses (the last stage's)."""
    from megatron_mini.dataset import first_sample, get_batch

    trainer = make_trainer(cfg)
    mesh = trainer.mesh
    params = {name: p for buf in trainer.buffers for p, name in buf.names.items()}
    weights = {name: p.detach().clone() for name, p in params.items()}
    batch = get_batch(trainer.train_data, 0, cfg.gbs, cfg.mbs, mesh.dp_rank, mesh.dp)
    tokens = cfg.gbs * cfg.model.seq_len
    losses = trainer.engine.train_step(batch, 1.0, tokens, first_sample(0, cfg.gbs, mesh.dp_rank, mesh.dp))
    trainer.optimizer.finalize_grads()
    return dict(coords=(mesh.tp_rank, mesh.dp_rank, mesh.pp_rank), weights=weights,
                grads={name: p.main_grad.clone() for name, p in params.items()},
                specs={name: (p.spec.tp_dim, p.spec.tp_groups) for name, p in params.items()},
                loss=losses.sum().item() if mesh.pp_rank == mesh.pp - 1 and mesh.tp_rank == 0 else 0.0)


def _dropout_masks(sp: bool) -> dict:
    """Under tp=2 x dp=2, every rank keyed to the same (sample, layer): the residual stream's dropout of a tensor of
    ones and the attention core's output for the same qkv, in training (p = 0.5)."""
    from megatron_mini.config import ModelConfig
    from megatron_mini.mesh import ParallelMesh
    from megatron_mini.model import Block, ParallelContext, initialize, GPTChunk
    from megatron_mini.rng import RNGTracker

    mesh, cpu = ParallelMesh(2, 1, 2), torch.device("cpu")
    m = ModelConfig(name="t", num_layers=1, hidden_size=64, num_heads=4, seq_len=16, vocab_size=64,
                    vocab_pad_multiple=64, dropout=0.5)
    ctx = ParallelContext(mesh.tp_group, RNGTracker(7, mesh.tp_rank, cpu), sp)
    block = Block(0, m, ctx, cpu)
    initialize([GPTChunk([block], ctx.rng)], mesh.tp_group, 1)
    block.train()
    ctx.rng.seed(0, block.index)
    hidden = block.dropout(torch.ones(m.seq_len // mesh.tp if sp else m.seq_len, 2, m.hidden_size))
    ctx.rng.seed(0, block.index)
    qkv = torch.randn(m.seq_len, 2, 3 * m.hidden_size // mesh.tp, generator=torch.Generator().manual_seed(3))
    attn = block.attn.core(qkv).detach()
    block.eval()
    return dict(tp_rank=mesh.tp_rank, hidden=hidden.detach(), attn=attn, attn_eval=block.attn.core(qkv).detach())


def _worker(cfgs: dict) -> dict:
    out = {name: _one_step(cfg) for name, cfg in cfgs.items()}
    out["dropout"] = {sp: _dropout_masks(sp) for sp in (False, True)}
    return out


@pytest.fixture(scope="module")
def results(small_data, tmp_path_factory):
    cfgs = {name: small_config(small_data, tmp_path_factory.mktemp(name), gbs=8, mbs=2, **MODEL, **overrides)
            for name, overrides in LAYOUTS.items()}
    return cfgs, spawn(WORLD, _worker, cfgs)


def _hf_reference(cfg) -> tuple:
    """(the full initial weights {global name: fp32 tensor}, the mean token loss and {global name: gradient} of
    GPT2LMHeadModel in fp64 on the step's global batch): gradients in megatron_mini's shapes, zero on the padded
    vocabulary rows."""
    from megatron_mini.dataset import get_batch, load_datasets
    from megatron_mini.hf import block_names
    from megatron_mini.model import ParallelContext, build_chunks

    m, cpu = cfg.model, torch.device("cpu")
    (chunk,) = build_chunks(m, ParallelContext.one_device(cpu, cfg.seed), [(0, m.num_layers + 2)], cfg.seed, cpu)
    init = {name: p.detach().clone() for name, p in chunk.named_global_parameters()}
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=m.vocab_size, n_positions=m.seq_len, n_embd=m.hidden_size, n_layer=m.num_layers,
        n_head=m.num_heads, n_inner=m.ffn_hidden_size, activation_function="gelu_new", layer_norm_epsilon=m.ln_eps,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
        attn_implementation="eager"))
    names = [("transformer.wte.weight", "embedding.word_embeddings.weight", False),
             ("transformer.wpe.weight", "embedding.position_embeddings", False),
             ("transformer.ln_f.weight", "head.ln_f.weight", False), ("transformer.ln_f.bias", "head.ln_f.bias", False)]
    names += [(f"transformer.h.{i}.{theirs}", f"blocks.{i}.{ours}", t)
              for i in range(m.num_layers) for theirs, ours, _, t in block_names(m.hidden_size, m.ffn_hidden_size)]
    hf_params = dict(hf.named_parameters())
    assert {theirs for theirs, _, _ in names} == set(hf_params), "every GPT-2 parameter mapped, lm_head tied"
    with torch.no_grad():
        for theirs, ours, t in names:
            w = init[ours][:m.vocab_size] if ours.startswith("embedding.word") else init[ours]
            hf_params[theirs].copy_(w.t() if t else w)
    hf.double()
    (tokens,) = get_batch(load_datasets(cfg.data, m.seq_len, cfg.seed, m.vocab_size)[0], 0, cfg.gbs, cfg.gbs, 0, 1)
    logits = hf(tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), label_smoothing=m.label_smoothing)
    loss.backward()
    grads = {}
    for theirs, ours, t in names:
        g = hf_params[theirs].grad
        grads[ours] = g.t() if t else g
    wte = grads["embedding.word_embeddings.weight"]
    grads["embedding.word_embeddings.weight"] = torch.cat([wte, wte.new_zeros(m.padded_vocab_size - m.vocab_size,
                                                                                m.hidden_size)])
    return init, loss.item(), grads


def _slice(full: torch.Tensor, tp_dim, groups: int, tp: int, tp_rank: int) -> torch.Tensor:
    """TP rank `tp_rank`'s part of `full`: `groups` blocks along tp_dim (q, k, v), each cut in tp pieces."""
    if tp_dim is None:
        return full
    return torch.cat([b.chunk(tp, tp_dim)[tp_rank] for b in full.chunk(groups, tp_dim)], tp_dim)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_step_matches_hugging_face_gpt2_in_fp64(results, layout):
    """Every rank's initial weights are its slice of the full init (bitwise); its fp32 main grads after the step's
    gradient sums are its slice of GPT-2's fp64 gradients (5.7e-7 at most measured, relative), zero on padded rows;
    the mean token loss is GPT-2's to 1e-6 (5e-8 measured)."""
    cfgs, ranks = results
    cfg = cfgs[layout]
    init, ref_loss, ref = _hf_reference(cfg)
    loss = sum(r[layout]["loss"] for r in ranks) / (cfg.gbs * cfg.model.seq_len)
    assert abs(loss - ref_loss) <= 1e-6 * ref_loss, (loss, ref_loss)
    vocab, seen = cfg.model.vocab_size, set()
    for rank, r in enumerate(ranks):
        r = r[layout]
        tp_rank = r["coords"][0]
        for name, g in r["grads"].items():
            seen.add(name)
            tp_dim, groups = r["specs"][name]
            assert torch.equal(r["weights"][name], _slice(init[name], tp_dim, groups, cfg.tp, tp_rank)), \
                f"{layout}, rank {rank}: {name}'s initial weights are not its slice of the full init"
            expected = _slice(ref[name], tp_dim, groups, cfg.tp, tp_rank)
            err = ((g.double() - expected).abs().max() / ref[name].abs().max()).item()
            assert err <= GRAD_TOL, f"{layout}, rank {rank}: {name}'s gradient differs by {err:.2e} (relative)"
            if name == "embedding.word_embeddings.weight":
                rows = torch.arange(len(g)) + tp_rank * len(g)
                assert not g[rows >= vocab].any(), f"{layout}, rank {rank}: padded vocabulary rows got gradient"
    assert seen == set(ref), f"{layout}: parameters held by no rank: {set(ref) - seen}"


def test_dropout_masks_shared_by_tp_ranks_where_they_hold_the_same_tensor(results):
    """At tp=2 x dp=2 with one key: the residual stream's mask without sp is the same on all four ranks (the TP
    ranks' copies of the residual stream must stay equal); with sp each TP rank's sequence shard draws its own
    (ranks of one tp_rank draw alike); the attention probabilities' masks differ between TP ranks' heads, with or
    without sp."""
    _, ranks = results
    for sp in (False, True):
        rows = [r["dropout"][sp] for r in ranks]
        assert 0 < (rows[0]["hidden"] == 0).float().mean() < 1, "no residual dropout"
        assert not torch.equal(rows[0]["attn"], rows[0]["attn_eval"]), "no attention dropout"
        for what in ("hidden", "attn"):
            first = {t: next(row[what] for row in rows if row["tp_rank"] == t) for t in (0, 1)}
            for rank, row in enumerate(rows):
                assert torch.equal(row[what], first[row["tp_rank"]]), f"sp={sp}: rank {rank}'s {what} mask differs " \
                                                                      "from its DP peer's"
            shared, same = what == "hidden" and not sp, torch.equal(first[0], first[1])
            assert same == shared, f"sp={sp}: the TP ranks' {what} masks {'differ' if shared else 'are the same'}"
