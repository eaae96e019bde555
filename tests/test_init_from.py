"""init_from: a new run that starts from a checkpoint's weights (any layout, precision, seed or data encoded with
its tokenizer), with the optimizer, the step count and the data as new; a run that resumes ignores it."""
import dataclasses
import json
import os
import shutil

import pytest
import torch

from harness import small_config, train_on_ranks
from megatron_mini import checkpoint
from megatron_mini.checkpoint import ShardReader
from megatron_mini.config import ConfigError, DataConfig, TrainConfig, validate
from megatron_mini.data import Tokenizer


@pytest.fixture(scope="module")
def source(small_data, tmp_path_factory):
    """3 steps in bf16 at tp = 2 x pp = 2: its checkpoint keeps 16-bit weights and fp32 masters."""
    cfg = small_config(small_data, tmp_path_factory.mktemp("source"), tp=2, pp=2, steps=3, gbs=8,
                       **{"precision.dtype": "bf16"})
    return train_on_ranks(4, cfg)["checkpoint"]


def test_a_run_starts_from_a_checkpoints_masters_with_a_new_optimizer(small_data, source, tmp_path):
    """In fp32 at dp = 2, another seed, lr 0 (no update moves a weight): the run ends with the source's fp32 masters,
    bitwise (not its bf16 weights); its step count and samples start at 0; Adam's moments are the new run's own,
    m = (1 - beta1) g and v = (1 - beta2) g^2 after one update, not the source's three steps of history."""
    cfg = small_config(small_data, tmp_path, steps=1, gbs=8, seed=7, init_from=source,
                       **{"optimizer.lr": 0.0, "optimizer.min_lr": 0.0})
    history = train_on_ranks(2, cfg)
    src, new = ShardReader(source, checkpoint.read_meta(source)), ShardReader(history["checkpoint"],
                                                                              checkpoint.read_meta(history["checkpoint"]))
    meta = checkpoint.read_meta(history["checkpoint"])
    assert (meta["step"], meta["consumed_samples"], meta["optimizer"]["step_count"]) == (1, 8, 1)
    o = cfg.optimizer
    for name in src.names():
        master = src.full(name, "master")
        assert not torch.equal(master, src.full(name).float())        # (bf16 weights: the masters are finer)
        assert torch.equal(new.full(name), master), name
        m, v = new.full(name, "exp_avg"), new.full(name, "exp_avg_sq")
        seen = v > 1e-30
        # m and v are each an fp32 product of g and a rounded constant: their ratio is a few fp32 roundings
        # (2^-24) from exact, 1.2e-7 measured; 1e-6 bounds ten roundings
        assert seen.any() and torch.allclose(m[seen] ** 2 / v[seen], torch.full_like(v[seen], (1 - o.beta1) ** 2 /
                                                                                        (1 - o.beta2)), rtol=1e-6,
                                             atol=0)
    log = (tmp_path / "logs" / "rank0000.log").read_text()
    assert f"init_from: the weights of {source} (step 3 of the run that saved it); the optimizer, the step count " \
           "and the data start anew" in log


def test_a_shorter_sequence_starts_from_the_first_position_embeddings(small_data, source, tmp_path):
    """model.seq_len 32 -> 16 (nanoGPT's crop_block_size), in another layout (tp = 2 at dp = 2, ZeRO-1: the masters
    read in pieces), lr 0: the run ends with the source's fp32 masters, but for the position embeddings, of which it
    has the first 16 rows (Adam's moments too are the new run's, of that shape); the log says so. A longer seq_len
    is refused: its positions past 32 would have no trained embedding."""
    cfg = small_config(small_data, tmp_path, steps=1, gbs=8, tp=2, zero=1, init_from=source,
                       **{"model.seq_len": 16, "optimizer.lr": 0.0, "optimizer.min_lr": 0.0})
    history = train_on_ranks(4, cfg)
    src = ShardReader(source, checkpoint.read_meta(source))
    new = ShardReader(history["checkpoint"], checkpoint.read_meta(history["checkpoint"]))
    assert src.names() == new.names() and "embedding.position_embeddings" in src.names()
    for name in src.names():
        master = src.full(name, "master")
        if name == "embedding.position_embeddings":
            assert master.shape == (32, 64) and new.full(name, "exp_avg").shape == (16, 64)
            master = master[:16]
        assert torch.equal(new.full(name), master), name
    log = (tmp_path / "logs" / "rank0000.log").read_text()
    assert "the data start anew; model.seq_len 32 -> 16: the first 16 rows of its position embeddings" in log
    tokenizer = Tokenizer(f"{small_data.dir}/tokenizer.model").sha256
    longer = small_config(small_data, tmp_path, init_from=source, **{"model.seq_len": 64, "model.ffn_mult": 2})
    with pytest.raises(ConfigError, match=rf"init_from={source} holds another model than this run asks for: "
                                          r"model\.seq_len: 32 -> 64 \(its learned position embeddings end at 32: a "
                                          r"seq_len up to 32 starts from their first rows\); model\.ffn_mult: 4 -> 2\. "
                                          r"Set these back"):
        checkpoint.check_init(longer, tokenizer)
    own = dataclasses.replace(cfg, resume="auto", init_from=None, model=dataclasses.replace(cfg.model, seq_len=8))
    resume = checkpoint.find_resume(own)            # (a resume is no init_from: its seq_len stays, the hint says how)
    data = {"tokenizer_sha256": tokenizer}
    with pytest.raises(ConfigError, match=rf"model\.seq_len: 16 -> 8\. Set these back, or start a new run under "
                                          rf"another run_name \(init_from={resume.path} starts it from these "
                                          rf"weights\)"):
        checkpoint.check_compatible(resume, own, data)


