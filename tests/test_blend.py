"""data.blend: prepared directories mixed by weight (Megatron's --data-path 0.7 A 0.3 B), and data.eval: prepared
directories every evaluation also reads. The mixture against exact rational arithmetic, a blend of one directory
against data.dir, a blended run against one process and against its own resume, each directory's losses and each
evaluation set's against F.cross_entropy, and every refusal."""
import dataclasses
import json
import math
import os
import random
import re
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from corpus import NEXT_25, write_modules
from harness import assert_same_training, small_config, train_on_ranks
from megatron_mini import checkpoint
from megatron_mini.config import ConfigError, DataConfig, check_ranges, validate
from megatron_mini.data import DataError, Tokenizer, prepare
from megatron_mini.dataset import BlendedDataset, blend_note, check_token_ids, data_identity, load_datasets
from megatron_mini.inference import find_tokenizer, read_checkpoint

SEQ = 32
REPO = Path(__file__).resolve().parent.parent


class Indices:
    """A dataset of `n` samples an epoch whose sample j is j (so a blend's stream shows which sample it read)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, j):
        return j


def stream(blend: BlendedDataset, n: int) -> list:
    """(dataset, its sample) of blended samples 0..n-1."""
    return [(blend.datasets.index(ds), j) for ds, j in map(blend.locate, range(n))]


def shares(*weights) -> list:
    return [Fraction(w) / sum(map(Fraction, weights)) for w in weights]


@pytest.mark.parametrize("weights", [(7, 3), (1, 1, 1), (5, 2, 9, 1), (1, 1000)])
def test_a_blocks_order_is_the_exact_sainte_lague_interleaving(weights):
    """In a block of B = the shares' common denominator, dataset d gives its next c_d = B share_d samples, in its own
    order, the j-th at the rank of (j + 1/2) / c_d among all (ties: the earlier dataset), computed here in exact
    fractions; every later block repeats it with each dataset's samples moved on by c_d."""
    blend = BlendedDataset([Indices(10 ** 6) for _ in weights], shares(*weights))
    block = sum(weights) // math.gcd(*weights)
    counts = [w * block // sum(weights) for w in weights]
    assert (blend.block, blend.counts) == (block, counts)
    order = sorted((Fraction(2 * j + 1, 2 * c), d, j) for d, c in enumerate(counts) for j in range(c))
    first = [(d, j) for _, d, j in order]
    assert stream(blend, 3 * block) == [(d, q * counts[d] + j) for q in range(3) for d, j in first]
    assert [blend[i] for i in range(block)] == [j for _, j in first]


def test_each_datasets_share_of_any_prefix_is_within_the_bound_of_its_weight():
    """Random weights of 2..10 datasets: after any n samples, dataset d has given its samples 0, 1, 2, ... in order,
    none skipped or read twice, and within 1/2 + w_d (k - 2) / 2 of n w_d (k datasets; 1/2 for two). The bound: after
    n samples, the last taken has key t, d has given c_d t + e_d with |e_d| <= 1/2, and n = B t + sum e."""
    rng = random.Random(0)
    for trial in range(60):
        k = 2 if trial < 20 else rng.randint(3, 10)
        weights = [rng.choice([1, 2, 3, rng.randint(1, 50), rng.randint(1, 500)]) for _ in range(k)]
        blend = BlendedDataset([Indices(10 ** 6) for _ in weights], shares(*weights))
        read = np.array(stream(blend, 2 * blend.block))
        given = np.eye(k, dtype=np.int64)[read[:, 0]].cumsum(0)
        w = np.array([float(s) for s in blend.shares])
        deviation = np.abs(given - np.arange(1, len(read) + 1)[:, None] * w[None]).max(0)
        assert (deviation <= 0.5 + w * (k - 2) / 2 + 1e-9).all(), (weights, deviation)
        for d in range(k):
            assert read[read[:, 0] == d, 1].tolist() == list(range(given[-1, d]))


def test_shares_of_a_large_common_denominator_are_rounded_by_largest_remainders():
    """Weights 1 : 1,000,003 : 999,983 (their common denominator is past MAX_BLOCK): a block of MAX_BLOCK samples,
    each count the floor or ceiling of MAX_BLOCK share_d, summing to it; a weight that rounds to no sample refused."""
    s = shares(1, 1_000_003, 999_983)
    blend = BlendedDataset([Indices(10 ** 7) for _ in s], s)
    assert blend.block == BlendedDataset.MAX_BLOCK and sum(blend.counts) == blend.block
    for share, count in zip(s, blend.counts):
        assert count in (math.floor(share * blend.block), math.ceil(share * blend.block))
    with pytest.raises(ValueError, match="rounds to no sample in a block of 1048576"):
        BlendedDataset([Indices(10), Indices(10)], shares(1, 10 ** 9))


def test_the_blends_epoch_ends_where_a_dataset_would_repeat():
    """len() = the blended samples read before any dataset's sample len(d) (its next epoch): none before, one at it."""
    for sizes, weights in (((30, 1000), (1, 1)), ((1000, 7), (9, 1)), ((50, 60, 70), (3, 2, 2))):
        blend = BlendedDataset([Indices(n) for n in sizes], shares(*weights))
        read = stream(blend, len(blend) + 1)
        assert all(j < sizes[d] for d, j in read[:-1])
        d, j = read[-1]
        assert j == sizes[d]


@pytest.fixture(scope="module")
def blend_dirs(small_data, tmp_path_factory):
    """small_data's directory, one of 25 other standard-library modules (tests/corpus.py) encoded with its tokenizer
    (blendable), and one of those modules with a tokenizer of its own (not)."""
    root = tmp_path_factory.mktemp("blend")
    corpus = write_modules(root / "corpus", NEXT_25)
    code = dataclasses.replace(small_data, source=str(corpus), dir=str(root / "code"),
                               tokenizer=str(Path(small_data.dir) / "tokenizer.model"))
    own = dataclasses.replace(code, dir=str(root / "own"), tokenizer=None)
    prepare(code)
    prepare(own)
    return small_data.dir, code.dir, own.dir


def blend_of(small_data, *pairs) -> DataConfig:
    """small_data's settings with a blend of (weight, directory) `pairs`, and no corpus to prepare (refused beside one:
    data.source, data.text_key and data.tokenizer as DataConfig leaves them)."""
    return dataclasses.replace(small_data, source=DataConfig.source, text_key=DataConfig.text_key,
                               tokenizer=DataConfig.tokenizer, blend=[str(x) for pair in pairs for x in pair])


def own_config(small_data, directory) -> DataConfig:
    """The DataConfig that reads `directory` alone (its corpus as data.source)."""
    source = json.loads(Path(directory, "meta.json").read_text())["source"]
    return dataclasses.replace(small_data, dir=str(directory), source=source, tokenizer=None)


def test_a_blend_of_one_directory_reads_as_data_dir(small_data, blend_dirs):
    """The same samples, train and validation, and the same identity in checkpoints (a run may switch between them)."""
    plain, one = load_datasets(small_data, SEQ, 5, small_data.vocab_size), \
        load_datasets(blend_of(small_data, (2, blend_dirs[0])), SEQ, 5, small_data.vocab_size)
    for a, b in zip(plain[:2], one[:2]):
        assert len(a) == len(b) and all(np.array_equal(a[i], b[i]) for i in range(0, 3 * len(a), 97))
    assert data_identity(small_data, plain) == data_identity(blend_of(small_data, (2, blend_dirs[0])), one)


def test_a_blends_samples_are_its_directories_own(small_data, blend_dirs):
    """Blended sample i is the sample that each directory's own GPTDataset (its split by the same seed) gives at the
    index the blend locates, for train and validation alike, 70 : 30."""
    first, second, _ = blend_dirs
    cfg = blend_of(small_data, (0.7, first), (0.3, second))
    train, val, tok = load_datasets(cfg, SEQ, 5, small_data.vocab_size)
    assert tok.sha256 == Tokenizer(Path(first) / "tokenizer.model").sha256
    for blend, which in ((train, 0), (val, 1)):
        assert blend.counts == [7, 3]
        for d, directory in enumerate((first, second)):
            plain = load_datasets(own_config(small_data, directory), SEQ, 5, small_data.vocab_size)[which]
            assert len(plain) == len(blend.datasets[d])
            for i in range(0, 500, 7):
                part, j = blend.locate(i)
                if part is blend.datasets[d]:
                    assert np.array_equal(blend[i], plain[j])
    identity = data_identity(cfg, (train, val, tok))
    assert identity["blend"] == [f"0.7 {first}", f"0.3 {second}"]
    assert identity["num_tokens"] == sum(json.loads(Path(d, "meta.json").read_text())["num_tokens"]
                                         for d in (first, second))


def metrics(run_dir) -> list:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_a_blended_run_is_the_same_in_any_layout_and_resumes_exactly(small_data, blend_dirs, tmp_path):
    """0.7 : 0.3 for 4 steps on one process, at pp = 2 x dp = 2, and as 2 steps then a resume to 4 at dp = 2: the same
    losses and final weights (the blend is a function of the sample index), and the same losses of each directory;
    the start-up log names the mixture."""
    cfg = small_config(blend_of(small_data, (0.7, blend_dirs[0]), (0.3, blend_dirs[1])), tmp_path / "one", steps=4,
                       gbs=8, log_interval=1, eval_interval=2, eval_iters=3)
    cfg.data.eval = [blend_dirs[1]]
    ref = train_on_ranks(1, cfg)
    assert_same_training(ref, train_on_ranks(4, dataclasses.replace(cfg, run_dir=str(tmp_path / "pp2"), pp=2)))
    for one, pp2 in zip(metrics(cfg.run_dir), metrics(tmp_path / "pp2"), strict=True):
        assert one.keys() == pp2.keys() and any(key.startswith(("loss/", "val_loss/")) for key in one)
        for key in one:
            if key.startswith(("loss/", "val_loss/", "eval_loss/")):
                assert one[key] == pytest.approx(pp2[key], rel=1e-5), key
    half = train_on_ranks(2, dataclasses.replace(cfg, run_dir=str(tmp_path / "resumed"), steps=2))
    rest = train_on_ranks(2, dataclasses.replace(cfg, run_dir=str(tmp_path / "resumed"), resume="auto"))
    assert_same_training(ref, {**rest, "loss": half["loss"] + rest["loss"], "grad_norm": half["grad_norm"] +
                               rest["grad_norm"]})
    log = (tmp_path / "one" / "logs" / "rank0000.log").read_text()
    assert f"data.blend: 0.7 {blend_dirs[0]} (" in log and f"0.3 {blend_dirs[1]} (" in log
    meta = checkpoint.read_meta(ref["checkpoint"])
    assert meta["data"]["blend"] == [f"0.7 {blend_dirs[0]}", f"0.3 {blend_dirs[1]}"]
    assert find_tokenizer(read_checkpoint(ref["checkpoint"])).sha256 == meta["data"]["tokenizer_sha256"]


def test_a_blends_losses_per_directory_are_its_samples_own(small_data, blend_dirs, tmp_path):
    """The last evaluation's loss of each directory (metrics.jsonl's val_loss/<dir>) is F.cross_entropy's mean over
    the tokens of that directory's samples among the eval_iters x gbs validation samples (by the final checkpoint's
    logits, on one process); the evaluation's loss is the mean over all of them; the last step's loss/<dir>, of its
    own batch, likewise by the weights it ran with. At dp = 2 (the losses gathered from both replicas)."""
    import torch
    import torch.nn.functional as F
    from megatron_mini.inference import load_model, logits
    first, second, _ = blend_dirs
    cfg = small_config(blend_of(small_data, (0.6, first), (0.4, second)), tmp_path, steps=2, gbs=8, log_interval=1,
                       eval_interval=2, eval_iters=3, save_interval=1, keep_checkpoints=3)
    history = train_on_ranks(2, cfg)
    train, val, _ = load_datasets(cfg.data, cfg.model.seq_len, cfg.seed, cfg.model.vocab_size)

    def per_directory(checkpoint_path, dataset, first_sample, count):
        model = load_model(read_checkpoint(checkpoint_path))
        rows = torch.from_numpy(np.stack([dataset[first_sample + j] for j in range(count)]))
        token_losses = F.cross_entropy(logits(model, rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten(),
                                       reduction="none").view(count, -1).double()
        which = dataset.which(first_sample, count)
        return {name: token_losses[which == d].mean().item() for d, name in enumerate((first, second))
                if (which == d).any()}, token_losses.mean().item()

    last = metrics(cfg.run_dir)
    evaluation = next(r for r in reversed(last) if "val_loss" in r)
    expected, overall = per_directory(history["checkpoint"], val, 0, cfg.eval_iters * cfg.gbs)
    assert set(expected) == {first, second}
    for name, loss in expected.items():
        assert evaluation[f"val_loss/{name}"] == pytest.approx(loss, rel=1e-5)
    assert evaluation["val_loss"] == pytest.approx(overall, rel=1e-5)
    step2 = next(r for r in last if r["step"] == 2 and "loss" in r)
    expected, overall = per_directory(str(tmp_path / "checkpoints" / "step_000001"), train, cfg.gbs, cfg.gbs)
    assert {key for key in step2 if key.startswith("loss/")} == {f"loss/{name}" for name in expected}
    for name, loss in expected.items():
        assert step2[f"loss/{name}"] == pytest.approx(loss, rel=1e-5)
    assert step2["loss"] == pytest.approx(overall, rel=1e-5)
    log = (tmp_path / "logs" / "rank0000.log").read_text()
    assert f"val loss {evaluation['val_loss']:.4f} ({first} {evaluation[f'val_loss/{first}']:.4f}, {second} " in log


def test_a_resume_with_another_mixture_is_refused(small_data, blend_dirs, tmp_path):
    """The checkpoint's mixture, whole, against the run's: another weight, a plain data.dir, refused (init_from is
    offered, since the model and tokenizer are the same); the same blend, its directories spelled otherwise (a trailing
    slash, ./, an absolute path: the shares and corpora are what count), accepted."""
    cfg = small_config(blend_of(small_data, (0.7, blend_dirs[0]), (0.3, blend_dirs[1])), tmp_path, steps=1, gbs=8)
    path = train_on_ranks(1, cfg)["checkpoint"]
    resume = checkpoint.Resume(path, checkpoint.read_meta(path), [])

    def identity(data):
        return data_identity(data, load_datasets(data, SEQ, 5, small_data.vocab_size))
    for first in (blend_dirs[0], blend_dirs[0] + "/", os.path.relpath(blend_dirs[0])):
        same = blend_of(small_data, (0.7, first), (0.3, blend_dirs[1]))
        checkpoint.check_compatible(resume, dataclasses.replace(cfg, data=same), identity(same))
    for data, new in ((blend_of(small_data, (1, blend_dirs[0]), (1, blend_dirs[1])), f"['0.5 {blend_dirs[0]}', "),
                      (small_data, "data.dir")):
        with pytest.raises(ConfigError, match=re.escape(f"data.blend: ['0.7 {blend_dirs[0]}', '0.3 {blend_dirs[1]}']"
                                                        f" -> {new}")) as err:
            checkpoint.check_compatible(resume, dataclasses.replace(cfg, data=data), identity(data))
        assert str(err.value).endswith(f"(init_from={resume.path} starts it from these weights).")
        assert "corpus_sha256" not in str(err.value)


def test_an_evaluation_set_is_read_the_same_by_every_run(small_data, blend_dirs, tmp_path):
    """data.eval=[dir, tiny] on a run of data.dir: each evaluation also gives eval_loss/<dir>, F.cross_entropy's mean
    over eval_iters x gbs samples of all that directory's documents (by the checkpoint's logits), which are the same
    samples for a run of another data.val_fraction (or seed); the console's val line gives it; a set smaller than an
    evaluation reads (tiny) is noted at start-up."""
    import torch
    import torch.nn.functional as F
    from megatron_mini.dataset import load_eval_sets
    from megatron_mini.inference import load_model, logits
    first, second, _ = blend_dirs
    tiny = tmp_path / "tiny"
    (tmp_path / "tiny_corpus").mkdir()
    (tmp_path / "tiny_corpus" / "a.txt").write_text("def f(x):\n    return x + 1\n" * 12)
    prepare(dataclasses.replace(small_data, source=str(tmp_path / "tiny_corpus"), dir=str(tiny),
                                tokenizer=str(Path(first) / "tokenizer.model")))
    cfg = small_config(small_data, tmp_path / "run", steps=2, gbs=8, eval_interval=2, eval_iters=2)
    cfg.data = dataclasses.replace(small_data, eval=[second, str(tiny)])
    tiny = str(tiny)
    history = train_on_ranks(2, cfg)
    tok = Tokenizer(Path(first) / "tokenizer.model")
    sets = load_eval_sets(cfg.data, cfg.model.seq_len, cfg.model.vocab_size, tok)
    other_seed = load_eval_sets(dataclasses.replace(cfg.data, val_fraction=0.5), cfg.model.seq_len,
                                cfg.model.vocab_size, tok)
    ds = sets[second]
    assert ds.num_docs == json.loads(Path(second, "meta.json").read_text())["num_docs"]
    rows = torch.from_numpy(np.stack([ds[j] for j in range(cfg.eval_iters * cfg.gbs)]))
    assert all(np.array_equal(ds[j], other_seed[second][j]) for j in range(len(rows)))
    model = load_model(read_checkpoint(history["checkpoint"]))
    expected = F.cross_entropy(logits(model, rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten()).item()
    last = [r for r in metrics(cfg.run_dir) if "val_loss" in r]
    assert [r["step"] for r in last] == [0, 2] and all(f"eval_loss/{second}" in r for r in last)
    assert last[-1][f"eval_loss/{second}"] == pytest.approx(expected, rel=1e-5)
    log = (tmp_path / "run" / "logs" / "rank0000.log").read_text()
    assert f"val loss {last[-1]['val_loss']:.4f} | eval {second} {last[-1][f'eval_loss/{second}']:.4f} | eval {tiny} " \
        in log
    note = (f"evaluation: eval_iters 2 x gbs 8 = 16 samples, but data.eval's {tiny} holds {len(sets[tiny])}, so each "
            f"evaluation reads some of them twice or more (it holds less than one batch of 8).")
    assert note in log
    assert "which this run trains on" not in log                      # (trained_eval_notes: none of these)


def test_evaluate_gives_a_checkpoints_logged_losses(small_data, blend_dirs, tmp_path, capsys, monkeypatch):
    """tools/evaluate.py on one process gives the losses a tp=2 run of a blend logged at its last evaluation: the
    validation set's (val_loss: the blend's validation samples) and a data.eval set's (eval_loss/<dir>), over the
    same eval_iters x gbs samples by default; --samples 0 reads a set's epoch (thousands of samples: here --batch 64
    at a time, not the default, the run's mbs of 2). The run's relative paths are found from the repository root too;
    a data.eval set removed since is a note. A directory of another tokenizer, or a run directory whose data was
    rebuilt, is one error line."""
    import evaluate
    from megatron_mini import inference
    from megatron_mini.inference import evaluation_sets, load_model, mean_losses
    first, second, own = blend_dirs
    code = own_config(small_data, second)
    cfg = small_config(blend_of(code, (0.5, first), (0.5, second)), tmp_path / "run", steps=2, gbs=8,
                       eval_interval=2, eval_iters=2, tp=2)
    cfg.data.eval = [second]
    history = train_on_ranks(2, cfg)
    logged = next(r for r in reversed(metrics(cfg.run_dir)) if "val_loss" in r)
    ckpt = read_checkpoint(history["checkpoint"])
    tok = find_tokenizer(ckpt)
    model = load_model(ckpt)
    sets, notes = evaluation_sets(ckpt, tok, [])
    assert list(sets) == ["validation", second] and not notes
    assert list(evaluation_sets(ckpt, tok, [second])[0]) == [second]
    names = [first, second]
    val = mean_losses(model, sets["validation"], cfg.eval_iters * cfg.gbs, 3, names)
    assert val == pytest.approx({None: logged["val_loss"], **{d: logged[f"val_loss/{d}"] for d in names}}, rel=1e-5)
    evals = mean_losses(model, sets[second], cfg.eval_iters * cfg.gbs, 5, names)
    assert evals == pytest.approx({None: logged[f"eval_loss/{second}"]}, rel=1e-5)
    assert evaluate.main([cfg.run_dir, "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"validation: loss {logged['val_loss']:.4f} ({first} {logged[f'val_loss/{first}']:.4f}, "
                             f"{second} {logged[f'val_loss/{second}']:.4f}) | perplexity ") and \
        "| 16 samples of 32 " in out[0]
    assert out[1].startswith(f"{second}: loss {logged[f'eval_loss/{second}']:.4f} | ") and len(out) == 2
    # every validation sample: the blend's directories whole (its epoch ends before)
    assert evaluate.main([cfg.run_dir, "--samples", "0", "--batch", "64", "--device", "cpu"]) == 0
    out = capsys.readouterr().out.splitlines()
    parts = sets["validation"].datasets
    assert [line.split(": loss ")[0] for line in out] == [f"validation ({first})", f"validation ({second})", second]
    for line, part in zip(out, parts):
        assert f"| {len(part):,} samples of 32 tokens (its epoch)" in line, line
    whole = mean_losses(model, parts[0], len(parts[0]), 16)[None]          # (the other's loss: the same code)
    assert out[0].startswith(f"validation ({first}): loss {whole:.4f} | "), out[0]
    blend = sets["validation"]                             # (its epoch leaves a directory part read)
    assert any((blend.which(0, len(blend)) == d).sum() < len(part) for d, part in enumerate(parts))
    assert evaluate.main([history["checkpoint"], second, "--samples", "0", "--batch", "64", "--device", "cpu"]) == 0
    epoch = len(evaluation_sets(ckpt, tok, [second])[0][second])
    assert f"{second}: loss " in (out := capsys.readouterr().out) and f"| {epoch:,} samples of 32 tokens (its epoch)" \
        in out
    assert evaluate.main([cfg.run_dir, own, "--device", "cpu"]) == 2
    err = capsys.readouterr().err                      # (its arguments, not data.eval, must share the run's)
    assert f"error: {own}/tokenizer.model: is another tokenizer" in err and "): the directories evaluate.py reads " \
        "and the run's must share one, so that a token id means the same text in each; prepare " in err, err
    assert evaluate.main([cfg.run_dir, second, second + "/", "--device", "cpu"]) == 2
    assert capsys.readouterr().err.endswith(f"\nerror: evaluate.py's DIRS names {second} twice (as {second} and "
                                            f"{second}/): give each prepared directory once.\n")   # (not data.eval)
    root = os.path.commonpath([first, second])             # (a run launched there, read from elsewhere: its
    monkeypatch.setattr(inference, "REPO", root)           # relative paths are found as its tokenizer is)
    monkeypatch.chdir(tmp_path)
    trained = ckpt.cfg.data
    ckpt.cfg.data = blend_of(dataclasses.replace(code, eval=[os.path.relpath(second, root)]),
                             (0.5, os.path.relpath(first, root)), (0.5, os.path.relpath(second, root)))
    relative, notes = evaluation_sets(ckpt, tok, [])
    assert list(relative) == ["validation", os.path.relpath(second, root)] and not notes
    assert mean_losses(model, relative["validation"], cfg.eval_iters * cfg.gbs, 3, names)[None] == val[None]
    ckpt.cfg.data = dataclasses.replace(trained, eval=[second, str(tmp_path / "gone")])   # (a set removed since)
    sets, notes = evaluation_sets(ckpt, tok, [])
    assert list(sets) == ["validation", second]
    assert len(notes) == 1 and notes[0].startswith(f"not evaluated: {tmp_path}/gone: no such directory")
    ckpt.cfg.data = rebuilt = blend_of(code, (0.7, first), (0.3, second))   # (another mixture than it records)
    with pytest.raises(DataError, match=re.escape(f"data.blend={rebuilt.blend}: is not the data {ckpt.path} was "
                                                  f"trained on (another corpus_sha256, tokens_fingerprint than it "
                                                  f"records")):
        evaluation_sets(ckpt, tok, [])


def test_a_resume_notes_an_evaluation_set_that_changed_corpus(small_data, blend_dirs, tmp_path):
    """A data.eval directory rebuilt from another corpus between a save and its resume: the resumed run goes on (the
    sets may change) and its log says that the set's eval_loss changes meaning there; the same corpus says nothing.
    So does a resume that evaluates another number of samples (eval_iters x gbs), and not one that reads the same."""
    first, second, _ = blend_dirs
    ev = tmp_path / "ev"
    shutil.copytree(second, ev)
    cfg = small_config(small_data, tmp_path / "run", steps=2, gbs=8, eval_interval=2, eval_iters=1)
    cfg.data = dataclasses.replace(small_data, eval=[str(ev)])
    train_on_ranks(1, cfg)
    log = tmp_path / "run" / "logs" / "rank0000.log"
    cfg.steps, cfg.resume = 3, "auto"
    train_on_ranks(1, cfg)
    assert "resume: data.eval" not in log.read_text()
    shutil.rmtree(ev)
    shutil.copytree(first, ev)                               # (rebuilt from another corpus, the same tokenizer)
    cfg.steps = 4
    train_on_ranks(1, cfg)
    sha = json.loads((ev / "meta.json").read_text())["corpus_sha256"]
    was = json.loads(Path(second, "meta.json").read_text())["corpus_sha256"]
    assert (f"resume: data.eval: {ev} holds another corpus (sha256 {sha[:12]}) than the one evaluated up to step 3 "
            f"({was[:12]}): its eval_loss/{ev} from here on is not comparable with before") in log.read_text()
    assert "resume: evaluation:" not in log.read_text()
    cfg.steps, cfg.eval_iters, cfg.gbs = 5, 2, 4                  # (another gbs, the same samples: no note)
    train_on_ranks(1, cfg)
    assert "resume: evaluation:" not in log.read_text()
    cfg.steps, cfg.eval_iters = 6, 3                              # (more of them: the val_loss of another sample)
    train_on_ranks(1, cfg)
    assert log.read_text().count("resume: evaluation: eval_iters x gbs = 3 x 4 = 12 samples of each set, 8 up to "
                                 "step 5: its val_loss (and eval_loss) from here on is the mean of another sample") == 1


def test_an_evaluation_set_a_run_never_evaluates_is_noted(small_data, blend_dirs, tmp_path):
    """data.eval at eval_interval=0: its directories are checked (a bad one refused), then never read, which the
    start-up log says (it said nothing)."""
    _, second, _ = blend_dirs
    cfg = small_config(small_data, tmp_path, steps=1, gbs=8, eval_interval=0)
    cfg.data = dataclasses.replace(small_data, eval=[second])      # (not small_data itself: other tests share it)
    assert train_on_ranks(1, cfg)["val_loss"] == []
    log = (tmp_path / "logs" / "rank0000.log").read_text()
    assert log.count(f"note: eval_interval=0 evaluates nothing, so data.eval's {second} (checked) are never read") \
        == 1


def test_an_evaluation_set_of_training_data_is_noted(small_data, blend_dirs, tmp_path):
    """data.eval naming a directory the run trains on (data.dir, a blend's directory, or a copy of either: the same
    corpus sha256) is a start-up line for each such set, naming the directory trained on; another corpus is none."""
    from megatron_mini.dataset import trained_eval_notes
    first, second, _ = blend_dirs
    shutil.copytree(first, tmp_path / "copy")
    copy = str(tmp_path / "copy")

    def note(d, trained):
        return (f"data.eval: {d} holds the corpus of {trained}, which this run trains on (all but its validation "
                f"part): its eval_loss is mostly a training loss, not a held-out one")
    plain = dataclasses.replace(small_data, eval=[second, copy, first])
    assert trained_eval_notes(plain) == [note(copy, first), note(first, first)]
    assert trained_eval_notes(dataclasses.replace(plain, eval=[second])) == []
    blend = dataclasses.replace(blend_of(small_data, (1, second), (1, copy)), eval=[second, first])
    assert trained_eval_notes(blend) == [note(second, second), note(first, copy)]
    meta = json.loads((tmp_path / "copy" / "meta.json").read_text())
    del meta["corpus_sha256"]                # (a meta.json written by hand: no corpus is known to be another's)
    (tmp_path / "copy" / "meta.json").write_text(json.dumps(meta))
    shutil.copytree(copy, tmp_path / "copy2")
    assert trained_eval_notes(dataclasses.replace(blend, eval=[str(tmp_path / "copy2")])) == []


def test_an_evaluation_set_is_refused_as_a_blends_directory_would_be(small_data, blend_dirs, tmp_path):
    first, second, own = blend_dirs
    for eval_dirs, error in (([], r"data\.eval=\[\] names no directory"),
                             ([second, second + "/"], rf"data\.eval names {re.escape(second)} twice"),
                             ([" "], r"data\.eval names an empty directory")):
        with pytest.raises(ConfigError, match=error):
            dataclasses.replace(small_data, eval=eval_dirs).eval_dirs()
    from megatron_mini.dataset import load_eval_sets
    tok = Tokenizer(Path(first) / "tokenizer.model")
    with pytest.raises(DataError, match=re.escape(f"{own}/tokenizer.model: is another tokenizer (sha256 ")) as err:
        load_eval_sets(dataclasses.replace(small_data, eval=[own]), SEQ, small_data.vocab_size, tok)
    assert str(err.value).endswith(f"the directories of data.eval must share one, so that a token id means the same "
                                   f"text in each; prepare {json.loads(Path(own, 'meta.json').read_text())['source']} "
                                   f"with data.tokenizer={first}/tokenizer.model in a data.dir of its own and evaluate "
                                   f"that")
    with pytest.raises(DataError, match=re.escape(f"{tmp_path}/tokenizer.model: missing; rebuild it with: python "
                                                  f"tools/prepare_data.py data.source='<corpus>' data.dir={tmp_path} "
                                                  f"data.vocab_size={small_data.vocab_size} "
                                                  f"data.tokenizer={tok.path}")):
        load_eval_sets(dataclasses.replace(small_data, eval=[str(tmp_path)]), SEQ, small_data.vocab_size, tok)


def test_an_evaluation_set_shorter_than_one_sample_is_refused(small_data, tmp_path):
    """A data.eval directory whose documents hold fewer tokens than one sample (seq_len + 1) is one DataError naming
    its tokens file, before any process group (prepare_run), not GPTDataset's ValueError as a traceback."""
    from megatron_mini.dataset import load_eval_sets
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("x = 1\n")
    short = dataclasses.replace(small_data, source=str(tmp_path / "corpus"), dir=str(tmp_path / "short"),
                                tokenizer=str(Path(small_data.dir) / "tokenizer.model"))
    prepare(short)
    tokens = json.loads(Path(short.dir, "meta.json").read_text())["num_tokens"]
    assert tokens < SEQ + 1
    tok = Tokenizer(Path(small_data.dir) / "tokenizer.model")
    with pytest.raises(DataError) as err:
        load_eval_sets(dataclasses.replace(small_data, eval=[short.dir]), SEQ, small_data.vocab_size, tok)
    text = str(err.value)
    assert text.startswith(f"{short.dir}/") and f"1 document holds {tokens:,} tokens, fewer than one sample" in text, \
        text
    assert text.endswith("an evaluation set needs at least one sample") and "\n" not in text, text


@pytest.mark.parametrize("blend, error", [
    (["1", "A", "1"], r"data\.blend=\['1', 'A', '1'\] must be weight, directory pairs, as in data\.blend=\[0\.7,"),
    ([], r"data\.blend=\[\] must be weight, directory pairs"),
    (["A", "1"], r"data\.blend: 'A' stands where a weight must \(a number > 0\)"),
    (["0", "A"], r"data\.blend: the weight 0 must be > 0"),
    (["-1", "A", "2", "B"], r"data\.blend: the weight -1 must be > 0"),
    (["nan", "A"], r"data\.blend: 'nan' stands where a weight must"),
    (["1", "A", "2", "./A/"], r"data\.blend names A twice \(as A and \./A/\): give each prepared directory once"),
    (["1", " "], r"data\.blend names an empty directory"),
], ids=["odd", "empty", "no-weight", "zero", "negative", "nan", "twice", "empty-dir"])
def test_a_blend_that_is_no_mixture_is_refused_in_one_line(small_data, blend, error):
    with pytest.raises(ConfigError, match=error):
        dataclasses.replace(small_data, blend=blend).parts()


@pytest.mark.parametrize("keys, command", [
    ({"source": "c.jsonl"}, "data.source=c.jsonl"),
    ({"text_key": "content"}, "data.text_key=content"),
    ({"source": "c.jsonl", "text_key": "content"}, "data.source=c.jsonl data.text_key=content"),
    ({"source": "c.jsonl", "tokenizer": "t.model"}, "data.source=c.jsonl"),
], ids=["source", "text_key", "two", "with-tokenizer"])
def test_a_corpus_to_prepare_beside_a_blend_is_refused(small_data, keys, command):
    """A blend reads directories already prepared: data.source, data.text_key or data.tokenizer beside it would be
    silently unread (train.py trained on the blend alone), so the check train.py and prepare_data.py share refuses
    them, naming the command that prepares the corpus with the blend's tokenizer; without a blend they pass."""
    cfg = small_config(blend_of(small_data, (1, "data/web/"), (1, "data/code")), "run")
    check_ranges(cfg, "data.")
    with pytest.raises(ConfigError) as err:
        check_ranges(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **keys)), "data.")
    unread = " and ".join(f"data.{k}={v}" for k, v in keys.items())
    assert str(err.value) == (f"data.blend mixes directories already prepared, and reads no corpus: {unread} would be "
                              f"unread. Prepare that corpus on its own first (tools/prepare_data.py {command} "
                              f"data.dir=DIR data.tokenizer=data/web/tokenizer.model), then add DIR to the blend.")
    check_ranges(dataclasses.replace(cfg, data=dataclasses.replace(small_data, **keys)), "data.")


def test_a_tokenizer_beside_a_blend_is_refused(small_data):
    """data.tokenizer alone beside a blend names no corpus to prepare: its directories' own tokenizer is the one a
    blend reads, so the refusal says to leave it out (not a command that would prepare the default corpus)."""
    cfg = small_config(blend_of(small_data, (1, "data/web/"), (1, "data/code")), "run")
    with pytest.raises(ConfigError) as err:
        check_ranges(dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer="t.model")), "data.")
    assert str(err.value) == ("data.blend mixes directories already prepared, each with the tokenizer it was encoded "
                              "with (one for all): data.tokenizer=t.model would be unread; leave it out.")


def test_a_directory_is_named_alike_however_it_is_spelled(small_data):
    """parts() and eval_dirs() give each directory one name, whatever its spelling ("./A/" is "A"): the keys of its
    metrics (loss/<dir>, val_loss/<dir>, eval_loss/<dir>) stay the same series when a resume spells it otherwise."""
    for spelled in ("A", "./A/", "A//", " ./A "):
        cfg = dataclasses.replace(small_data, blend=["1", spelled, "3", "/x/./B/"], eval=[spelled, "/x/B/."])
        assert cfg.parts() == [(Fraction(1, 4), "A"), (Fraction(3, 4), "/x/B")]
        assert cfg.eval_dirs() == ["A", "/x/B"]
    assert dataclasses.replace(small_data, blend=["1", "a/../b"]).parts() == [(1, "a/../b")]   # (a may be a link)


def test_directories_that_cannot_be_blended_are_refused_with_what_to_do(small_data, blend_dirs, tmp_path):
    """Another tokenizer (prepare it with the first's: data.tokenizer), of another vocabulary too (not: raise the
    vocabulary), a directory that is no build (its prepare command, with the first's tokenizer), a weight that rounds
    to no sample."""
    first, second, own = blend_dirs
    with pytest.raises(DataError, match=re.escape(f"{own}/tokenizer.model: is another tokenizer (sha256 ")) as err:
        load_datasets(blend_of(small_data, (1, first), (1, own)), SEQ, 5, small_data.vocab_size)
    source = json.loads(Path(own, "meta.json").read_text())["source"]
    assert str(err.value).endswith(f"must share one, so that a token id means the same text in each; prepare "
                                   f"{source} with data.tokenizer={first}/tokenizer.model in a data.dir of its own "
                                   f"and blend that")
    other = tmp_path / "v1024"
    prepare(dataclasses.replace(small_data, dir=str(other), source=source, vocab_size=1024, tokenizer=None))
    with pytest.raises(DataError, match=re.escape(f"{other}/tokenizer.model: is another tokenizer (sha256 ")) as err:
        load_datasets(blend_of(small_data, (1, first), (1, other)), SEQ, 5, small_data.vocab_size)
    assert f", 1024 tokens) than {first}/tokenizer.model" in str(err.value) and "data.dir=" not in str(err.value)
    missing = tmp_path / "nothing"
    never = f"{missing}: no such directory (a mistyped path, or data not prepared there yet); prepare it with: python "
    with pytest.raises(DataError, match=re.escape(
            f"{never}tools/prepare_data.py data.source='<corpus>' data.dir={missing} data.vocab_size="
            f"{small_data.vocab_size} data.tokenizer={first}/tokenizer.model")):       # (the run's tokenizer)
        load_datasets(blend_of(small_data, (1, first), (1, missing)), SEQ, 5, small_data.vocab_size)
    with pytest.raises(DataError, match=re.escape(f"{never}tools/prepare_data.py data.source='<corpus>' "
                                                  f"data.dir={missing} data.vocab_size={small_data.vocab_size}")) \
            as err:
        load_datasets(blend_of(small_data, (1, missing), (1, first)), SEQ, 5, small_data.vocab_size)
    assert "data.tokenizer=" not in str(err.value)                                     # (the first: its own)
    missing.mkdir()                                     # (there, but empty: rebuilt with the first's tokenizer)
    with pytest.raises(DataError, match=re.escape(f"{missing}/tokenizer.model: missing; rebuild it with: python "
                                                  f"tools/prepare_data.py data.source='<corpus>' data.dir={missing} "
                                                  f"data.vocab_size={small_data.vocab_size} data.tokenizer={first}/")):
        load_datasets(blend_of(small_data, (1, first), (1, missing)), SEQ, 5, small_data.vocab_size)
    with pytest.raises(ConfigError, match=r"data\.blend=.*: a weight of 1\.00e-09 of the total rounds to no sample"):
        load_datasets(blend_of(small_data, (1, first), (1e-9, second)), SEQ, 5, small_data.vocab_size)


class Directory(Indices):
    """Indices of `n` samples that name a directory as a GPTDataset does (indexed.bin_path)."""

    def __init__(self, n: int, name: str):
        super().__init__(n)
        self.indexed = type("Indexed", (), {"bin_path": Path(name) / "tokens.bin"})()


def test_the_start_up_line_names_the_directory_that_repeats_first():
    """0.9 : 0.1 of 1000 samples each: A's are spent after about 1000 / 0.9 = 1111 samples of the blend, B's after
    10,000; the line names A (its length times its share would name B)."""
    blend = BlendedDataset([Directory(1000, "A"), Directory(1000, "B")], shares(9, 1))
    assert 1000 / 0.9 - 1 <= len(blend) <= 1000 / 0.9 + 1
    assert blend_note(blend) == (f"data.blend: 0.9 A (1,000 samples an epoch), 0.1 B (1,000 samples an epoch); "
                                 f"{len(blend):,} samples of the blend read each once, then A repeats first")


def test_a_corpus_is_blended_once(small_data, blend_dirs, tmp_path):
    """The same directory through a link, or a copy of it under another name (the same corpus sha256): every sample
    would be read twice in a row (one split, one shuffle). Both refused."""
    first, second, _ = blend_dirs
    (tmp_path / "link").symlink_to(second)
    with pytest.raises(ConfigError, match=rf"data\.blend names {re.escape(second)} twice \(as {re.escape(second)} "
                                          rf"and {re.escape(str(tmp_path / 'link'))}\)"):
        validate(small_config(blend_of(small_data, (1, first), (1, second), (1, tmp_path / "link")), tmp_path), 1)
    shutil.copytree(second, tmp_path / "copy")
    with pytest.raises(DataError, match=rf"data\.blend: {re.escape(str(tmp_path / 'copy'))}: holds the corpus of "
                                        rf"{re.escape(second)} \(the same sha256\): give each corpus once"):
        load_datasets(blend_of(small_data, (1, second), (1, tmp_path / "copy")), SEQ, 5, small_data.vocab_size)
    unknown = []                             # two corpora whose meta.json records no sha256 (by hand): not one corpus
    for d in (first, second):
        shutil.copytree(d, tmp_path / f"no-sha-{len(unknown)}")
        unknown.append(tmp_path / f"no-sha-{len(unknown)}")
        meta = json.loads((unknown[-1] / "meta.json").read_text())
        del meta["corpus_sha256"]
        (unknown[-1] / "meta.json").write_text(json.dumps(meta))
    train, _, _ = load_datasets(blend_of(small_data, (1, unknown[0]), (1, unknown[1])), SEQ, 5, small_data.vocab_size)
    assert len(train.datasets) == 2


def test_a_name_through_a_links_parent_is_another_directory(small_data, tmp_path):
    """link/../x and x, where link is a link to real/sub: two directories (real/x and x), which data.blend and data.eval
    each take, by name (a checkpoint's config, read anywhere) and on this file system (a run), as the names a run's
    metrics use (config._spelled keeps "..", a link may stand before it); "x" and "./x/" are one, refused by name."""
    for d in ("x", "real/sub", "real/x"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "real" / "sub")
    dirs = [f"{tmp_path}/link/../x", f"{tmp_path}/x"]
    assert len({os.path.realpath(d) for d in dirs}) == 2
    data = dataclasses.replace(small_data, blend=["1", dirs[0], "1", dirs[1]], eval=dirs)
    assert [d for _, d in data.parts()] == data.eval_dirs() == dirs
    data.check_dirs_on_disk()
    with pytest.raises(ConfigError, match=r"data\.eval names .*/x twice"):
        dataclasses.replace(small_data, eval=[dirs[1], f"{tmp_path}/./x/"]).eval_dirs()


def test_the_tools_read_a_checkpoint_whose_data_paths_are_others_here(small_data, blend_dirs, tmp_path, capsys):
    """A blend's checkpoint (data.blend and data.eval of two directories) read on a machine where those paths are
    absent, or where they are one directory (here links to one): generate.py and export_hf.py read no data and
    evaluate.py reads the directories it is given, so each runs as on the run's machine; before, the tools compared
    the saved paths on this machine's file system (check_ranges) and refused the checkpoint ("data.blend names ...
    twice"). A run on this machine is still refused such a blend."""
    import evaluate
    import export_hf
    import generate
    data = tmp_path / "data"
    for name, directory in (("a", blend_dirs[0]), ("b", blend_dirs[1])):
        shutil.copytree(directory, data / name)
    a, b = str(data / "a"), str(data / "b")
    cfg = small_config(dataclasses.replace(blend_of(small_data, (1, a), (1, b)), eval=[a, b]), tmp_path / "run",
                       steps=1, gbs=2, **{"model.num_layers": 2})
    moved = tmp_path / "elsewhere" / "step_000001"
    shutil.copytree(train_on_ranks(1, cfg)["checkpoint"], moved)
    shutil.rmtree(data)
    data.mkdir()
    for case in ("absent", "one directory"):
        if case == "one directory":
            (data / "a").symlink_to(blend_dirs[0])
            (data / "b").symlink_to(blend_dirs[0])
            with pytest.raises(ConfigError, match=rf"data\.blend names {re.escape(a)} twice"):
                validate(cfg, 1)                                  # (train.py's first check)
        assert generate.main([str(moved), "--prompt", "def", "--max-new-tokens", "2", "--device", "cpu"]) == 0, case
        assert export_hf.main([str(moved), str(tmp_path / case / "hf")]) == 0, case
        assert evaluate.main([str(moved), blend_dirs[1], "--samples", "2", "--device", "cpu"]) == 0, case
        assert "error" not in capsys.readouterr().err, case


def test_a_damaged_sample_names_its_directory_and_its_own_index(small_data, blend_dirs, tmp_path):
    """An id past the vocabulary in the second directory's tokens.bin: the DataError names that file, the blend's
    sample and the directory's, and the command that rebuilds that directory (with the tokenizer it was given). (A
    build of before meta.json recorded its tokens_fingerprint, or one damaged between the blocks that it reads: its
    ids are checked as they are read.)"""
    first, second, _ = blend_dirs
    copy = tmp_path / "code"
    shutil.copytree(second, copy)
    meta = json.loads((copy / "meta.json").read_text())
    del meta["tokens_fingerprint"]
    (copy / "meta.json").write_text(json.dumps(meta))
    cfg = blend_of(small_data, (0.7, first), (0.3, copy))
    train = load_datasets(cfg, SEQ, 5, small_data.vocab_size)[0]
    tokens = np.memmap(copy / "tokens.bin", dtype=np.uint16, mode="r+")

    def place(i, tokens):
        """Where in `tokens` (the copy's tokens.bin) the blend's sample i is, if it is the second directory's and
        no other place holds its tokens (a run of one token, a passage the corpus repeats: Python 3.13's standard
        library has such a sample)."""
        part, j = train.locate(i)
        row = part[j]
        where = [k for k in np.flatnonzero(tokens[:len(tokens) - len(row)] == row[0])
                 if np.array_equal(tokens[k:k + len(row)], row)]
        return where[0] if part is train.datasets[1] and len(where) == 1 else None

    i, k = next((i, k) for i in range(3, 20) if (k := place(i, tokens)) is not None)
    j = train.locate(i)[1]
    tokens[k + 3] = 60000
    tokens.flush()
    del tokens
    train = load_datasets(cfg, SEQ, 5, small_data.vocab_size)[0]
    check_token_ids(train, 0, i, small_data.vocab_size, cfg)          # (the samples before it are clean)
    with pytest.raises(DataError) as err:
        check_token_ids(train, 0, 20, small_data.vocab_size, cfg)
    source = json.loads((copy / "meta.json").read_text())["source"]
    assert str(err.value).startswith(f"{copy}/tokens.bin: holds token id 60000, outside the vocabulary of "
                                     f"{small_data.vocab_size} (in sample {i} of the blend, its sample {j}); rebuild "
                                     f"it with: python tools/prepare_data.py data.source={source} data.dir={copy} "
                                     f"data.vocab_size={small_data.vocab_size} ")
    assert str(err.value).endswith(f" data.tokenizer={Path(first, 'tokenizer.model').resolve()}")


def test_prepare_data_checks_a_blend_and_builds_nothing(small_data, blend_dirs, tmp_path):
    """tools/prepare_data.py with data.blend (as `make train` runs it first) prints the mixture, or refuses a
    directory that is not ready, exit 2, building nothing."""
    first, second, own = blend_dirs
    args = [sys.executable, str(REPO / "tools" / "prepare_data.py"), f"data.vocab_size={small_data.vocab_size}",
            "model.seq_len=32"]
    ok = subprocess.run(args + [f"data.blend=[0.7,{first},0.3,{second}]"], capture_output=True, text=True, cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(f"data.blend: 0.7 {first} (") and "repeats first" in ok.stdout
    blend = f"data.blend=[0.7,{first},0.3,{second}]"
    for extra, error in (([f"data.blend=[0.7,{first},0.3,{own}]"], f"error: {own}/tokenizer.model: is another "
                                                                    f"tokenizer"),
                         ([blend, "model.seq_len=0"], "error: model.seq_len=0 must be >= 1."),
                         ([blend, "seed=-1"], "error: seed=-1 must be in [0, 2**32)."),
                         ([blend, f"data.source={tmp_path}"], "error: data.blend mixes directories already "
                                                              f"prepared, and reads no corpus: data.source={tmp_path} "
                                                              f"would be unread.")):
        bad = subprocess.run(args + extra, capture_output=True, text=True, cwd=tmp_path)
        assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and bad.stderr.startswith(error), bad.stderr
    assert list(tmp_path.iterdir()) == []
