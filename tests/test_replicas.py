"""replicas.py: the hash of a parameter's bits, and the check that copies held by several ranks are equal."""
from __future__ import annotations

import pytest
import torch

from harness import make_trainer, needs_triton, replace, small_config, train_on_ranks
from ranks import spawn
from megatron_mini import replicas


def _reference(t: torch.Tensor, chunk: int) -> int:
    """The module doc's hash in Python's exact integers (chunks of `chunk` 16-bit values)."""
    P, A = replicas.P, replicas.A

    def w(j):
        return ((j + 1) * A % P) ** 2 % P + 1
    bits = t.reshape(-1).view(torch.int16).tolist()
    chunks = [bits[lo:lo + chunk] for lo in range(0, len(bits), chunk)]
    return sum(sum(b * w(j) for j, b in enumerate(c)) % P * w(k) for k, c in enumerate(chunks)) % P


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_hash_is_the_formula_and_any_one_bit_changes_it(dtype, monkeypatch):
    """Chunked (CHUNK = 7 here) as a whole: equal to the exact-integer formula, for negative values (negative
    integer bits) too; one bit flipped in any element, or two unequal elements swapped, changes it, and so do an
    fp32 element whose integer bits moved by P (1.0 -> -1.0000001 and -1.0 -> 0.99999994, which a hash of the
    32-bit integers mod P missed) and +0.0 -> -0.0."""
    monkeypatch.setattr(replicas, "CHUNK", 7)
    weights = replicas.weight(torch.arange(7))

    def fingerprint(t):
        return replicas.fingerprint(t, weights).item()
    x = (torch.randn(5, 9, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    h = fingerprint(x)
    assert h == _reference(x, 7)
    assert fingerprint(x.clone()) == h
    ints = x.view(replicas._INTS[x.element_size()]).reshape(-1)
    for i in range(x.numel()):
        for bit in (0, 7, 15, x.element_size() * 8 - 1):    # the lowest (one unit in the last place), ..., the sign
            y = ints.clone()
            y[i] ^= (1 << bit) if bit < x.element_size() * 8 - 1 else -(1 << bit)
            assert fingerprint(y.view(dtype)) != h, (i, bit)
    swapped = x.reshape(-1).clone()
    swapped[[3, 40]] = swapped[[40, 3]]
    assert fingerprint(swapped) != h
    zero = torch.zeros(9, dtype=dtype)
    signed = zero.clone()
    signed[4] = -0.0
    assert fingerprint(signed) != fingerprint(zero)
    if dtype == torch.float32:
        for base, other in ((1.0, -1.0000001), (-1.0, 0.99999994)):
            x, y = torch.full((9,), base), torch.full((9,), base)
            y[4] = other
            assert abs(int(y.view(torch.int32)[4]) - int(x.view(torch.int32)[4])) == replicas.P
            assert fingerprint(y) != fingerprint(x), other


def _perturbed_checks(cfg, cases):
    """Per case (rank, name, how): this rank's RunError (message, reporter) from Trainer.check_replicas (None where
    it passed) after `rank` changed the first element of tensor `name` (a parameter, or "<name> (fp32 master)":
    its optimizer's master), and what it changed there (None on the other ranks): "ulp" moves it up by one unit in
    the last place (the unit), "sign" turns a 0 into -0.0 (every rank first sets +0.0; 0)."""
    import math

    from megatron_mini.config import RunError
    from megatron_mini.replicas import shared
    trainer = make_trainer(cfg)
    for _ in range(2):
        trainer.train_step()
    tensors = {name: t for _, ts in shared(trainer.buffers, trainer.optimizer, trainer.mesh) for name, t in ts.items()}
    out = []
    for rank, name, how in [(None, None, None)] + cases:
        t = tensors.get(name)
        kept = t.detach().clone() if t is not None else None
        unit = None
        with torch.no_grad():
            first = t.view(-1)[:1] if t is not None else None
            if how == "sign":
                first.fill_(0.0)
            if trainer.mesh.rank == rank:
                moved = torch.nextafter(first, torch.full_like(first, math.inf)) if how == "ulp" else -first
                unit = (moved - first).item()
                first.copy_(moved)
        try:
            trainer.check_replicas()
            out.append((None, unit))
        except RunError as e:
            out.append(((str(e), e.reporter), unit))
        trainer.failure = None
        if kept is not None:
            with torch.no_grad():
                t.copy_(kept)
    return out


def test_every_rank_stops_on_a_copy_that_differs(small_data, tmp_path):
    """tp = dp = pp = 2 after two steps (ranks tp fastest, then dp, then pp: 0-3 the first stage, 4-7 the last):
    every copy agrees; then one element moved by one ulp on one rank stops every rank with the same message, the
    first finder's, naming the parameter, the group, which ranks hold which copy, and by how much they differ. A
    LayerNorm weight (replicated over TP) on rank 1 differs from rank 0's (TP); a TP shard on rank 6 from rank 4's
    (DP); the output layer's copy of the word embedding on rank 5 from rank 1's (embedding group). The counts of
    shared tensors: 4 blocks x 6 replicated (2 LayerNorms, 2 row-parallel biases) + positions over TP on the first
    stage; 4 blocks x 12 + the final LayerNorm's 2 + the word embedding's copy over DP on the last."""
    cfg = small_config(small_data, tmp_path, tp=2, pp=2, zero=1, steps=2)
    ln, shard, word = "blocks.1.ln1.weight", "blocks.6.mlp.fc1.weight", "embedding.word_embeddings.weight"
    results = spawn(8, _perturbed_checks, cfg, [(1, ln, "ulp"), (6, shard, "ulp"), (5, word, "ulp")])
    found = [[check for check, _ in r] for r in results]
    assert all(f == found[0] for f in found), found
    units = [results[rank][case][1] for case, rank in enumerate((1, 6, 5), start=1)]    # where each case moved
    assert found[0][0] is None
    for ((message, reporter), first, text), unit in zip([
            (found[0][1], 0, f"the TP group (ranks 0, 1) holds 1 of its 25 shared tensors differently: {ln} "
                             "(1 of 64 elements, by up to "),
            (found[0][2], 4, f"the DP group (ranks 4, 6) holds 1 of its 51 shared tensors differently: {shard} "
                             "(1 of 8192 elements, by up to "),
            (found[0][3], 1, f"the embedding group (ranks 1, 5) holds 1 of its 1 shared tensor differently: {word} "
                             "(1 of 16384 elements, by up to ")], units):
        # (the first rank that found a difference reports what it found: rank 1's DP group is not named for ln)
        assert reporter == first, message
        assert message.startswith(f"rank {first} found copies of the weights that differ between ranks: "), message
        assert text + f"{unit:.3g}; copies held by ranks " in message, message
        assert message.count(" differently: ") == 1, message


def test_the_fp32_masters_and_a_signed_zero_are_checked_too(small_data, tmp_path):
    """bf16 weights at tp = 2 (ranks 0 and 1): rank 1's fp32 master of a LayerNorm weight moved by one fp32 ulp, which
    no bf16 weight shows yet (a drifting gradient moves the masters first), stops both ranks, naming the master; a
    weight that is +0.0 on rank 0 and -0.0 on rank 1 is one element that differs, by 0. The TP group shares 102
    tensors: 8 blocks x 6 replicated parameters + positions + the final LayerNorm's 2, and their masters."""
    cfg = small_config(small_data, tmp_path, tp=2, steps=2, **{"precision.dtype": "bf16"})
    master, bias = "blocks.1.ln1.weight (fp32 master)", "blocks.2.attn.proj.bias"
    results = spawn(2, _perturbed_checks, cfg, [(1, master, "ulp"), (1, bias, "sign")])
    assert [check for check, _ in results[0]] == [check for check, _ in results[1]], results
    (passed, _), ((on_master, reporter), _), ((on_bias, _), _) = results[0]
    unit = results[1][1][1]
    assert passed is None and reporter == 0
    assert (f"the TP group (ranks 0, 1) holds 1 of its 102 shared tensors differently: {master} (1 of 64 elements, "
            f"by up to {unit:.3g}; copies held by ranks 0 | 1)") in on_master, on_master
    assert (f"holds 1 of its 102 shared tensors differently: {bias} (1 of 64 elements, by up to 0; copies held by "
            "ranks 0 | 1)") in on_bias, on_bias


def _train_with_other_tiles_on_rank_1(cfg, average):
    """train(cfg) with rank 1's Triton LayerNorm (the interpreter's launch) on row tiles of half the height, as a
    rank that autotuned another config: its sums run in another order. `average`: the optimizer averages the
    replicated gradients over TP (rank.build_rank asks it to where the Triton LayerNorm runs at tp > 1 without sp).
    Returns the losses, or the RunError's message."""
    import os

    from megatron_mini import rank
    from megatron_mini.config import RunError
    from megatron_mini.optimizer import Optimizer
    from megatron_mini.kernels import layernorm
    from megatron_mini.training import train
    if os.environ["RANK"] == "1":
        rule = layernorm.interpreter_block_m
        layernorm.interpreter_block_m = lambda n_rows, block_n: max(1, rule(n_rows, block_n) // 2)
    if not average:
        rank.Optimizer = lambda *args, **kwargs: Optimizer(*args, **{**kwargs, "average_replicated": False})
    try:
        return train(cfg)["loss"]
    except RunError as e:
        return str(e)


@needs_triton
def test_tp_ranks_whose_layer_norm_rounds_otherwise_keep_equal_copies(small_data, tmp_path):
    """kernels=layer_norm at tp = 2 without sp, rank 1's LayerNorm on other tiles (a GPU's per-rank autotuning, on
    this CPU): its LayerNorm gradients, and through its dx every replicated parameter's, round otherwise than rank
    0's; the replicas drift apart in the first step and the check after it stops the run. Averaged over TP they stay
    equal, and the run trains as with equal tiles (within fp32 rounding)."""
    # (2 microbatches a step, not 8: each LayerNorm runs in Triton's interpreter, the test's cost)
    cfg = small_config(small_data, tmp_path / "a", tp=2, kernels="layer_norm", steps=2, replica_check_interval=1,
                       gbs=4, **{"model.num_layers": 1})
    drifted = spawn(2, _train_with_other_tiles_on_rank_1, cfg, False, init_group=False)[0]
    assert isinstance(drifted, str) and drifted.startswith(
        "rank 0 found copies of the weights that differ between ranks: the TP group (ranks 0, 1) holds "), drifted
    averaged = spawn(2, _train_with_other_tiles_on_rank_1, replace(cfg, run_dir=str(tmp_path / "b")), True,
                     init_group=False)[0]
    same = train_on_ranks(2, replace(cfg, run_dir=str(tmp_path / "c")))["loss"]
    assert torch.allclose(torch.tensor(averaged), torch.tensor(same), rtol=1e-6, atol=0), (averaged, same)


def _train_with_own_triton_cache(cfg, cache_root):
    """train(cfg) on this rank with a Triton cache of its own (as on a node of its own, or in a first run), so that
    each rank times its kernels' configs itself."""
    import os

    from megatron_mini.training import train
    os.environ["TRITON_CACHE_DIR"] = os.path.join(cache_root, f"rank{os.environ['RANK']}")
    return train(cfg)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels autotune on a GPU only (the "
                    "interpreter runs one config)")
def test_the_triton_layer_norm_keeps_the_tp_copies_equal_on_a_gpu(small_data, tmp_path):
    """kernels=triton at tp = 2 without sp, two ranks on one GPU, each autotuning the LayerNorm on its own: every TP
    rank computes the replicated LayerNorm and its gradients, so a config chosen otherwise on one rank (the order
    of its sums) would drift the copies apart without the average over TP (the test above, on this CPU), and the
    check after every step would stop the run."""
    cfg = small_config(small_data, tmp_path / "run", tp=2, kernels="triton", device="cuda", steps=6,
                       replica_check_interval=1, **{"precision.dtype": "bf16"})
    spawn(2, _train_with_own_triton_cache, cfg, str(tmp_path / "triton"), init_group=False)
