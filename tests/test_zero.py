"""ZeRO-1 and activation recomputation change memory, not the model being trained."""
import math
import os

import pytest
import torch

from harness import assert_same_training, final_weights, small_config, train_on_ranks

SMALL_BUCKETS = 3000      # ddp_bucket_numel of the tests that cut the test model into many buckets (default 1M: one)


@pytest.mark.parametrize("dp", [2, 4])
def test_zero1_matches_plain_dp(dp, small_data, tmp_path):
    plain = train_on_ranks(dp, small_config(small_data, tmp_path / "plain", steps=10))
    zero = train_on_ranks(dp, small_config(small_data, tmp_path / "zero", steps=10, zero=1))
    assert_same_training(plain, zero, rtol=1e-6, wtol=1e-6)


def test_zero1_composes_with_tp_pp(small_data, tmp_path):
    blocks = {"model.num_layers": 4}          # (2 a stage: what ZeRO-1 shards does not depend on the depth)
    single = train_on_ranks(1, small_config(small_data, tmp_path / "single", steps=10, **blocks))
    zero = train_on_ranks(8, small_config(small_data, tmp_path / "zero", steps=10, tp=2, pp=2, sp=True, zero=1,
                                          **blocks))
    assert_same_training(single, zero)


def test_zero1_checkpoint_resumes_without_zero(small_data, tmp_path):
    full = train_on_ranks(2, small_config(small_data, tmp_path / "zero", steps=10, save_interval=5, zero=1))
    step5 = os.path.join(full["checkpoint"], "..", "step_000005")
    resumed = train_on_ranks(2, small_config(small_data, tmp_path / "plain", steps=10, resume=step5))
    assert torch.allclose(torch.tensor(full["loss"][5:]), torch.tensor(resumed["loss"]), rtol=1e-6, atol=0)
    for name, w in final_weights(full).items():
        assert torch.allclose(w, final_weights(resumed)[name], rtol=0, atol=1e-6), name


def _optimizer_pieces(checkpoint: str) -> set:
    """{(name, lo, hi)}: the flat ranges of the parameters' optimizer state that a checkpoint's files hold."""
    import json
    with open(os.path.join(checkpoint, "meta.json")) as f:
        shards = json.load(f)["shards"]
    return {(name, lo, hi) for shard in shards.values() for name, (lo, hi) in shard.get("ranges", {}).items()}


IN_SMALL_BUCKETS = dict(steps=6, gbs=12, zero=1)        # (gbs: whole microbatches of mbs=2 at dp=2 and dp=3)


@pytest.fixture(scope="module")
def zero1_in_small_buckets(small_data, tmp_path_factory):
    """IN_SMALL_BUCKETS at dp=2 in buckets of SMALL_BUCKETS elements, saving at step 3 (and at the end)."""
    return train_on_ranks(2, small_config(small_data, tmp_path_factory.mktemp("small-buckets"), save_interval=3,
                                          ddp_bucket_numel=SMALL_BUCKETS, **IN_SMALL_BUCKETS))


@pytest.mark.parametrize("world, buckets", [(3, 5000), (2, 1_000_000)], ids=["dp3-buckets-5000", "dp2-one-bucket"])
def test_zero1_resumes_in_other_buckets(world, buckets, zero1_in_small_buckets, small_data, tmp_path):
    """ddp_bucket_numel moves ZeRO-1's shards (each bucket is cut into dp shards, so where the buckets end is where
    the shards do), but a checkpoint keeps each parameter's Adam state and weights by global name, whatever bucket
    and shard held them: a dp=2 ZeRO-1 run in buckets of SMALL_BUCKETS elements, resumed from step 3 in other
    buckets (at dp=3 padded and cut mid-parameter elsewhere; at dp=2 the default's one bucket), continues the
    uninterrupted run (losses and final weights to fp32 rounding), and its checkpoint's shards are cut elsewhere."""
    full = zero1_in_small_buckets
    step3 = os.path.join(full["checkpoint"], "..", "step_000003")
    resumed = train_on_ranks(world, small_config(small_data, tmp_path, resume=step3, ddp_bucket_numel=buckets,
                                                 **IN_SMALL_BUCKETS))
    assert torch.allclose(torch.tensor(full["loss"][3:]), torch.tensor(resumed["loss"]), rtol=1e-6, atol=0)
    weights = final_weights(resumed)
    for name, w in final_weights(full).items():
        assert torch.allclose(w, weights[name], rtol=0, atol=1e-6), name
    assert _optimizer_pieces(full["checkpoint"]) != _optimizer_pieces(resumed["checkpoint"])


