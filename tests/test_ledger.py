"""The communication of one training step equals the analytic count for the layout.

A redundant (or missing) collective changes the ledger and fails these tests. Bytes are
those of the full tensor involved (see megatron_mini/comm.py).
"""
from collections import Counter

import pytest

from ranks import spawn
from harness import make_trainer, needs_triton, small_config

F32 = 4


def step_end(cfg) -> int:
    """The step-end all-reduce: each sample's loss (gbs), the ranks writing a checkpoint, the ranks whose own write
    failed, a stop count per signal (SIGTERM, SIGINT, SIGHUP, SIGUSR1) and one for the time limit."""
    return (cfg.gbs + 2 + 4 + 1) * F32


def _one_step_ledger(cfg):
    trainer = make_trainer(cfg)
    trainer.mesh.ledger.reset()
    trainer.train_step()
    return trainer.mesh.ledger.summary(), trainer.mesh.ledger.overlaps()


def _ledgers(world_size, cfg):
    """Each rank's ledger of one step, where no collective runs beside a GEMM."""
    ledgers = spawn(world_size, _one_step_ledger, cfg)
    assert all(not overlaps for _, overlaps in ledgers), ledgers
    return [ledger for ledger, _ in ledgers]


def _column_parallel_gemms(cfg, tp):
    """FLOPs of one backward GEMM (dx's, or dW's) of each column-parallel linear a microbatch runs, per rank:
    L qkv [h -> 3h/tp], L fc1 [h -> ffn/tp], the head's logits [h -> V/tp]."""
    m, tokens = cfg.model, cfg.model.seq_len * cfg.mbs
    return [(2 * tokens * m.hidden_size * 3 * m.hidden_size // tp, m.num_layers),
            (2 * tokens * m.hidden_size * m.ffn_hidden_size // tp, m.num_layers),
            (2 * tokens * m.hidden_size * m.padded_vocab_size // tp, 1)]


def test_dp2_step(small_data, tmp_path):
    cfg = small_config(small_data, tmp_path)
    ledger = _ledgers(2, cfg)[0]
    padded = cfg.model.num_params() + cfg.model.num_params() % 2   # one bucket, padded to a multiple of dp
    assert ledger == {("dp", "all_reduce"): (1, padded * F32),      # gradients, once per step
                      ("world", "all_reduce"): (1, step_end(cfg))}


def _tp_activation_bytes(cfg):
    return cfg.model.seq_len * cfg.mbs * cfg.model.hidden_size * F32


@pytest.mark.parametrize("kernels", ["torch", pytest.param("layer_norm", marks=needs_triton)])
def test_tp2_step(kernels, small_data, tmp_path):
    """With the Triton LayerNorm (autotuned per rank) the replicated parameters' gradients are averaged over TP
    once a step: one all-reduce of 2L+1 LayerNorms (w, b), 2L row-parallel biases and the positions."""
    cfg = small_config(small_data, tmp_path, tp=2, kernels=kernels, gbs=4)   # m = 2: per microbatch is not per step
    m, L, h = cfg.gbs // cfg.mbs, cfg.model.num_layers, cfg.model.hidden_size
    act, tokens = _tp_activation_bytes(cfg), cfg.model.seq_len * cfg.mbs * F32
    # per microbatch: forward g (embedding) + 2 g per block; backward 2 f per block + f (head)
    # and the cross entropy's two all-reduces: the max [s, b], then sum-exp and target logit [2, s, b]
    calls = m * (1 + 2 * L + 2 * L + 1 + 2)
    nbytes = m * ((1 + 4 * L + 1) * act + 3 * tokens)
    if kernels == "layer_norm":
        calls += 1
        nbytes += ((2 * L + 1) * 2 * h + 2 * L * h + cfg.model.seq_len * h) * F32
    # each backward f is fused into its linear: dx's all-reduce runs beside dW's GEMM
    beside = Counter()
    for flops, n in _column_parallel_gemms(cfg, 2):
        beside["tp", "all_reduce", act, flops] += m * n
    for ledger, overlaps in spawn(2, _one_step_ledger, cfg):
        assert ledger == {("tp", "all_reduce"): (calls, nbytes),
                          ("mp", "all_reduce"): (1, 2 * F32),           # grad norm and inf/nan check
                          ("world", "all_reduce"): (1, step_end(cfg))}
        assert overlaps == beside


def test_tp2_sp_step(small_data, tmp_path):
    cfg = small_config(small_data, tmp_path, tp=2, sp=True)
    m, L, h = cfg.gbs // cfg.mbs, cfg.model.num_layers, cfg.model.hidden_size
    act, tokens = _tp_activation_bytes(cfg), cfg.model.seq_len * cfg.mbs * F32
    # per microbatch, forward: RS (embedding), AG RS AG RS per block, AG (head); backward: the conjugates,
    # and each column-parallel linear's input (qkv, fc1, head: saved as a shard) gathered again
    per_kind, regathered = m * (4 * L + 2), m * (2 * L + 1)
    # sequence-parallel replicated params: 2L+1 LayerNorms (w, b), 2L row-parallel biases, positions
    sp_numel = (2 * L + 1) * 2 * h + 2 * L * h + cfg.model.seq_len * h
    # each re-gather runs beside dx's GEMM, and dx's reduce-scatter beside dW's
    beside = Counter()
    for flops, n in _column_parallel_gemms(cfg, 2):
        for op in ("all_gather", "reduce_scatter"):
            beside["tp", op, act, flops] += m * n
    for ledger, overlaps in spawn(2, _one_step_ledger, cfg):
        assert overlaps == beside
        assert ledger == {("tp", "all_gather"): (per_kind + regathered, (per_kind + regathered) * act),
                          ("tp", "reduce_scatter"): (per_kind, per_kind * act),
                          ("tp", "all_reduce"): (2 * m + 1, 3 * m * tokens + sp_numel * F32),
                          ("mp", "all_reduce"): (1, 2 * F32),
                          ("world", "all_reduce"): (1, step_end(cfg))}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_pp2_step(schedule, small_data, tmp_path):
    cfg = small_config(small_data, tmp_path, pp=2, schedule=schedule)
    m, act = cfg.gbs // cfg.mbs, _tp_activation_bytes(cfg)
    embedding = cfg.model.padded_vocab_size * cfg.model.hidden_size * F32
    for ledger in _ledgers(2, cfg):
        assert ledger == {("pp", "send"): (m, m * act),              # activations one way, gradients back
                          ("pp", "recv"): (m, m * act),
                          ("emb", "all_reduce"): (1, embedding),     # tied word-embedding gradient
                          ("mp", "all_reduce"): (1, 2 * F32),
                          ("world", "all_reduce"): (1, step_end(cfg))}


def _ledger_sizes(cfg):
    trainer = make_trainer(cfg)
    sizes = []
    for _ in range(3):
        trainer.train_step()
        trainer.evaluate()
        sizes.append((len(trainer.mesh.ledger.counts), sum(trainer.mesh.ledger.counts.values())))
    return sizes


def test_the_ledger_stays_the_same_size_over_a_run(small_data, tmp_path):
    """Training never resets the ledger: it must count kinds of call, not keep one record per call (which
    grew without bound, ~2,000 records a step at the design card's layout). Steps and evaluations after
    the first add calls but no new kind."""
    cfg = small_config(small_data, tmp_path, tp=2, pp=2, sp=True, gbs=8, eval_iters=1)
    for sizes in spawn(4, _ledger_sizes, cfg):
        kinds, calls = zip(*sizes)
        assert len(set(kinds)) == 1 and calls[0] < calls[1] < calls[2], sizes