def test_a_run_that_resumes_ignores_init_from(small_data, source, tmp_path):
    """init_from starts a run: a start that finds the run's own checkpoint resumes it, wherever init_from points."""
    first = train_on_ranks(1, small_config(small_data, tmp_path, steps=2, gbs=8, init_from=source))
    again = train_on_ranks(1, small_config(small_data, tmp_path, steps=3, gbs=8, resume="auto",
                                           init_from=str(tmp_path / "nowhere")))
    assert len(first["loss"]) == 2 and len(again["loss"]) == 1
    log = (tmp_path / "logs" / "rank0000.log").read_text()
    assert f"resumed from {first['checkpoint']} at step 2" in log and log.count("init_from:") == 1


def test_what_init_from_cannot_start_from_is_refused(small_data, source, tmp_path):
    tokenizer = Tokenizer(f"{small_data.dir}/tokenizer.model").sha256
    other = small_config(small_data, tmp_path, init_from=source, **{"model.num_layers": 4})
    with pytest.raises(ConfigError, match=rf"init_from={source} holds another model than this run asks for: "
                                          r"model\.num_layers: 8 -> 4\. Set these back"):
        checkpoint.check_init(other, tokenizer)
    copy = tmp_path / "copy"
    shutil.copytree(source, copy)
    meta = json.loads((copy / "meta.json").read_text())
    meta["data"]["tokenizer_sha256"] = "f" * 64
    (copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=rf"init_from={copy} was trained with another tokenizer \(sha256 "
                                          rf"ffffffffffff; this run's data\.dir=.* has {tokenizer[:12]}\), so its "
                                          r"token ids mean other text: prepare this run.s corpus with data\.tokenizer="
                                          rf"{copy}/tokenizer\.model, or start"):   # (the checkpoint's own copy)
        checkpoint.check_init(small_config(small_data, tmp_path, init_from=str(copy)), tokenizer)
    with pytest.raises(ConfigError, match="is not a checkpoint"):
        checkpoint.check_init(small_config(small_data, tmp_path, init_from=str(tmp_path)), tokenizer)
    assert checkpoint.check_init(small_config(small_data, tmp_path, init_from=source), tokenizer).path == source
    run_dir = os.path.dirname(os.path.dirname(source))               # (a run directory: its newest checkpoint)
    assert checkpoint.check_init(small_config(small_data, tmp_path, init_from=run_dir), tokenizer).path == source
    corrupt = tmp_path / "corrupt"
    shutil.copytree(source, corrupt)
    weights = sorted(corrupt.glob("model_*.pt"))[0]
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=rf"{weights} does not match its sha256"):    # (read before the weights)
        train_on_ranks(1, small_config(small_data, tmp_path / "from-corrupt", init_from=str(corrupt)))
    with pytest.raises(ConfigError, match="data.tokenizer is empty"):
        validate(TrainConfig(data=DataConfig(tokenizer=" ")), 1)
    with pytest.raises(ConfigError, match="init_from is empty"):
        validate(TrainConfig(init_from=" "), 1)
    with pytest.raises(ConfigError, match=rf"init_from={source} starts a new run from a checkpoint's weights, and "
                                          rf"resume={source} continues the run of another: give one of them\."):
        validate(TrainConfig(init_from=source, resume=source), 1)