RECOMPUTE_RUN = dict(steps=3, **{"model.dropout": 0.1})   # (a mask replayed wrong differs from step 1)
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


def _reduce_scatter_outputs(cfg):
    """Where each reduce-scatter of one step's gradient sync writes, as (element offset into the buffer's
    grads_flat, or None for another tensor; elements), beside the buffer's valid ranges."""
    from harness import make_trainer
    from megatron_mini import data_parallel
    outputs, trainer = [], None
    reduce_scatter_into = data_parallel.comm.reduce_scatter_into

    def recording(out, t, group, **kw):
        flat = trainer.buffers[0].grads_flat
        inside = out.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        outputs.append((out.storage_offset() - flat.storage_offset() if inside else None, out.numel()))
        return reduce_scatter_into(out, t, group, **kw)
    data_parallel.comm.reduce_scatter_into = recording
    trainer = make_trainer(cfg)
    trainer.train_step()
    buffer = trainer.buffers[0]
    return outputs, [(lo - buffer.buckets[0].start, hi - lo) for lo, hi in map(buffer.valid_range, buffer.buckets)]


def test_zero1_reduces_each_bucket_into_its_own_shard(small_data, tmp_path):
    """ZeRO-1's reduce-scatter writes in place, into this rank's shard of the bucket in grads_flat (as
    Megatron's): it allocates no output (a separate one held 4/dp bytes a parameter until the sync ended,
    which neither the plan nor memory_bytes counts)."""
    from ranks import spawn

    for rank in spawn(2, _reduce_scatter_outputs, small_config(small_data, tmp_path, zero=1)):
        outputs, valid = rank
        assert outputs and sorted(outputs) == sorted(valid), rank


ORDER_LAYOUTS = {"pp1": dict(), "pp1-vpp2": dict(vpp=2), "pp2-last-stage": dict(pp=2)}


@pytest.mark.parametrize("layout", ORDER_LAYOUTS)
def test_zero1_each_layer_waits_for_its_own_weights(layout, monkeypatch):
    """After a ZeRO-1 step the weight all-gathers run while the next forward does: all are launched at once,
    in the order the forward first uses their buckets (on the last stage, the tied word embedding's last);
    a layer's forward starts only after the gathers of every bucket holding one of its parameters (whichever
    chunk's buffer holds it: at pp=1 vpp=2 the head uses the first chunk's embedding), and no gather is
    waited for before the layer ahead of its first user has started (so the later ones overlap the earlier
    layers). The rank as build_rank builds it, on the meta device over a virtual dp=2 group (records, moves
    nothing), with small buckets that cut across layers."""
    from megatron_mini import comm
    from megatron_mini.config import ModelConfig, TrainConfig
    from megatron_mini.mesh import ParallelMesh
    from megatron_mini.rank import build_rank
    from megatron_mini.rng import RNGTracker

    meta = torch.device("meta")
    kw = ORDER_LAYOUTS[layout]
    cfg = TrainConfig(model=ModelConfig(name="t", num_layers=4, hidden_size=32, num_heads=2, seq_len=8, vocab_size=96),
                      zero=1, ddp_bucket_numel=SMALL_BUCKETS, gbs=4, mbs=1, **kw)
    pp = kw.get("pp", 1)
    mesh = ParallelMesh(1, pp, 2, virtual_rank=2 * (pp - 1))                    # dp rank 0 of the last stage
    chunks, buffers, _ = build_rank(cfg, mesh, RNGTracker(0, 0, meta), meta)
    layers = [layer for chunk in chunks for layer in chunk.layers]               # forward order
    events, launches, handles = [], [], {}
    for n, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda module, args, n=n: events.append(("forward", n)))
    gather = comm.all_gather_into

    def logged(out, shard, group, **kwargs):
        work = gather(out, shard, group, **kwargs)
        b, = [b for b, buf in enumerate(buffers) if out._base is buf.params_flat]
        k, = [k for k, bucket in enumerate(buffers[b].buckets) if bucket.start == out.storage_offset()]
        launches.append((b, k))
        handles[id(work)] = (b, k)
        return work
    monkeypatch.setattr(comm, "all_gather_into", logged)
    monkeypatch.setattr(comm.Work, "wait", lambda self: events.append(("wait", handles[id(self)])))
    for buf in buffers:
        buf.start_param_gather()
    buckets = [(b, k) for b, buf in enumerate(buffers) for k in range(len(buf.buckets))]
    assert sorted(launches) == buckets and len(buckets) > len(layers)
    users = [{(b, k) for b, buf in enumerate(buffers) for k, bucket in enumerate(buf.buckets)
              if any(p is q for p in layer.parameters() for q in bucket.params)} for layer in layers]
    first_user = {key: min(n for n, used in enumerate(users) if key in used) for key in buckets}
    for b in range(len(buffers)):                                       # each group's launches, in first use
        order = [first_user[key] for key in launches if key[0] == b]
        assert order == sorted(order), (b, launches)
    if pp == 2:
        last = buffers[0].buckets[launches[-1][1]]                      # the tied word embedding, used last
        assert any(layers[-1].word_embeddings is p for p in last.params)
    else:
        assert users[-1] & users[0]                                     # the tied word embedding

    x = torch.empty(2, 8, dtype=torch.long, device=meta) if pp == 1 else torch.empty(8, 2, 32, device=meta)
    labels = torch.empty(2, 8, dtype=torch.long, device=meta)
    for chunk in chunks[:-1]:
        x = chunk(x)
    chunks[-1](x, labels)
    assert sorted(key for what, key in events if what == "wait") == buckets     # each gather waited for once
    at = {e: n for n, e in enumerate(events)}
    for n, used in enumerate(users):
        for key in used:                                                 # before its users...
            assert at[("wait", key)] < at[("forward", n)], (key, n, events)
    for key, n in first_user.items():                                    # ...and not before it must
        if n > 0:
            assert at[("wait", key)] > at[("forward", n - 1)], (key, n, events)
    assert all(bucket.gather is None for buf in buffers for bucket in buf.buckets)


