"""ZeRO-1 and activation recomputation change memory, not the model being trained."""
import os

import pytest
import torch

from harness import assert_same_training, final_weights, small_config, train_on_ranks


@pytest.mark.parametrize("dp", [2, 4])
def test_zero1_matches_plain_dp(dp, small_data, tmp_path):
    plain = train_on_ranks(dp, small_config(small_data, tmp_path / "plain", steps=10))
    zero = train_on_ranks(dp, small_config(small_data, tmp_path / "zero", steps=10, zero=1))
    assert_same_training(plain, zero, rtol=1e-6, wtol=1e-6)


def test_zero1_composes_with_tp_pp(small_data, tmp_path):
    single = train_on_ranks(1, small_config(small_data, tmp_path / "single", steps=10))
    zero = train_on_ranks(8, small_config(small_data, tmp_path / "zero", steps=10, tp=2, pp=2, sp=True, zero=1))
    assert_same_training(single, zero)


def test_zero1_checkpoint_resumes_without_zero(small_data, tmp_path):
    full = train_on_ranks(2, small_config(small_data, tmp_path / "zero", steps=10, save_interval=5, zero=1))
    step5 = os.path.join(full["checkpoint"], "..", "step_000005")
    resumed = train_on_ranks(2, small_config(small_data, tmp_path / "plain", steps=10, resume=step5))
    assert torch.allclose(torch.tensor(full["loss"][5:]), torch.tensor(resumed["loss"]), rtol=1e-6, atol=0)
    for name, w in final_weights(full).items():
        assert torch.allclose(w, final_weights(resumed)[name], rtol=0, atol=1e-6), name


RECOMPUTE_RUN = dict(steps=6, **{"model.dropout": 0.1})
RECOMPUTE_LAYOUTS = {"tp1": {}, "tp2-sp": dict(tp=2, sp=True)}   # dropout on the default stream at tp=1


@pytest.fixture(scope="module")
def without_recompute(small_data, tmp_path_factory):
    """{layout: history} of the runs without recompute (each computed on first use)."""
    runs = {}

    def get(layout):
        if layout not in runs:
            kw = RECOMPUTE_LAYOUTS[layout]
            runs[layout] = train_on_ranks(kw.get("tp", 1), small_config(small_data, tmp_path_factory.mktemp(layout),
                                                                         **RECOMPUTE_RUN, **kw))
        return runs[layout]
    return get


@pytest.mark.parametrize("layout", RECOMPUTE_LAYOUTS)
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_gives_the_same_training(recompute, layout, small_data, tmp_path, without_recompute):
    """Bitwise the same, with dropout on: recomputation replays the same dropout masks."""
    kw = RECOMPUTE_LAYOUTS[layout]
    none = without_recompute(layout)
    again = train_on_ranks(kw.get("tp", 1), small_config(small_data, tmp_path / recompute, recompute=recompute,
                                                         **RECOMPUTE_RUN, **kw))
    assert none["loss"] == again["loss"] and none["grad_norm"] == again["grad_norm"]
    assert_same_training(none, again, rtol=0, wtol=0)


def _optimizer_bytes(cfg):
    from harness import make_trainer
    return make_trainer(cfg).optimizer.memory_bytes()


def test_zero1_divides_optimizer_state_by_dp(small_data, tmp_path):
    from ranks import spawn

    plain = spawn(1, _optimizer_bytes, small_config(small_data, tmp_path))[0]
    for dp in (2, 4):
        sharded = spawn(dp, _optimizer_bytes, small_config(small_data, tmp_path, zero=1))
        for rank in sharded:
            # Adam moments (fp32 master = the weights in fp32): 8 bytes/param / dp, up to bucket padding
            assert abs(rank["optimizer"] * dp - plain["optimizer"]) <= 8 * dp * 4, (dp, rank, plain)