def _init_from_a_checkpoint_pruned_after_its_check(cfg):
    """train(cfg) on this rank, the chosen init_from checkpoint removed (rank 0) after every rank verified it, as the
    run that writes it prunes it; the error's type and message."""
    import torch.distributed as dist

    from megatron_mini import training
    original = training.Trainer.init_weights

    def pruned(self, path):
        if dist.get_rank() == 0:
            shutil.rmtree(path)
        dist.barrier()
        original(self, path)
    training.Trainer.init_weights = pruned
    with pytest.raises(Exception) as caught:
        training.train(cfg)
    return type(caught.value).__name__, str(caught.value)


def _init_from_a_listing_that_changed(cfg):
    """train(cfg) on this rank, rank 1 listing the init_from run directory as it was before its newest checkpoint
    was published (a job still saving into it): the steps it trained."""
    from megatron_mini import checkpoint as ckpt, training
    listed = ckpt.checkpoints_of
    if int(os.environ["RANK"]) == 1:
        ckpt.checkpoints_of = lambda run_dir: [p for p in listed(run_dir) if ckpt.read_step(p) <= 2]
    return len(training.train(cfg)["loss"])


def test_init_from_a_run_directory_takes_its_newest_intact_checkpoint(small_data, tmp_path):
    """init_from=<run directory> whose newest checkpoint is damaged starts from the one before (as resume=auto
    does; the other run's files are left as they are), and one removed after it was chosen and verified (a running
    job's keep_checkpoints) is one line on every rank, not a traceback. Ranks that list it at different moments (a
    job still saving into it) walk rank 0's listing: one choice, and the same checks (collectives) on every rank."""
    from ranks import spawn
    run = tmp_path / "pretrain"
    train_on_ranks(1, small_config(small_data, run, steps=4, save_interval=2, keep_checkpoints=2))
    weights = sorted((run / "checkpoints" / "step_000004").glob("model_*.pt"))[0]
    data = bytearray(weights.read_bytes())
    data[-100] ^= 0xFF
    weights.write_bytes(bytes(data))
    listing = sorted(os.listdir(run / "checkpoints"))
    train_on_ranks(2, small_config(small_data, tmp_path / "tune", steps=1, init_from=str(run)))
    log = (tmp_path / "tune" / "logs" / "rank0000.log").read_text()
    assert f"init_from: the weights of {run / 'checkpoints' / 'step_000002'} (step 2 " in log
    assert f"skipped {run / 'checkpoints' / 'step_000004'}: {weights} does not match its sha256" in log
    assert sorted(os.listdir(run / "checkpoints")) == listing
    errors = spawn(2, _init_from_a_checkpoint_pruned_after_its_check,
                   small_config(small_data, tmp_path / "pruned", steps=1, timeout_s=30, init_from=str(run)),
                   init_group=False, timeout=120)
    gone = run / "checkpoints" / "step_000002"
    assert [kind for kind, _ in errors] == ["CheckpointError"] * 2 and errors[0] == errors[1], errors
    assert errors[0][1].startswith(f"{gone} could not be read after it was verified (FileNotFoundError: "), errors
    train_on_ranks(1, small_config(small_data, tmp_path / "again", steps=4, save_interval=2, keep_checkpoints=2))
    again = tmp_path / "again" / "checkpoints"
    assert spawn(2, _init_from_a_listing_that_changed,
                 small_config(small_data, tmp_path / "changed", steps=1, timeout_s=30, init_from=str(again.parent)),
                 init_group=False, timeout=120) == [1, 1]
    log = (tmp_path / "changed" / "logs" / "rank0001.log").read_text()
    assert f"init_from: the weights of {again / 'step_000004'} (step 4 " in log


def test_an_fp16_run_starts_with_its_own_loss_scale(small_data, tmp_path):
    """From an fp16 checkpoint whose scale grew (growth every step), an fp16 run starts from its own initial scale."""
    fp16 = {"precision.dtype": "fp16", "precision.loss_scale_growth_interval": 1}
    src = train_on_ranks(1, small_config(small_data, tmp_path / "src", steps=3, gbs=8,
                                         **{**fp16, "precision.initial_loss_scale": 1024.0}))["checkpoint"]
    assert checkpoint.read_meta(src)["optimizer"]["scaler"]["scale"] == 8192
    new = train_on_ranks(1, small_config(small_data, tmp_path / "new", steps=1, gbs=8, init_from=src,
                                         **{**fp16, "precision.initial_loss_scale": 64.0}))
    assert checkpoint.read_meta(new["checkpoint"])["optimizer"]["scaler"]["scale"] == 128     # 64, grown once