def _train_with_late_gathers(cfg):
    """Train with ZeRO-1's weight all-gathers held back until they are waited for, and the weights they
    bring from the other ranks filled with NaN meanwhile (the gather is in place: its input, this rank's own
    slice, keeps its value): a weight read before its wait poisons the run, and a write to the input before
    the wait fails it."""
    from megatron_mini import comm
    from megatron_mini.training import train

    run = comm._run

    class Late:
        def __init__(self, args, own):
            self.args, self.own = args, own

        def wait(self):
            shard = self.args[-1]
            assert torch.equal(shard, self.own), "a gather's input (this rank's weights) was written in flight"
            run(*self.args)

    def late(group, name, nbytes, fn, *args, async_op=False, **kwargs):
        if async_op and group.name == "dp" and name == "all_gather":
            out, shard = args
            own = shard.clone()
            out.fill_(float("nan"))
            shard.copy_(own)             # in place: the own slice is the input, and stays as it was
            return Late((group, name, nbytes, fn, *args), own)
        return run(group, name, nbytes, fn, *args, async_op=async_op, **kwargs)

    comm._run = late
    return train(cfg)


def test_zero1_reads_no_weight_before_its_gather(small_data, tmp_path):
    """Forward (training, evaluation), checkpoints and resume all wait for the weights they read, and
    nothing writes a gather's input (the rank's own slice) in flight: with the gathers held back and the
    other ranks' slices poisoned until waited for, dp=2 x pp=2 ZeRO-1 (an evaluation every 4
    steps, a checkpoint every 3, then a resume from step 6) trains like one process."""
    from ranks import spawn

    kw = dict(steps=8, eval_interval=4, save_interval=3)
    single = train_on_ranks(1, small_config(small_data, tmp_path / "single", **kw))
    cfg = small_config(small_data, tmp_path / "zero", pp=2, zero=1, **kw)
    late = spawn(4, _train_with_late_gathers, cfg, init_group=False)[0]
    assert_same_training(single, late)
    assert [s for s, _ in late["val_loss"]] == [0, 4, 8] == [s for s, _ in single["val_loss"]]
    # the per-step losses' bound (assert_same_training: 1.6e-7 the most measured over the suite); 1.3e-9 measured here
    assert [v for _, v in late["val_loss"]] == pytest.approx([v for _, v in single["val_loss"]], rel=1e-6)
    step6 = os.path.join(late["checkpoint"], "..", "step_000006")
    resumed = spawn(4, _train_with_late_gathers, small_config(small_data, tmp_path / "resumed", pp=2, zero=1,
                                                              resume=step6, **kw), init_group=False)[0]
    assert torch.allclose(torch.tensor(late["loss"][6:]), torch.tensor(resumed["loss"]), rtol=1e-6, atol=0)
    for name, w in final_weights(late).items():
        assert torch.allclose(w, final_weights(resumed)[name], rtol=0, atol=1e-6), name