def test_zero1_each_layer_waits_for_its_own_weights(monkeypatch):
    """After a ZeRO-1 step the weight all-gathers run while the next forward does: all are launched at once,
    the buckets the forward uses first launched first; a layer's forward starts only after the gathers of
    every bucket holding one of its parameters, and no gather is waited for earlier than the layer before
    the first that uses it (so the later ones overlap the earlier layers). On the meta device over a
    virtual dp=2 group (records, moves nothing), with small buckets that cut across layers."""
    from megatron_mini import comm
    from megatron_mini.config import ModelConfig
    from megatron_mini.data_parallel import GradBuffer
    from megatron_mini.mesh import ParallelMesh
    from megatron_mini.model import ParallelContext, build_chunks

    meta = torch.device("meta")
    model = ModelConfig(num_layers=3, hidden_size=32, num_heads=2, seq_len=8, vocab_size=96)
    (chunk,) = build_chunks(model, ParallelContext.one_device(meta), [(0, 5)], 1, meta)
    mesh = ParallelMesh(1, 1, 2, virtual_rank=0)
    buf = GradBuffer(list(chunk.named_global_parameters()), mesh, torch.float32, zero=True, bucket_numel=3000)
    buf.wait_before(chunk.param_users())
    events = []
    for i, layer in enumerate(chunk.layers):
        layer.register_forward_pre_hook(lambda module, args, i=i: events.append(("forward", i)))
    monkeypatch.setattr(comm.Work, "wait", lambda self: events.append(("wait", id(self))))
    mesh.ledger.reset()
    buf.start_param_gather()
    index = {id(b.gather): k for k, b in enumerate(buf.buckets)}        # a bucket by its gather's handle
    assert len(index) == len(buf.buckets) > len(chunk.layers)
    assert mesh.ledger.summary() == {("dp", "all_gather"): (len(buf.buckets), buf.params_flat.nbytes)}
    users = [{k for k, b in enumerate(buf.buckets) if any(p is q for p in layer.parameters() for q in b.params)}
             for layer in chunk.layers]
    assert users[-1] & users[0]                                          # the tied word embedding
    first_user = {k: min(i for i, u in enumerate(users) if k in u) for k in range(len(buf.buckets))}
    assert sorted(first_user.values()) == [first_user[k] for k in reversed(range(len(buf.buckets)))]  # launch order

    ids = torch.empty(2, 8, dtype=torch.long, device=meta)
    chunk(ids, ids)
    events = [("wait", index[e[1]]) if e[0] == "wait" else e for e in events]
    assert sorted(k for what, k in events if what == "wait") == list(range(len(buf.buckets)))  # each once
    at = {e: n for n, e in enumerate(events)}
    for i, used in enumerate(users):
        for k in used:                                                   # before its users...
            assert at[("wait", k)] < at[("forward", i)], (k, i, events)
    for k, i in first_user.items():                                      # ...and not before it must
        if i > 0:
            assert at[("wait", k)] > at[("forward", i - 1)], (k, i, events)
    assert all(b.gather is None and b.gather_in is None for b in buf.buckets)


def _train_with_late_gathers(cfg):
    """Train with ZeRO-1's weight all-gathers held back until they are waited for, and the weights they
    write filled with NaN meanwhile: a weight read before its wait poisons the run."""
    from megatron_mini import comm
    from megatron_mini.training import train

    run = comm._run

    class Late:
        def __init__(self, args):
            self.args = args

        def wait(self):
            run(*self.args)

    def late(group, name, nbytes, fn, *args, async_op=False, **kwargs):
        if async_op and group.name == "dp" and name == "all_gather":
            args[0].fill_(float("nan"))
            return Late((group, name, nbytes, fn, *args))
        return run(group, name, nbytes, fn, *args, async_op=async_op, **kwargs)

    comm._run = late
    return train(cfg)


def test_zero1_reads_no_weight_before_its_gather(small_data, tmp_path):
    """Forward (training, evaluation), checkpoints and resume all wait for the weights they read: with the
    gathers held back and their output poisoned until waited for, dp=2 x pp=2 ZeRO-1 (an evaluation every 4
    steps, a checkpoint every 3, then a resume from step 6) trains like one process."""
    from ranks import spawn

    kw = dict(steps=8, eval_interval=4, save_interval=3)
    single = train_on_ranks(1, small_config(small_data, tmp_path / "single", **kw))
    cfg = small_config(small_data, tmp_path / "zero", pp=2, zero=1, **kw)
    late = spawn(4, _train_with_late_gathers, cfg, init_group=False)[0]
    assert_same_training(single, late)
    assert [s for s, _ in late["val_loss"]] == [0, 4, 8] == [s for s, _ in single["val_loss"]]
    assert [v for _, v in late["val_loss"]] == pytest.approx([v for _, v in single["val_loss"]], rel=1e-5)
    step6 = os.path.join(late["checkpoint"], "..", "step_000006")
    resumed = spawn(4, _train_with_late_gathers, small_config(small_data, tmp_path / "resumed", pp=2, zero=1,
                                                              resume=step6, **kw), init_group=False)[0]
    assert torch.allclose(torch.tensor(late["loss"][6:]), torch.tensor(resumed["loss"]), rtol=1e-6, atol=0)
    for name, w in final_weights(late).items():
        assert torch.allclose(w, final_weights(resumed)[name], rtol=0, atol=1e-6), name
