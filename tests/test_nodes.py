"""A job on several nodes, each with its own disk: ranks whose working directories differ stand in for nodes (a
relative run_dir or checkpoint path is then each node's own copy). What a node-local disk would split is refused on
every rank before any checkpoint is read or written."""
from __future__ import annotations

import dataclasses
import os
import shutil

import pytest

from corpus import write_modules
from harness import small_config, train_on_ranks
from ranks import spawn


def _train_from(cfg, node_dirs):
    """train(cfg) on this rank in its node's working directory, node_dirs[rank]; (the error's type, its message),
    or None where it trained."""
    os.chdir(node_dirs[int(os.environ["RANK"])])
    from megatron_mini import training
    try:
        training.train(cfg)
    except Exception as e:      # noqa: BLE001 - what each rank raised is the test's answer
        return type(e).__name__, str(e)
    return None


def test_a_run_directory_on_each_nodes_own_disk_is_refused_before_training(small_data, tmp_path):
    """run_dir=run, relative, on two nodes launched from their own directories: each node has a run directory of its
    own, so the second node's checkpoint files would be written where rank 0 never publishes them (the run trained
    until its first save, then failed on a missing file). Every rank stops at start-up with one message, naming rank
    0's lock that the other node does not see."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node in nodes:
        node.mkdir()
    cfg = small_config(small_data, "run", pp=2, steps=1, timeout_s=30)
    errors = spawn(2, _train_from, cfg, [str(n) for n in nodes], init_group=False, timeout=120)
    assert errors[0] and errors[0] == errors[1] and errors[0][0] == "ConfigError", errors
    message = errors[0][1]
    assert message.startswith("rank 1 does not see rank 0's run directory run (run_dir=run is relative: each node "
                              "finds it in its own working directory): its lock, held by rank 0 (host "), message
    assert "), is missing there. Every rank must see the same run_dir, on a file system that all nodes share (not a " \
        "node-local disk)" in message, message
    assert not (nodes[0] / "run" / "metrics.jsonl").exists() and not list(tmp_path.glob("node*/run/checkpoints"))


@pytest.mark.parametrize("start, other", [("resume", {"optimizer.lr": 1e-3}), ("init_from", {"model.num_layers": 4})])
def test_each_nodes_own_copy_of_a_checkpoint_must_be_the_same(start, other, small_data, tmp_path):
    """resume=ckpt or init_from=ckpt, relative, where each node holds its own copy and the copies differ (two runs'
    step 1): each verifies against its own meta.json, so without comparing them the nodes would resume different
    weights; init_from's (of two models, 8 and 4 blocks) were checked against this run's model first, and rank 1
    refused its copy alone while rank 0 waited in a collective. Every rank stops with one message before reading
    them."""
    for name, overrides in (("a", {}), ("b", other)):
        train_on_ranks(1, small_config(small_data, tmp_path / name, steps=1, **overrides))
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node, name in zip(nodes, "ab"):
        shutil.copytree(tmp_path / name / "checkpoints" / "step_000001", node / "ckpt")
    cfg = small_config(small_data, tmp_path / "shared", steps=2, timeout_s=30, **{start: "ckpt"})
    errors = spawn(2, _train_from, cfg, [str(n) for n in nodes], init_group=False, timeout=120)
    assert errors == [("CheckpointError", "rank 1 read another checkpoint at ckpt than rank 0 (its meta.json differs): "
                                          "the nodes see different files at that path (each its own copy, on a "
                                          "node-local disk); start from a path that every node shares.")] * 2, errors
    assert not (tmp_path / "shared" / "checkpoints").exists()


def test_each_nodes_own_data_directory_must_hold_the_same_build(small_data, tmp_path, monkeypatch):
    """data.dir=data and data.source=corpus, relative, on two nodes that each prepared their own copy of the corpus,
    which differ (a stale copy on one node): the config is the same, so without comparing what each read the nodes
    would train on other documents (another tokenizer's ids) without a word. Every rank stops at start-up with one
    message naming what differs."""
    from megatron_mini.data import prepare
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    for node, modules in zip(nodes, (slice(0, 25), slice(25, 50))):
        write_modules(node / "corpus", modules)
        monkeypatch.chdir(node)
        prepare(dataclasses.replace(small_data, source="corpus", dir="data"))
    data = dataclasses.replace(small_data, source="corpus", dir="data")
    cfg = small_config(data, tmp_path / "shared", steps=1, timeout_s=30)
    errors = spawn(2, _train_from, cfg, [str(n) for n in nodes], init_group=False, timeout=120)
    assert errors[0] and errors[0] == errors[1] and errors[0][0] == "ConfigError", errors
    assert errors[0][1].startswith("rank 1 read other data than rank 0 at data.dir=data (corpus_sha256 "), errors
    assert "num_tokens " in errors[0][1] and "tokenizer_sha256 " in errors[0][1] and errors[0][1].endswith(
        ": rank 0 | rank 1): each node holds a build of its own there, and they differ; give every node the same "
        "prepared directory (a copy of one build, or a file system they share)."), errors
    assert not (tmp_path / "shared" / "metrics.jsonl").exists()


def _train_with_an_unreadable_listing(cfg, node_dirs):
    """_train_from, rank 0's listing of the checkpoints failing (PermissionError)."""
    from megatron_mini import checkpoint
    if int(os.environ["RANK"]) == 0:
        def refused(run_dir):
            raise PermissionError(13, "Permission denied", os.path.join(run_dir, "checkpoints"))
        checkpoint.checkpoints_of = refused
    return _train_from(cfg, node_dirs)


def test_a_failure_of_rank_0_finding_the_start_is_every_ranks(small_data, tmp_path):
    """Rank 0 alone lists the run directory at start-up: where that fails otherwise than with a ConfigError (an
    OSError: here the listing is refused), every rank stops with its one line, not rank 0 alone while the others wait
    in the rendezvous until timeout_s."""
    run = tmp_path / "run"
    train_on_ranks(1, small_config(small_data, run, steps=1))
    cfg = small_config(small_data, run, steps=2, resume="auto", timeout_s=30)
    errors = spawn(2, _train_with_an_unreadable_listing, cfg, [str(tmp_path)] * 2, init_group=False, timeout=120)
    assert [kind for kind, _ in errors] == ["ConfigError"] * 2 and errors[0] == errors[1], errors
    assert errors[0][1].startswith("PermissionError: [Errno 13] Permission denied: "), errors


def _resume_with_a_stale_listing(cfg, pruned):
    """train(cfg) on this rank, rank 1 listing only the checkpoint `pruned`, gone since (its node's NFS cache of the
    listing older than rank 0's): the steps it trained."""
    from megatron_mini import checkpoint, training
    if int(os.environ["RANK"]) == 1:
        checkpoint.checkpoints_of = lambda run_dir: [pruned]
    return len(training.train(cfg)["loss"])


def test_a_node_whose_listing_is_stale_resumes_as_rank_0_does(small_data, tmp_path):
    """resume=auto where one node's listing still names a pruned checkpoint (a stale NFS listing): rank 0's choice is
    every rank's, so both resume from step 2 (rank 1 refused its own listing alone, "none is complete and intact",
    while rank 0 waited for it until timeout_s; or started anew beside rank 0's resume: other collectives)."""
    run = tmp_path / "run"
    train_on_ranks(1, small_config(small_data, run, steps=2, save_interval=2))
    cfg = small_config(small_data, run, steps=3, resume="auto", timeout_s=30)
    steps = spawn(2, _resume_with_a_stale_listing, cfg, str(run / "checkpoints" / "step_000001"), init_group=False,
                  timeout=120)
    assert steps == [1, 1], steps
    log = (run / "logs" / "rank0001.log").read_text()
    assert f"resumed from {run / 'checkpoints' / 'step_000002'} at step 2" in log, log


def test_a_path_that_is_a_checkpoint_on_one_node_and_a_run_directory_on_another(small_data, tmp_path):
    """init_from=ckpt, relative: node 0's is a checkpoint directory, node 1's a run directory holding that checkpoint
    (as a checkpoint that a live run is pruning looks to a rank that reads it after its meta.json went). Rank 0's
    answer is every rank's: both verify `ckpt` as a checkpoint, and every rank stops with rank 1's one line (rank 1
    walked a listing of its own while rank 0 verified: other collectives)."""
    train_on_ranks(1, small_config(small_data, tmp_path / "a", steps=1))
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    shutil.copytree(tmp_path / "a" / "checkpoints" / "step_000001", nodes[0] / "ckpt")
    shutil.copytree(tmp_path / "a" / "checkpoints", nodes[1] / "ckpt" / "checkpoints")
    cfg = small_config(small_data, tmp_path / "shared", steps=2, timeout_s=30, init_from="ckpt")
    errors = spawn(2, _train_from, cfg, [str(n) for n in nodes], init_group=False, timeout=120)
    assert errors == [("CheckpointError", "init_from=ckpt is not a checkpoint (no meta.json); a checkpoint directory "
                                          "looks like runs/NAME/checkpoints/step_000100.")] * 2, errors
    assert not (tmp_path / "shared" / "checkpoints").exists()