def _train_in_small_buckets(cfg, hook_without_grad: bool = True):
    """train(cfg) in small DP buckets (cfg.ddp_bucket_numel: SMALL_BUCKETS; the default 1M holds the test model whole:
    one bucket per chunk, reduced as its backward ends), recording each bucket's reduction: (this rank's history,
    {"buckets": how many, "launches": reductions started, "early": of them, during the backward (all its gradients
    in, the rest of the backward still to run), "late": parameters said to be in after their bucket's reduction
    started, "changed": parameters whose main grad changed after it}). An early reduction is held back to the end
    of the backward (then started, in the order asked for), where its bucket's gradients must be what they were
    when it was asked for: one started before a gradient was added into its bucket (the output layer's use of the
    tied word embedding before the lookup's, say) changes there, whether or not anything said so.
    `hook_without_grad` False: autograd runs no post-accumulate-grad hook for a parameter whose gradient the ops
    added into its main grad themselves (no .grad), as AccumulateGrad did before pytorch#155521 (June 2025)."""
    from megatron_mini import data_parallel
    from megatron_mini.training import train

    if not hook_without_grad:                # (this rank's process only)
        register = torch.Tensor.register_post_accumulate_grad_hook
        torch.Tensor.register_post_accumulate_grad_hook = \
            lambda p, hook: register(p, lambda q: None if q.grad is None else hook(q))
    buffer = data_parallel.GradBuffer
    launch, ready, finish = buffer._launch, buffer._main_grad_ready, buffer.finish_grad_sync
    seen, launched, syncing, held = set(), set(), [False], []
    found = {"launches": 0, "early": 0, "late": [], "changed": []}

    def counted_launch(self, bucket):
        seen.add(bucket)
        launched.add(bucket)
        found["launches"] += 1
        found["early"] += not syncing[0]
        if syncing[0]:
            launch(self, bucket)
        else:
            bucket.launched = True
            held.append((self, bucket, self.grads_flat[bucket.start:bucket.end].clone()))

    def checked_ready(self, p):
        if self.bucket_of[p] in launched:
            found["late"].append(self.names[p])
        ready(self, p)

    def synced(self):
        for _, bucket, grads in [h for h in held if h[0] is self]:
            for _, name, lo, hi in self.segments(bucket.start, bucket.end):
                if not torch.equal(self.grads_flat[lo:hi], grads[lo - bucket.start:hi - bucket.start]):
                    found["changed"].append(name)
            launch(self, bucket)
        held[:] = [h for h in held if h[0] is not self]
        syncing[0] = True
        finish(self)
        syncing[0] = False
        launched.difference_update(self.buckets)

    buffer._launch, buffer._main_grad_ready, buffer.finish_grad_sync = counted_launch, checked_ready, synced
    return train(cfg), dict(found, buckets=len(seen))


SMALL_BUCKETS_RUN = dict(gbs=6, mbs=1, steps=4)


@pytest.fixture(scope="module")
def small_buckets_reference(small_data, tmp_path_factory):
    return train_on_ranks(1, small_config(small_data, tmp_path_factory.mktemp("single"), **SMALL_BUCKETS_RUN))


@pytest.mark.parametrize("layout, hook_without_grad", [
    (dict(), True), (dict(), False), (dict(vpp=2), True), (dict(vpp=2, zero=1), True), (dict(pp=2, zero=1), True)],
    ids=["pp1-dp3", "pp1-dp3-no-hook-without-grad", "pp1-vpp2-dp3", "pp1-vpp2-dp3-zero", "pp2-dp3-zero"])
