"""replicas.py: the hash of a parameter's bits, and the check that copies held by several ranks are equal."""
from __future__ import annotations

import pytest
import torch

from harness import make_trainer, small_config
from ranks import spawn
from megatron_mini import replicas


def _reference(t: torch.Tensor) -> int:
    """The module doc's hash in Python's exact integers."""
    ints = {2: torch.int16, 4: torch.int32}[t.element_size()]
    bits = t.reshape(-1).view(ints).tolist()
    return sum(b * ((i * replicas.A % replicas.P) ** 2 % replicas.P + 1) for i, b in enumerate(bits)) % replicas.P


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_hash_is_the_formula_and_any_one_bit_changes_it(dtype, monkeypatch):
    """Chunked (CHUNK = 7 here) as a whole: equal to the exact-integer formula, for negative values (negative
    integer bits) too; one bit flipped in any element, or two unequal elements swapped, changes it."""
    monkeypatch.setattr(replicas, "CHUNK", 7)
    x = (torch.randn(5, 9, generator=torch.Generator().manual_seed(0)) * 100).to(dtype)
    h = replicas.fingerprint(x).item()
    assert h == _reference(x)
    assert replicas.fingerprint(x.clone()).item() == h
    ints = x.view({2: torch.int16, 4: torch.int32}[x.element_size()]).reshape(-1)
    for i in range(x.numel()):
        for bit in (0, 7, x.element_size() * 8 - 1):          # the lowest (one unit in the last place), the sign
            y = ints.clone()
            y[i] ^= (1 << bit) if bit < x.element_size() * 8 - 1 else -(1 << bit)
            assert replicas.fingerprint(y.view(dtype)).item() != h, (i, bit)
    swapped = x.reshape(-1).clone()
    swapped[[3, 40]] = swapped[[40, 3]]
    assert replicas.fingerprint(swapped).item() != h


def _perturbed_checks(cfg, cases):
    """Per case (rank, parameter name): this rank's RunError (message, reporter) from Trainer.check_replicas after
    `rank` moved that parameter's first element up by one unit in the last place (None where the check passed),
    and the unit on that rank (None on the others)."""
    import math

    from megatron_mini.config import RunError
    trainer = make_trainer(cfg)
    for _ in range(2):
        trainer.train_step()
    params = {name: p for buf in trainer.buffers for p, name in buf.names.items()}
    out = []
    for rank, name in [(None, None)] + cases:
        p = params.get(name)
        kept = p.detach().clone() if p is not None else None
        unit = None
        if trainer.mesh.rank == rank:
            with torch.no_grad():
                first = p.view(-1)[:1]
                moved = torch.nextafter(first, torch.full_like(first, math.inf))
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
                p.copy_(kept)
    return out


def test_every_rank_stops_on_a_copy_that_differs(small_data, tmp_path):
    """tp = dp = pp = 2 after two steps (ranks tp fastest, then dp, then pp: 0-3 the first stage, 4-7 the last):
    every copy agrees; then one element moved by one ulp on one rank stops every rank with the same message, the
    first finder's, naming the parameter, the group, which ranks hold which copy, and by how much they differ. A
    LayerNorm weight (replicated over TP) on rank 1 differs from rank 0's (TP); a TP shard on rank 6 from rank 4's
    (DP); the output layer's copy of the word embedding on rank 5 from rank 1's (embedding group). The counts of
    shared parameters: 4 blocks x 6 replicated (2 LayerNorms, 2 row-parallel biases) + positions over TP on the first
    stage; 4 blocks x 12 + the final LayerNorm's 2 + the word embedding's copy over DP on the last."""
    cfg = small_config(small_data, tmp_path, tp=2, pp=2, zero=1, steps=2)
    ln, shard, word = "blocks.1.ln1.weight", "blocks.6.mlp.fc1.weight", "embedding.word_embeddings.weight"
    results = spawn(8, _perturbed_checks, cfg, [(1, ln), (6, shard), (5, word)])
    found = [[check for check, _ in r] for r in results]
    assert all(f == found[0] for f in found), found
    units = [results[rank][case][1] for case, rank in enumerate((1, 6, 5), start=1)]    # where each case moved
    assert found[0][0] is None
    for ((message, reporter), first, text), unit in zip([
            (found[0][1], 0, f"the TP group (ranks 0, 1) holds 1 of its 25 shared parameters differently: {ln} "
                             "(1 of 64 elements, by up to "),
            (found[0][2], 4, f"the DP group (ranks 4, 6) holds 1 of its 51 shared parameters differently: {shard} "
                             "(1 of 8192 elements, by up to "),
            (found[0][3], 1, f"the embedding group (ranks 1, 5) holds 1 of its 1 shared parameter differently: {word} "
                             "(1 of 16384 elements, by up to ")], units):
        # (the first rank that found a difference reports what it found: rank 1's DP group is not named for ln)
        assert reporter == first, message
        assert message.startswith(f"rank {first} found copies of the weights that differ between ranks: "), message
        assert text + f"{unit:.3g}; copies held by ranks " in message, message
        assert message.count(" differently: ") == 1, message


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
    of its sums) would drift the copies apart, and the check after every step would stop the run."""
    cfg = small_config(small_data, tmp_path / "run", tp=2, kernels="triton", device="cuda", steps=6,
                       replica_check_interval=1, **{"precision.dtype": "bf16"})
    spawn(2, _train_with_own_triton_cache, cfg, str(tmp_path / "triton"), init_group=False)