def test_small_buckets_reduce_during_the_backward_and_train_the_same_model(layout, hook_without_grad, small_data,
                                                                         small_buckets_reference, tmp_path):
    """With many DP buckets (as a real model has) each one's all-reduce or ZeRO-1 reduce-scatter starts once, during
    the chunk's last backward, once every gradient of it is in, and no gradient reaches it later: at pp=1 the word
    embedding takes the output layer's gradient and then the lookup's (in one backward; with vpp=2 the output
    layer's in chunk 1's, before chunk 0's). The same where autograd runs no post-accumulate-grad hook for a
    parameter with no .grad (torch before pytorch#155521): the ops that add a gradient into the main grad say it
    is in themselves. dp=3 pads buckets (every parameter of the test model has an even size) and cuts parameters
    at shard boundaries (at pp=2 the tied embedding's bucket on the first and the last stage alike). The run trains
    the same model as one process."""
    from ranks import spawn

    runs = spawn(3 * layout.get("pp", 1), _train_in_small_buckets,
                 small_config(small_data, tmp_path, ddp_bucket_numel=SMALL_BUCKETS, **SMALL_BUCKETS_RUN, **layout),
                 hook_without_grad, init_group=False)
    for _, found in runs:
        assert found["buckets"] > 10 and found["late"] == found["changed"] == [], found
        assert found["launches"] == found["early"] == SMALL_BUCKETS_RUN["steps"] * found["buckets"], found
    assert_same_training(small_buckets_reference, runs[0][0])


@pytest.mark.parametrize("world, layout", [
    (4, {"tp": 2, "pp": 2, "sp": True}),                       # TP slices, replicated ones, the tied embedding's copy
    (2, {"zero": 1, "precision.dtype": "bf16"}),                              # fp32 masters sharded over DP
], ids=["tp2-pp2-sp", "dp2-zero1-bf16"])
def test_the_logged_param_norm_is_of_the_weights_the_step_ran_with(small_data, tmp_path, world, layout):
    """metrics.jsonl's param_norm at a logged step (every log_interval, and the last) is the L2 norm of the whole
    model's fp32 weights as the step began: the masters of the checkpoint before it, counted once (each TP slice,
    each replicated or tied tensor once), from the full tensors on one process."""
    import json

    from megatron_mini.checkpoint import ShardReader, read_meta
    cfg = small_config(small_data, tmp_path, steps=3, log_interval=2, save_interval=1, keep_checkpoints=4, **layout)
    train_on_ranks(world, cfg)
    logged = {r["step"]: r["param_norm"] for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "loss" in r}
    assert list(logged) == [2, 3]
    for step, norm in logged.items():
        path = str(tmp_path / "checkpoints" / f"step_{step - 1:06d}")
        reader = ShardReader(path, read_meta(path))
        expected = math.sqrt(sum(reader.full(name, "master").double().square().sum().item()
                                 for name in reader.names()))
        assert norm == pytest.approx(expected, rel=1e-6)


def test_the_clipping_norm_is_the_exact_norm_of_the_gradient():
    """The global gradient norm that clips (and is logged as grad_norm) is the L2 norm of the fp32 main grads to
    fp32 precision, against an fp64 sum, for a tensor of a gpt2-small embedding's order (8M elements). torch's
    fp32 norm on CPU sums in order: 2e-3 low for 38M elements, so a clipped gradient's norm exceeded grad_clip."""
    from megatron_mini.config import OptimizerConfig, PrecisionConfig, TrainConfig
    from megatron_mini.data_parallel import GradBuffer
    from megatron_mini.mesh import ParallelMesh
    from megatron_mini.optimizer import Optimizer
    from megatron_mini.tensor_parallel import ParamSpec

    params = [("embedding", torch.nn.Parameter(torch.zeros(8192, 1024))), ("bias", torch.nn.Parameter(torch.zeros(7)))]
    for _, p in params:
        p.spec = ParamSpec()
    mesh = ParallelMesh(1, 1, 1)
    buffer = GradBuffer(params, mesh, torch.float32, zero=False, bucket_numel=TrainConfig.ddp_bucket_numel)
    optimizer = Optimizer([buffer], mesh, OptimizerConfig(), PrecisionConfig(), zero=False)
    torch.manual_seed(0)
    buffer.grads_flat.copy_(torch.randn(buffer.grads_flat.numel()) * 1e-3)
    exact = buffer.grads_flat.double().square().sum().sqrt().item()
    assert optimizer.global_norms()[0] == pytest.approx(exact, rel=1e-6)
