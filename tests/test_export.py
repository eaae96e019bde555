"""megatron_mini.inference / megatron_mini.hf and their command lines (tools/generate.py, tools/export_hf.py,
tools/evaluate.py): a checkpoint of any layout, exported to a Hugging Face GPT2LMHeadModel, gives megatron_mini's
logits (fp32: max abs diff <= 1e-5; fp64: 1e-12 of the largest) and validation loss; greedy decoding gives
transformers' generate() tokens; the KV cache gives the full forward's logits and tokens."""
import copy
import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")

from ranks import spawn  # noqa: E402
from harness import small_config, train_on_ranks  # noqa: E402
from megatron_mini import inference  # noqa: E402
from megatron_mini import model as model_module  # noqa: E402
from megatron_mini.config import ModelConfig  # noqa: E402
from megatron_mini.mesh import ParallelMesh  # noqa: E402
from megatron_mini.model import KVCache, ParallelContext, build_chunks  # noqa: E402
from megatron_mini.rng import RNGTracker  # noqa: E402

import export_hf  # noqa: E402   (tools/, on pytest's pythonpath: the command lines' main(), in process)
import generate  # noqa: E402

PROMPT = "def main(args):\n    "


LAYOUTS = {"tp1": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}


@pytest.fixture(scope="module")
def exported(small_data, tmp_path_factory):
    """{layout: (Checkpoint, HF model, Tokenizer)}: 3-step runs of LAYOUTS, each exported and loaded.
    vocab_pad_multiple=96 pads the 512-token vocabulary to 576 rows."""
    runs = {}
    for name, layout in LAYOUTS.items():
        root = tmp_path_factory.mktemp(f"export_{name}")
        cfg = small_config(small_data, root / "run", steps=3, **layout, **{"model.vocab_pad_multiple": 96})
        history = train_on_ranks(cfg.tp * cfg.pp, cfg)
        out = root / "hf"
        assert export_hf.main([history["checkpoint"], str(out)]) == 0
        model, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True,
                                                                   local_files_only=True)
        assert not any(info.values()), info
        modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
        assert len(set(modes.values())) == 1, modes                      # the weights too (safetensors made them 0600)
        ckpt = inference.read_checkpoint(history["checkpoint"])
        assert ckpt.meta["layout"] == {"tp": cfg.tp, "pp": cfg.pp, "dp": 1}
        tok = inference.find_tokenizer(ckpt)
        assert (out / "tokenizer.model").read_bytes() == tok.path.read_bytes()
        runs[name] = ckpt, model.eval(), tok
    return runs


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_matches_megatron_logits(exported, layout):
    """The export of a tp=2, a pp=2 and a one-device run, of a padded vocabulary: GPT-2's config (context, GELU's
    tanh form "gelu_new", LayerNorm epsilon, tied embeddings) and weights give megatron_mini's logits, in fp32 (max
    abs diff <= 1e-5) and in fp64 (both models cast: <= 1e-12 of the largest logit, 6.7e-16 measured; when our fp64
    logits were returned as fp32 the bound was 1e-6, 3.6e-8 measured; an export as "gelu", erf's GELU, was 4.5e-6 there
    and 3.8e-6 in fp32, under fp32's bound)."""
    ckpt, hf, tok = exported[layout]
    m = ckpt.cfg.model
    assert hf.config.vocab_size == m.vocab_size < m.padded_vocab_size == hf.config.megatron_mini["padded_vocab_size"]
    assert hf.config.eos_token_id == hf.config.bos_token_id == tok.eos_id
    assert (hf.config.n_positions, hf.config.layer_norm_epsilon, hf.config.activation_function) == \
        (m.seq_len, m.ln_eps, "gelu_new")
    assert hf.config.megatron_mini["layout"] == {"tp": ckpt.cfg.tp, "pp": ckpt.cfg.pp, "dp": 1, "vpp": 1, "sp": False,
                                                 "zero": 0, "embedding_stage": "none"}     # the whole layout trained
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr(), "embeddings are not tied"
    ids = torch.randint(0, m.vocab_size, (3, m.seq_len), generator=torch.Generator().manual_seed(0))
    text = torch.tensor([tok.encode(PROMPT * 4)[:m.seq_len]])
    model = inference.load_model(ckpt)
    model64, hf64 = copy.deepcopy(model).double(), copy.deepcopy(hf).double()
    for batch in (ids, text, text[:, :5]):
        ours = inference.logits(model, batch)
        with torch.no_grad():
            theirs, theirs64 = hf(batch).logits, hf64(batch).logits
        assert ours.shape == theirs.shape == (*batch.shape, m.vocab_size)
        diff = (ours - theirs).abs().max().item()
        assert diff <= 1e-5, f"logits differ by {diff:.2e}"
        rel = _rel_err(inference.logits(model64, batch), theirs64)
        assert rel <= 1e-12, f"fp64 logits differ by {rel:.2e} of the largest"
    labels = ids.roll(-1, dims=1)
    with torch.no_grad():
        losses = model(ids, labels)  # the training path: the Head's vocab-parallel cross-entropy, each sample's sum [b]
    expected = F.cross_entropy(inference.logits(model, ids).flatten(0, 1), labels.flatten(), reduction="none")
    expected = expected.view(ids.shape).sum(-1)
    assert losses.shape == expected.shape == (len(ids),), losses.shape
    assert torch.allclose(losses, expected, rtol=1e-6), (losses.tolist(), expected.tolist())


def test_greedy_generation_matches_hf():
    """Greedy decoding with the KV cache = without it = transformers' generate(do_sample=False) of the model as
    exported (hf_state_dict, hf_config), both in fp64, token for token: from a prompt of one token, of seq_len - 1
    and between, two samples at once, up to the token predicted from a full window (seq_len - len(prompt) + 1) or
    to the EOS (here id 0), which ends both. One
    more would be at position seq_len, past GPT-2's learned positions: transformers' generate fails there (an
    IndexError in its position embedding), ours goes on with a shorter window (test_kv_cache_greedy_matches_full_
    forward). The padded rows' logits, 50 times larger than any real one's were they kept, are never picked."""
    from megatron_mini.config import TrainConfig
    from megatron_mini.hf import hf_config, hf_state_dict
    model = _lively_model().double()
    m = _model_config()
    ckpt = inference.Checkpoint("random", {}, TrainConfig(model=m),
                                {name: p.detach() for name, p in model.named_global_parameters()})
    config = {k: v for k, v in hf_config(ckpt, eos_id=0, dtype=torch.float64).items() if k != "megatron_mini"}
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)).double().eval()
    assert hf.load_state_dict(hf_state_dict(ckpt, torch.float64), strict=False).missing_keys == ["lm_head.weight"]
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()
    ended = []
    for prompt in ([5], [1, 7, 3, 5, 2], list(range(40, 40 + m.seq_len - 1))):
        n = m.seq_len - len(prompt) + 1
        ours = inference.generate(model, prompt, n, temperature=0, num_samples=2, eos_id=0)
        assert ours == inference.generate(model, prompt, n, temperature=0, num_samples=2, eos_id=0, kv_cache=False)
        out = hf.generate(torch.tensor([prompt] * 2), max_new_tokens=n, do_sample=False, pad_token_id=0)
        assert ours == out[:, len(prompt):].tolist(), (prompt, ours[0], out[0, len(prompt):].tolist())
        ended.append(len(ours[0]) < n)
    assert ended == [False, True, False]             # (two decode up to the full window, one ends at its EOS)
    assert len(set(inference.generate(model, [5], m.seq_len, temperature=0)[0])) >= 5
    with pytest.raises(IndexError):
        hf.generate(torch.tensor([prompt]), max_new_tokens=n + 1, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("dtype, name, epsilon", [(torch.bfloat16, "bf16", 2 ** -8), (torch.float16, "fp16", 2 ** -11)],
                         ids=["bf16", "fp16"])
def test_a_model_loaded_in_half_precision(exported, dtype, name, epsilon, monkeypatch, capsys):
    """load_model(dtype=...) (generate.py and evaluate.py --dtype): no weight is initialised first, every one is
    the checkpoint's fp32 tensor rounded to `dtype`, the tied embedding one tensor; the fp32 logits are the fp32
    model's to within a few roundings of the type (<= 4 eps of the largest logit: 1.4 eps measured for bf16, 1.1
    for fp16), and generate.py --dtype greedy-decodes what that model decodes in process."""
    ckpt, _, tok = exported["tp2"]
    monkeypatch.setattr(model_module, "initialize", lambda *a: pytest.fail("load_model initialised the weights"))
    model = inference.load_model(ckpt, dtype=dtype)
    params = dict(model.named_global_parameters())
    assert params.keys() == ckpt.tensors.keys()
    for global_name, p in params.items():
        assert p.dtype == dtype and torch.equal(p, ckpt.tensors[global_name].to(dtype)), global_name
    assert model.layers[0].word_embeddings.weight is model.layers[-1].word_embeddings
    ids = torch.randint(0, ckpt.cfg.model.vocab_size, (3, ckpt.cfg.model.seq_len),
                        generator=torch.Generator().manual_seed(0))
    full = inference.logits(inference.load_model(ckpt), ids)
    half = inference.logits(model, ids)
    assert half.dtype == torch.float32
    diff, bound = (half - full).abs().max().item(), 4 * epsilon * full.abs().max().item()
    assert 0 < diff <= bound, (diff, bound)
    prompt, n = tok.encode(PROMPT), 12
    assert generate.main([ckpt.path, "--prompt", PROMPT, "--max-new-tokens", str(n), "--temperature", "0",
                          "--device", "cpu", "--dtype", name]) == 0
    out, err = capsys.readouterr()
    new = inference.generate(model, prompt, n, temperature=0, eos_id=tok.eos_id)[0]
    assert out == tok.decode(prompt + new) + "\n" and f"on cpu in {name}" in err, (out, err)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_model_loaded_onto_a_gpu_in_bf16(exported):
    """load_model(device="cuda", dtype=bf16): built and cast on the CPU, then moved parameter by parameter, the tied
    embedding one tensor on the GPU, each weight the checkpoint's rounded; the logits within 4 eps of bf16 of
    the fp32 model's on the CPU."""
    ckpt, _, _ = exported["tp2"]
    model = inference.load_model(ckpt, "cuda", torch.bfloat16)
    assert model.layers[0].word_embeddings.weight is model.layers[-1].word_embeddings
    for name, p in model.named_global_parameters():
        assert p.is_cuda and torch.equal(p.cpu(), ckpt.tensors[name].to(torch.bfloat16)), name
    ids = torch.randint(0, ckpt.cfg.model.vocab_size, (3, ckpt.cfg.model.seq_len),
                        generator=torch.Generator().manual_seed(0))
    full = inference.logits(inference.load_model(ckpt), ids)
    gpu = inference.logits(model, ids.cuda()).cpu()
    assert (gpu - full).abs().max().item() <= 4 * 2 ** -8 * full.abs().max().item()


def test_what_fp16_cannot_hold_is_one_line(exported, monkeypatch, capsys):
    """A weight past fp16's largest value (65504) is a CheckpointError naming it (bf16 holds it); a checkpoint's
    nan is named as its own; fp16 weights whose activations pass 65504 (fc2 x 1e6: weights up to about 22,000, the
    residual stream further) give logits that are not finite, a FloatingPointError: generate.py and evaluate.py
    print one line and exit 2 where they crashed in sampling or printed a nan loss, and fp32 is finite."""
    import evaluate
    ckpt, _, _ = exported["tp1"]

    def scaled(factor):
        return dataclasses.replace(ckpt, tensors={k: (v * factor if k.endswith("fc2.weight") else v)
                                                  for k, v in ckpt.tensors.items()})

    with pytest.raises(inference.CheckpointError, match=r": blocks\.\d+\.mlp\.fc2\.weight is not finite in fp16 "
                                                        r"\(it passes fp16's largest value, 65504: load it in bf16 or "
                                                        r"fp32\)"):
        inference.load_model(scaled(1e7), dtype=torch.float16)
    inference.load_model(scaled(1e7), dtype=torch.bfloat16)
    with pytest.raises(inference.CheckpointError, match=r"is not finite in bf16 \(the checkpoint holds inf or nan\)"):
        inference.load_model(scaled(float("nan")), dtype=torch.bfloat16)
    overflowing = scaled(1e6)
    ids = torch.tensor([[1, 2, 3, 4]])
    assert inference.logits(inference.load_model(overflowing), ids).isfinite().all()
    with pytest.raises(FloatingPointError, match="the model's logits are not finite in fp16: an activation passed its "
                                                 "largest value; load it in bf16 or fp32"):
        inference.logits(inference.load_model(overflowing, dtype=torch.float16), ids)
    monkeypatch.setattr(inference, "read_checkpoint", lambda path: overflowing)
    for tool, args in ((generate, ["--max-new-tokens", "3"]), (evaluate, [])):
        assert tool.main([ckpt.path, "--device", "cpu", "--dtype", "fp16", *args]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.splitlines()[-1].startswith("error: ") and \
            err.splitlines()[-1].endswith("the model's logits are not finite in fp16: an activation passed its largest "
                                          "value; load it in bf16 or fp32"), (out, err)


def test_evaluate_in_half_precision(exported, capsys):
    """evaluate.py --dtype bf16: the loss of the model in bf16, within bf16's rounding of fp32's."""
    import evaluate
    ckpt, _, _ = exported["tp1"]
    losses = {}
    for name in ("fp32", "bf16"):
        assert evaluate.main([ckpt.path, "--device", "cpu", "--dtype", name]) == 0
        out, err = capsys.readouterr()
        assert f"on cpu in {name}" in err
        losses[name] = float(out.split("validation: loss ")[1].split()[0])
    assert 0 < abs(losses["bf16"] - losses["fp32"]) <= 4 * 2 ** -8 * losses["fp32"], losses


def test_evaluate_gives_hfs_fp64_loss_in_every_layout(exported, capsys):
    """tools/evaluate.py's validation loss is the mean cross entropy, computed apart in fp64 (the export's logits,
    F.cross_entropy), of the windows it reads: the run's eval_iters x gbs validation samples, inputs [:-1] and
    targets [1:] of each (to 1e-6: fp32 logits); the checkpoints of the tp=2 and pp=2 runs give the one-device run's
    loss (1e-5: their weights agree as the layouts train the same model), and their perplexity is its exp."""
    import evaluate
    losses = {}
    for layout, (ckpt, hf, tok) in exported.items():
        (validation,) = inference.evaluation_sets(ckpt, tok, [])[0].values()
        samples = ckpt.cfg.eval_iters * ckpt.cfg.gbs
        rows = torch.from_numpy(np.stack([validation[i] for i in range(samples)]))
        with torch.no_grad():
            theirs = copy.deepcopy(hf).double()(rows[:, :-1]).logits
        reference = F.cross_entropy(theirs.flatten(0, 1), rows[:, 1:].flatten()).item()
        losses[layout] = inference.mean_losses(inference.load_model(ckpt), validation, samples, ckpt.cfg.mbs)[None]
        assert abs(losses[layout] - reference) <= 1e-6 * reference, (layout, losses[layout], reference)
    assert all(abs(loss - losses["tp1"]) <= 1e-5 * losses["tp1"] for loss in losses.values()), losses
    assert evaluate.main([exported["pp2"][0].path, "--device", "cpu"]) == 0           # (mean_losses, as printed)
    assert capsys.readouterr().out.startswith(f"validation: loss {losses['pp2']:.4f} | perplexity "
                                              f"{math.exp(losses['pp2']):.2f} | {samples} samples of 32 tokens | ")


def test_evaluate_notes_repeated_samples_and_refuses_a_set_shorter_than_one_sample(exported, small_data, tmp_path,
                                                                                    capsys):
    """--samples past a set's samples reads some of them twice (dataset[i] runs on into its next epochs, as a run's
    evaluation does), which a note says (it said nothing); a directory of fewer tokens than one sample (seq_len + 1) is
    one error line and exit 2 naming its tokens file, and not data.eval (it named data.eval, which evaluate.py's
    directories are not)."""
    import evaluate
    from megatron_mini.data import prepare
    ckpt, _, tok = exported["tp1"]
    dirs = {}
    for name, text in (("small", PROMPT * 40), ("short", "x = 1\n")):
        (tmp_path / name / "corpus").mkdir(parents=True)
        (tmp_path / name / "corpus" / "a.txt").write_text(text)
        dirs[name] = str(tmp_path / name / "data")
        prepare(dataclasses.replace(small_data, source=str(tmp_path / name / "corpus"), dir=dirs[name],
                                    tokenizer=str(tok.path)))
    n = len(inference.evaluation_sets(ckpt, tok, [dirs["small"]])[0][dirs["small"]])
    assert 1 < n < 20
    capsys.readouterr()
    for samples in (n, n + 1):
        assert evaluate.main([ckpt.path, dirs["small"], "--samples", str(samples), "--device", "cpu"]) == 0
        out, err = capsys.readouterr()
        assert f"| {samples:,} samples of 32 tokens" in out
        assert (f"note: {dirs['small']}: {samples:,} samples, but it holds {n:,}, so some are read twice or more "
                f"(--samples 0: each once)\n" in err) == (samples > n), err
    assert evaluate.main([ckpt.path, dirs["short"], "--device", "cpu"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.splitlines()[-1].startswith(f"error: {dirs['short']}/tokens.bin: 1 document holds ")
    assert err.endswith("fewer than one sample of seq_len + 1 = 33; an evaluation set needs at least one sample\n"), err


def test_export_in_half_precision(exported, tmp_path):
    """export_hf.py --dtype bf16: model.safetensors holds the fp32 export's tensors rounded to bf16 (half the bytes),
    config.json says so, and transformers loads it: its logits within 4 bf16 eps of the fp32 export's. fp16 refuses
    a weight past its range, naming it."""
    from safetensors.torch import load_file
    from megatron_mini.hf import hf_state_dict
    ckpt, hf, _ = exported["tp1"]
    out = tmp_path / "bf16"
    assert export_hf.main([ckpt.path, str(out), "--dtype", "bf16"]) == 0
    saved, full = load_file(out / "model.safetensors"), hf_state_dict(ckpt)
    assert saved.keys() == full.keys()
    for name, t in saved.items():
        assert t.dtype == torch.bfloat16 and torch.equal(t, full[name].to(torch.bfloat16)), name
    assert (out / "model.safetensors").stat().st_size < 0.6 * sum(t.numel() * 4 for t in full.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    half = transformers.GPT2LMHeadModel.from_pretrained(out, local_files_only=True).eval()
    ids = torch.randint(0, ckpt.cfg.model.vocab_size, (2, ckpt.cfg.model.seq_len),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference, logits = hf(ids).logits, half(ids).logits.float()
    assert (logits - reference).abs().max().item() <= 4 * 2 ** -8 * reference.abs().max().item()
    huge = dataclasses.replace(ckpt, tensors={k: v * 1e7 if k.endswith("fc2.weight") else v
                                              for k, v in ckpt.tensors.items()})
    with pytest.raises(inference.CheckpointError, match=r"blocks\.0\.mlp\.fc2\.weight is not finite in fp16"):
        hf_state_dict(huge, torch.float16)


def test_sampling_is_seeded(exported):
    ckpt, _, tok = exported["tp1"]
    model = inference.load_model(ckpt)

    def sample(seed):
        return inference.generate(model, [tok.eos_id], 10, temperature=1.0, top_k=20, num_samples=2,
                                 generator=torch.Generator().manual_seed(seed))

    first = sample(0)
    assert first == sample(0) and first != sample(1)
    assert len(first) == 2 and all(len(s) == 10 for s in first)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 0.9), (0.7, 20, 0.5), (1.3, 5, 1.0),
                                                      (1.0, 0, 1e-9), (0.8, 0, 0.999), (1.0, 1, 1.0),
                                                      (0.9, 300, 1.0), (1.0, 1000, 0.8)])
def test_sampling_keeps_the_tokens_hfs_warpers_keep(temperature, top_k, top_p):
    """The logits sampled from (temperature, top_k, then nucleus top_p) keep the tokens that transformers' logits
    warpers keep, in the order its generate() applies them, with the same probabilities (top_k=1: the most likely
    alone, ties kept; top_k of the vocabulary or more: all)."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    ours = inference.sampling_logits(logits, temperature, top_k, top_p)
    ref = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    assert torch.equal(ours.isfinite(), ref.isfinite())
    kept = ours.isfinite().sum(-1)
    assert (kept >= 1).all() and (kept < 300).any() == (0 < top_k < 300 or top_p < 1)
    torch.testing.assert_close(ours.softmax(-1), ref.softmax(-1), rtol=1e-12, atol=1e-15)
    half = inference.sampling_logits(logits.bfloat16(), temperature, top_k, top_p)   # (the nucleus cut in fp32)
    assert half.dtype == torch.float32
    assert torch.equal(half.isfinite(), inference.sampling_logits(logits.bfloat16().float(), temperature, top_k,
                                                                  top_p).isfinite())


@pytest.mark.parametrize("top_p, kept", [(0.25, 1), (0.31, 4), (0.69, 4), (0.89, 4), (0.91, 5), (0.96, 6)])
def test_a_nucleus_keeps_tied_tokens_together(top_p, kept):
    """Probabilities 0.3, 0.2, 0.2, 0.2, 0.05, 0.05 - 1e-9 (and tokens of none) in another order in each row: a
    nucleus that needs one or two 0.2 keeps all three (which ones a sort ranks first is arbitrary: transformers
    keeps those), as top_k keeps ties with its k-th; the same tokens in every row."""
    p = torch.tensor([0.3, 0.2, 0.2, 0.2, 0.05, 0.05 - 1e-9, 0.0, 0.0], dtype=torch.float64)
    orders = [torch.randperm(len(p), generator=torch.Generator().manual_seed(seed)) for seed in range(4)]
    logits = torch.stack([p[order].log() for order in orders])
    ours = inference.sampling_logits(logits, 1.0, 0, top_p).isfinite()
    expected = p >= sorted(p.tolist(), reverse=True)[kept - 1]         # the `kept` most likely (ties included)
    assert expected.sum() == kept
    for row, order in zip(ours, orders):
        assert torch.equal(row, expected[order]), (row, expected[order])


def test_a_tiny_nucleus_samples_the_greedy_tokens():
    """top_p so small that only the most likely token is left, or top_k=1: sampling gives greedy's tokens, whatever
    the seed (with the KV cache and without); top_p=1, or top_k at least the vocabulary, with the same seed is
    sampling from all the tokens. No sample is a padded vocabulary row (50 times larger logits were they kept)."""
    model = _lively_model()
    greedy = inference.generate(model, [5], 24, temperature=0)
    assert len(set(greedy[0])) >= 5
    for seed, kv_cache in ((0, True), (1, False)):
        for cut in ({"top_p": 1e-6}, {"top_p": 1e-46}, {"top_k": 1}):   # (1e-46: 0 in fp32, the largest kept)
            assert inference.generate(model, [5], 24, temperature=1.0, kv_cache=kv_cache,
                                      generator=torch.Generator().manual_seed(seed), **cut) == greedy

    def sample(**cut):
        return inference.generate(model, [5], 24, temperature=2.0, num_samples=4,
                                  generator=torch.Generator().manual_seed(3), **cut)
    every = sample()
    assert every == sample(top_p=1.0) == sample(top_k=96) == sample(top_k=1000) != greedy * 4
    assert every != sample(top_k=10) and max(max(row) for row in every) < 96
    assert len(set(sum(every, []))) > 24                       # (most tokens are likely: none would be masked)


@pytest.mark.parametrize("kv_cache", [True, False])
def test_generate_cli(exported, kv_cache):
    """Greedy past the context window: the CLI prints what generate() gives in-process, tokens/s on stderr."""
    ckpt, _, tok = exported["tp1"]
    n = 40
    argv = ([sys.executable, generate.__file__, ckpt.path, "--prompt", PROMPT,
             "--max-new-tokens", str(n), "--temperature", "0", "--device", "cpu"]
            + ([] if kv_cache else ["--no-kv-cache"]))
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    prompt = tok.encode(PROMPT)
    assert len(prompt) + n > ckpt.cfg.model.seq_len
    new = inference.generate(inference.load_model(ckpt), prompt, n, temperature=0, eos_id=tok.eos_id,
                             kv_cache=kv_cache)[0]
    assert run.stdout == tok.decode(prompt + new) + "\n"
    prefill = min(len(prompt), ckpt.cfg.model.seq_len)
    assert f"prefill of {prefill} tokens x 1: " in run.stderr, run.stderr
    assert f"then {len(new) - 1} tokens in " in run.stderr and "tokens/s" in run.stderr, run.stderr


def test_tools_note_a_newer_checkpoint_they_pass_over(exported, tmp_path, capsys):
    """A run whose newest checkpoint (the one `latest` names) is corrupt: generate and export take the one
    before, as resume does, and say why on stderr (they took it silently)."""
    import shutil
    ckpt, _, _ = exported["tp1"]
    run = tmp_path / "run"
    shutil.copytree(os.path.dirname(os.path.dirname(ckpt.path)), run)
    good, bad = run / "checkpoints" / os.path.basename(ckpt.path), run / "checkpoints" / "step_000009"
    shutil.copytree(good, bad)
    data = bytearray((bad / "model_pp00_tp00.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (bad / "model_pp00_tp00.pt").write_bytes(bytes(data))
    (run / "checkpoints" / "latest").write_text("step_000009")
    assert generate.main([str(run), "--max-new-tokens", "1", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert f"note: skipped {bad}" in err and f"{good} (step " in err, err
    assert export_hf.main([str(run), str(tmp_path / "hf")]) == 0
    out, err = capsys.readouterr()
    assert f"note: skipped {bad}" in err and f"exported {good} ->" in out, (out, err)


def test_export_to_a_directory_it_cannot_make_is_one_line(exported, tmp_path, capsys):
    ckpt, _, _ = exported["tp1"]
    (tmp_path / "afile").write_text("keep")
    assert export_hf.main([ckpt.path, str(tmp_path / "afile" / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot write {tmp_path / 'afile' / 'sub'}: ") and err.count("\n") == 1, err


def test_a_failed_export_leaves_the_directory_as_it_was(exported, tmp_path, monkeypatch, capsys):
    """The files are staged inside the output directory and moved into place at the end: an export that fails
    half-way (here after every file is staged, before they are moved) leaves an earlier export whole and no staging
    directory. A directory of other files (no config.json) is refused before anything is written into it."""
    from megatron_mini import hf
    ckpt, _, _ = exported["tp1"]
    out = tmp_path / "hf"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"the earlier export")
    (out / "config.json").write_text("{}")

    def fail(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(hf.os, "chmod", fail)
    assert export_hf.main([ckpt.path, str(out)]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"the earlier export"
    monkeypatch.undo()
    data = tmp_path / "data"                       # (files, no config.json: a data directory, not an export)
    data.mkdir()
    (data / "tokenizer.model").write_bytes(b"a run's tokenizer")
    assert export_hf.main([ckpt.path, str(data)]) == 2
    assert capsys.readouterr().err == (f"error: {data} holds files but no config.json, so it is no model directory "
                                       f"whose export this would replace: export into a new or empty directory\n")
    assert [p.name for p in data.iterdir()] == ["tokenizer.model"]


def test_an_export_over_an_earlier_one_leaves_none_of_its_files(exported, tmp_path, monkeypatch):
    """An export into an earlier export's directory whose tokenizer it cannot mirror (here: no protobuf) removes the
    earlier tokenizer.json and tokenizer_config.json (they stayed: AutoTokenizer read another tokenizer's ids beside
    a README saying there is none); files the export does not write (the user's) stay."""
    from megatron_mini import hf
    ckpt, _, _ = exported["tp1"]
    out = tmp_path / "hf"
    assert export_hf.main([ckpt.path, str(out)]) == 0
    (out / "notes.txt").write_text("the user's")
    mirrored = sorted(p.name for p in out.iterdir())
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(mirrored)
    monkeypatch.setattr(hf, "hf_tokenizer", lambda tok, seq_len: "its settings cannot be read without protobuf")
    assert export_hf.main([ckpt.path, str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(set(mirrored) - {"tokenizer.json", "tokenizer_config.json"})
    assert "There is no `tokenizer.json`" in (out / "README.md").read_text()
    assert (out / "notes.txt").read_text() == "the user's"


def test_an_export_stopped_as_it_moves_its_files_is_never_a_mix(exported, tmp_path, monkeypatch):
    """A re-export (bf16 over fp32) stopped at each of its moves and removals in the directory (a kill leaves the
    same files): the directory holds the earlier export's config.json and weights, or this one's, or no weights,
    which transformers refuses to load (without config.json GPT2LMHeadModel loads the weights into gpt2's default
    shapes, with a warning); never one export's config.json beside the other's weights (config.json was moved in
    first: a kill left the new config beside the old weights). The next export completes it."""
    import transformers

    ckpt, _, _ = exported["tp1"]
    ref, out = tmp_path / "ref", tmp_path / "hf"
    assert export_hf.main([ckpt.path, str(ref), "--dtype", "bf16"]) == 0
    new = {name: (ref / name).read_bytes() for name in ("config.json", "model.safetensors")}
    real_replace, real_remove, k = os.replace, os.remove, 0
    while True:
        k += 1
        assert export_hf.main([ckpt.path, str(out)]) == 0 and (out / "config.json").exists()
        old = {name: (out / name).read_bytes() for name in new}
        calls = []

        def stop_at_k(real):
            def call(*args):
                if str(args[-1]).startswith(str(out)):          # (a move or removal in the directory)
                    calls.append(args)
                    if len(calls) == k:
                        raise OSError("killed")
                return real(*args)
            return call
        monkeypatch.setattr(os, "replace", stop_at_k(real_replace))
        monkeypatch.setattr(os, "remove", stop_at_k(real_remove))
        code = export_hf.main([ckpt.path, str(out), "--dtype", "bf16"])
        monkeypatch.undo()
        if len(calls) < k:                                       # (every move done: nothing left to stop)
            assert code == 0 and k > 2
            break
        assert code != 0
        if (out / "model.safetensors").exists():
            held = {name: (out / name).read_bytes() for name in new}
            assert held in (old, new), f"stopped at move {k}: one export's config.json beside the other's weights"
        else:
            with pytest.raises(OSError, match="model.safetensors"):
                transformers.GPT2LMHeadModel.from_pretrained(out)
        assert export_hf.main([ckpt.path, str(out), "--dtype", "bf16"]) == 0
        assert {name: (out / name).read_bytes() for name in new} == new


# export_hf.py in another process, which stops itself (argv[1]: SIGSTOP, or SIGKILL as the OOM killer kills) once
# every file is staged, none moved (export's chmod of the staged weights)
STOPPING_EXPORT = """
import os, signal, sys
import export_hf
chmod = os.chmod
def stop(path, mode):
    if os.path.basename(os.path.dirname(path)).startswith(".export.tmp"):
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    chmod(path, mode)
os.chmod = stop
sys.exit(export_hf.main(sys.argv[2:]))
"""


def _stopping_export(signal_name: str, argv: list) -> subprocess.Popen:
    tools = os.path.dirname(os.path.abspath(export_hf.__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([tools, os.path.dirname(tools)]))
    return subprocess.Popen([sys.executable, "-c", STOPPING_EXPORT, signal_name, *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_what_an_export_killed_outright_left_is_removed_by_the_next(exported, tmp_path, capsys):
    """An export into a new directory killed outright (SIGKILL) with every file staged leaves its staging directory
    (the weights and all) and its lock's file, which no cleanup of its own takes away: the next export is not refused
    as one into a directory of other files, removes the staging directory with a note naming it and its size, and
    leaves the export's files alone, no .lock."""
    from megatron_mini.hf import FILES, STAGING
    ckpt, _, _ = exported["tp1"]
    out = tmp_path / "hf"
    killed = _stopping_export("SIGKILL", [ckpt.path, str(out)])
    assert killed.wait(120) == -9, killed.communicate()[1][-2000:]
    [staging] = [p for p in out.iterdir() if p.name.startswith(STAGING)]
    assert sorted(p.name for p in out.iterdir()) == sorted([".lock", staging.name])
    assert sorted(p.name for p in staging.iterdir()) == sorted(FILES)
    size = sum(p.stat().st_size for p in staging.iterdir())
    capsys.readouterr()
    assert export_hf.main([ckpt.path, str(out)]) == 0
    err = capsys.readouterr().err
    assert err == f"note: removed {staging} ({size:,} bytes), left by an export that was killed\n", err
    assert sorted(p.name for p in out.iterdir()) == sorted(FILES)


def test_an_export_into_a_directory_another_export_writes_is_refused(exported, tmp_path, capsys):
    """While an export (bf16 over an earlier fp32 export; another process, stopped with every file staged) holds the
    directory's lock, a second export into it is refused with one line naming the holder, and changes nothing; the
    first, resumed, leaves its export whole and no .lock or staging directory. Refused rather than waiting: one
    export would at once replace the other's, so one of the two asked-for exports is lost either way; the one
    refused is told so, where a wait would end with the later one in place and the earlier one's user unaware."""
    ckpt, _, _ = exported["tp1"]
    out = tmp_path / "hf"
    assert export_hf.main([ckpt.path, str(out), "--dtype", "bf16"]) == 0
    new = {p.name: p.read_bytes() for p in out.iterdir()}
    assert export_hf.main([ckpt.path, str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    first = _stopping_export("SIGSTOP", [ckpt.path, str(out), "--dtype", "bf16"])
    try:
        _, status = os.waitpid(first.pid, os.WUNTRACED)
        assert os.WIFSTOPPED(status), status
        capsys.readouterr()
        assert export_hf.main([ckpt.path, str(out)]) == 2
        assert capsys.readouterr().err == (
            f"error: {out} is in use by another export (host {socket.gethostname()}, pid {first.pid}). Wait for it "
            f"to finish, or export into another directory.\n")
        assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file() and p.name != ".lock"} == before
    finally:
        first.send_signal(signal.SIGCONT)
        code = first.wait(120)
    assert code == 0, first.communicate()[1][-2000:]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == new


def test_the_export_writes_the_tokenizer_it_checked(exported, tmp_path, monkeypatch):
    """export_hf writes the tokenizer bytes find_tokenizer read and checked against the checkpoint's sha256, not the
    file read again: one changed in between does not reach the export."""
    import shutil

    ckpt, _, _ = exported["tp1"]
    copy = tmp_path / "step"
    shutil.copytree(ckpt.path, copy)
    checked, find = [], inference.find_tokenizer

    def find_then_change(*args):
        tok = find(*args)
        checked.append(tok.data)
        tok.path.write_bytes(b"written after the check")
        return tok
    monkeypatch.setattr(inference, "find_tokenizer", find_then_change)     # (as export_hf reads it)
    assert export_hf.main([str(copy), str(tmp_path / "hf")]) == 0
    assert (copy / "tokenizer.model").read_bytes() == b"written after the check"
    with open(os.path.join(ckpt.path, "tokenizer.model"), "rb") as f:
        assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == checked[0] == f.read()


def test_the_exported_tokenizer_encodes_as_sentencepiece(exported, small_data, tmp_path, monkeypatch):
    """AutoTokenizer loads the export's tokenizer.json, which gives sentencepiece's ids for source files, runs of
    spaces, tabs, newlines and byte-fallback text (a "</s>" in a text is characters in both), and decodes them back;
    its EOS is the run's (it loaded a GPT2Tokenizer made from tokenizer.model, which dropped spaces and put its EOS
    past the vocabulary). A sentencepiece model of other settings (a dummy prefix) or with user-defined pieces (which
    it keeps whole, where a BPE would merge them) gets no tokenizer.json, nor does any where protobuf, which reads the
    settings, is missing."""
    from sentencepiece import sentencepiece_model_pb2
    from megatron_mini.data import Tokenizer, read_corpus
    ckpt, hf, tok = exported["tp1"]
    auto = transformers.AutoTokenizer.from_pretrained(hf.name_or_path, local_files_only=True)
    docs = [doc[:4000] for doc in list(read_corpus(small_data.source)[0])[:20]]
    texts = docs + [PROMPT, "  a   b\t\t\n\n x", "héllo wörld 世界 🎉 \x00\x7f", 'x = "</s>" + "<unk>"', " ", ""]
    for text in texts:
        ids = tok.encode(text)
        assert auto.encode(text) == auto(text).input_ids == ids, text[:80]
        assert auto.decode(ids) == tok.decode(ids) == text
    assert auto.eos_token_id == tok.eos_id == hf.config.eos_token_id and auto.bos_token_id is None
    assert auto.decode(tok.encode(PROMPT) + [tok.eos_id], skip_special_tokens=True) == PROMPT
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(tok.data)
    proto.normalizer_spec.add_dummy_prefix = True
    (tmp_path / "prefixed.model").write_bytes(proto.SerializeToString())
    from megatron_mini.hf import hf_tokenizer
    assert hf_tokenizer(Tokenizer(tmp_path / "prefixed.model"), 32) == \
        "a sentencepiece model of other settings than a BPE that reads each character alone"
    proto.normalizer_spec.add_dummy_prefix = False      # (a data.tokenizer of the user's own: a symbol kept whole)
    proto.pieces[-1].type = sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
    (tmp_path / "symbols.model").write_bytes(proto.SerializeToString())
    assert hf_tokenizer(Tokenizer(tmp_path / "symbols.model"), 32) == "a sentencepiece model with user-defined pieces"
    import sentencepiece
    monkeypatch.delattr(sentencepiece, "sentencepiece_model_pb2")
    monkeypatch.setitem(sys.modules, "sentencepiece.sentencepiece_model_pb2", None)     # (an import that fails)
    assert hf_tokenizer(tok, 32).startswith("its settings cannot be read without protobuf")


def test_exported_readme_example_stays_in_the_context(exported, tmp_path, monkeypatch):
    """The README's example, run as written from another directory, loads the export given by a relative
    path and generates within the model's positions (it asked for 50 new tokens whatever the context,
    which overran a 32-position model)."""
    ckpt, _, _ = exported["tp1"]
    out = tmp_path / "hf"
    monkeypatch.chdir(tmp_path)
    assert export_hf.main([ckpt.path, "hf"]) == 0
    readme = (out / "README.md").read_text()
    code = readme.split("```python\n")[1].split("```")[0]
    assert str(out.resolve()) in code
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
    assert run.returncode == 0 and run.stdout.startswith("def main("), run.stderr[-2000:]


def _model_config(seq_len: int = 32) -> ModelConfig:
    """2 blocks, hidden 64, 4 heads, vocabulary 96 padded to 128."""
    return ModelConfig(name="t", num_layers=2, hidden_size=64, num_heads=4, seq_len=seq_len, vocab_size=96,
                       vocab_pad_multiple=64)


def _random_model(tp: int = 1, sp: bool = False, seq_len: int = 32):
    """A random-initialised _model_config model, eval mode, this rank's part at tp (the same full weights at every
    tp: the init depends on the seed and global names only)."""
    model = _model_config(seq_len)
    mesh, cpu = ParallelMesh(tp, 1, 1), torch.device("cpu")
    ctx = ParallelContext(mesh.tp_group, RNGTracker(1234, mesh.tp_rank, cpu), sp)
    (chunk,) = build_chunks(model, ctx, [(0, model.num_layers + 2)], 1234, cpu)
    return chunk.eval()


def _lively_model(seq_len: int = 32):
    """_random_model (tp=1) with its matrices drawn again, far from init (embeddings std 1, the blocks' 0.3), and its
    padded vocabulary rows (96..127) 50 times larger: its greedy continuations change tokens, so each window
    predicts its own (init's repeat the prompt's last token, whatever the window: tied embeddings, small blocks),
    and a padded row's logit, were it kept, would beat every real one."""
    model = _random_model(seq_len=seq_len)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_global_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3 if name.startswith("blocks.") else 1.0, generator=generator)
        model.layers[0].word_embeddings.weight[96:] *= 50
    return model


def _rel_err(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_kv_cache_logits_match_full_forward():
    """Feeding a sequence through the cache (a prefill then one token at a time, or uneven pieces)
    gives the full causal forward's logits at every position; positions past seq_len are refused."""
    model = _random_model()
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(0))
    full = inference.logits(model, ids)                                         # [b, s, V]
    assert full.shape == (2, 32, 96) and full.dtype == torch.float32
    for pieces in ([8] + [1] * 24, [5, 3, 11, 13]):
        cache = KVCache()
        cached = torch.cat([inference.logits(model, ids[:, cache.length:cache.length + n], cache) for n in pieces], 1)
        assert cache.length == 32
        assert _rel_err(cached, full) <= 1e-5, _rel_err(cached, full)
    with pytest.raises(ValueError, match="context of 32"):
        inference.logits(model, ids[:, :1], cache)
    with pytest.raises(ValueError, match="context of 32"):
        inference.logits(model, torch.cat([ids, ids], 1))


def test_an_fp64_model_decodes_in_fp64():
    """An fp64 model's logits are fp64 (they were rounded to fp32): with the cache they are the full forward's to
    1e-12 of the largest (fp64 rounding; fp32's 6e-8 hid any error below it), and greedy picks what transformers'
    fp64 GPT-2 of the same weights picks where two logits differ by 1e-10 of theirs, which fp32 rounding made
    one (argmax then took the lower id)."""
    from megatron_mini.config import TrainConfig
    from megatron_mini.hf import hf_config, hf_state_dict
    model = _lively_model().double()
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(0))
    full = inference.logits(model, ids)
    assert full.dtype == torch.float64
    cache = KVCache()
    cached = torch.cat([inference.logits(model, ids[:, :5], cache)] +
                       [inference.logits(model, ids[:, i:i + 1], cache) for i in range(5, 32)], 1)
    assert _rel_err(cached, full) <= 1e-12, _rel_err(cached, full)
    prompt = [1, 7, 3, 5, 2]
    last = inference.logits(model, torch.tensor([prompt]))[0, -1]
    top = last.argmax().item()
    twin = next(j for j in range(top + 1, 96) if j not in prompt)       # a later id, fed in no prompt position
    sign = 1 if last[top] > 0 else -1                                   # (the twin's logit: 1e-10 larger)
    with torch.no_grad():
        embedding = model.layers[0].word_embeddings.weight
        embedding[twin] = embedding[top] * (1 + sign * 1e-10)
    ckpt = inference.Checkpoint("random", {}, TrainConfig(model=_model_config()),
                                {name: p.detach() for name, p in model.named_global_parameters()})
    config = {k: v for k, v in hf_config(ckpt, eos_id=0, dtype=torch.float64).items() if k != "megatron_mini"}
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)).double().eval()
    hf.load_state_dict(hf_state_dict(ckpt, torch.float64), strict=False)
    with torch.no_grad():
        assert hf(torch.tensor([prompt])).logits[0, -1].argmax().item() == twin
    for kv_cache in (True, False):
        assert inference.generate(model, prompt, 1, temperature=0, kv_cache=kv_cache) == [[twin]]


def _greedy_by_windows(model, prompt: list, n: int, kv_cache: bool) -> list:
    """n greedy tokens, each the argmax of a full forward over its window of the text, the window that
    generate() documents: the last seq_len tokens without the cache; with it, the text from where the window
    starts, which moves to the last seq_len // 2 tokens when the text passes seq_len tokens from it."""
    seq_len, text = model.layers[0].position_embeddings.shape[0], list(prompt)
    start = max(0, len(text) - seq_len)
    for _ in range(n):
        if len(text) - start > seq_len:
            start = len(text) - (seq_len // 2 if kv_cache else seq_len)
        text.append(inference.logits(model, torch.tensor([text[start:]]))[0, -1].argmax().item())
    return text[len(prompt):]


def test_kv_cache_greedy_matches_full_forward():
    """Greedy with and without the cache agree while the text fits the window (the last token predicted from a full
    window); past it decoding goes on for as many tokens as asked: with the cache each token is the full forward's
    of the window that starts at the last re-prefill of half a window, without it of the last seq_len tokens, from
    prompts of one token, of seq_len - 1, and of 2 seq_len (cut to its last seq_len). The model's continuations
    change tokens (_lively_model): each window predicts its own."""
    model = _lively_model()
    prompt = [1, 7, 3, 5, 2]
    n = 32 - len(prompt) + 1                                     # the last token is predicted from a full window
    cached = inference.generate(model, prompt, n, temperature=0, num_samples=2)
    assert cached == inference.generate(model, prompt, n, temperature=0, num_samples=2, kv_cache=False)
    assert cached[0] == cached[1] and len(cached[0]) == n
    for prompt in ([1, 7, 3, 5, 2], [5], list(range(40, 71)), list(range(96)) * 2 + [3, 4]):
        for kv_cache in (True, False):
            longer = inference.generate(model, prompt, 80, temperature=0, kv_cache=kv_cache)[0]
            assert longer == _greedy_by_windows(model, prompt, 80, kv_cache), (prompt, kv_cache)
        assert len(set(longer)) >= 5, longer
    assert longer != inference.generate(model, prompt, 80, temperature=0)[0]     # (the windows differ past seq_len)


def test_kv_cache_with_a_one_token_window():
    """seq_len = 1: each token is predicted from the last one alone, with the cache (refilled with that
    token) as without it."""
    model = _random_model(seq_len=1)
    cached = inference.generate(model, [5], 6, temperature=0)[0]
    assert cached == inference.generate(model, [5], 6, temperature=0, kv_cache=False)[0] and len(cached) == 6
    assert cached[1] == inference.logits(model, torch.tensor([[cached[0]]]))[0, -1].argmax().item()


def test_generation_stops_once_every_sample_has_ended(monkeypatch):
    """Each sample ends at its first eos_id (kept), and decoding stops once every sample has ended: no forward
    runs for the tokens of max_new_tokens after it, which would all be cut; one sample's end alone stops none (with
    one sample, a stop at the first sample's end passed too)."""
    model = _random_model()

    def sampled(eos_id=None):      # (one sample: the generator draws the same tokens until it stops)
        return inference.generate(model, [1, 7, 3], 12, temperature=1.0, eos_id=eos_id,
                                  generator=torch.Generator().manual_seed(0))[0]
    free = sampled()                                                               # no eos_id
    k = max(i for i, t in enumerate(free[:-1]) if free.index(t) == i)     # a token's first place, not the last
    forwards = []
    logits = inference.logits
    monkeypatch.setattr(inference, "logits", lambda *args: forwards.append(1) or logits(*args))
    assert sampled(eos_id=free[k]) == free[:k + 1]
    assert len(forwards) == k + 1 < 12
    # two samples: one that has ended waits for the other (cut at its own eos_id), which runs on to its own end
    a, b = inference.generate(model, [1, 7, 3], 12, temperature=1.0, num_samples=2,
                              generator=torch.Generator().manual_seed(0))
    first = {t: (a.index(t) if t in a else 12, b.index(t) if t in b else 12) for t in a + b}
    alone = next(t for t, (i, j) in first.items() if i < 11 and j == 12)           # in a only: b runs whole
    both = next(t for t, (i, j) in first.items() if i != j and max(i, j) < 11)      # each ends at its own place
    for eos, last in ((alone, 12), (both, max(first[both]) + 1)):
        forwards.clear()
        ended = inference.generate(model, [1, 7, 3], 12, temperature=1.0, num_samples=2, eos_id=eos,
                                   generator=torch.Generator().manual_seed(0))
        assert ended == [a[:first[eos][0] + 1], b[:first[eos][1] + 1]], (eos, ended, a, b)
        assert len(forwards) == last, (eos, len(forwards))


def test_generate_refuses_bad_arguments():
    """One ValueError naming every bad argument; a prompt id in the padded rows (96..127) is refused too,
    where it would have been embedded from an untrained row, a prompt that is not one sequence of int ids (a batch
    of prompts, a tensor's [n, 1] too, or floats: cut to ints) and counts given as floats. A 1-D tensor is a prompt,
    and numpy or 0-d tensor integers are ints."""
    model = _random_model()
    for kwargs, message in (({"temperature": -0.5}, "temperature=-0.5 must be >= 0"),
                            ({"top_k": -1, "num_samples": 0}, "top_k=-1 must be >= 0; num_samples=0 must be >= 1"),
                            ({"max_new_tokens": -2}, "max_new_tokens=-2 must be >= 0"),
                            ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
                            ({"top_p": float("nan")}, r"top_p=nan must be in \(0, 1\]"),
                            ({"temperature": float("nan")}, "temperature=nan must be >= 0"),
                            ({"temperature": float("inf")}, "temperature=inf"),
                            ({"ids": []}, "the prompt is empty"),
                            ({"ids": [3, 96, -1, 7]}, r"prompt ids must be in \[0, 96\): got \[96, -1\]"),
                            ({"ids": [[1, 2], [3]]}, "the prompt must be one sequence of int token ids \\(prompts "
                                                     "of different lengths are not batched"),
                            ({"ids": torch.tensor([[1, 2], [3, 4]])}, "the prompt must be one sequence of int"),
                            ({"ids": torch.tensor([[1], [2]])}, "the prompt must be one sequence of int"),
                            ({"ids": [1.5, 2]}, "the prompt must be one sequence of int token ids"),
                            ({"max_new_tokens": 3.0, "top_k": 5.0, "num_samples": 2.0},
                             "generate\\(\\): max_new_tokens=3.0 must be an int; top_k=5.0 must be an int; "
                             "num_samples=2.0 must be an int$")):
        args = {"ids": [1, 2], "max_new_tokens": 4, **kwargs}
        with pytest.raises(ValueError, match=message):
            inference.generate(model, **args)
    assert len(inference.generate(model, [0, 95], 0)[0]) == 0
    assert inference.generate(model, torch.tensor([1, 2]), 3, 0) == inference.generate(model, [1, 2], 3, 0) \
        == inference.generate(model, np.array([1, 2]), np.int64(3), 0, top_k=torch.tensor(2), num_samples=np.int32(1))
    assert len(inference.generate(model, [1, 2], 3, 1.0, top_k=torch.tensor(2), num_samples=np.int32(2))) == 2
    assert inference.generate(model, iter([1, 2]), 3, 0) == inference.generate(model, [1, 2], 3, 0)   # (read once)


_TRUE_DIVIDE = torch.Tensor.__truediv__


def _divide_as_cuda(self, other):
    """fp32 tensor / a Python number as CUDA computes it (ATen's BinaryDivTrueKernel.cu: the product with the
    number's fp32 reciprocal); everything else as torch does."""
    if isinstance(other, float) and self.dtype == torch.float32:
        return self * (torch.tensor(1.0) / torch.tensor(other, dtype=torch.float32))
    return _TRUE_DIVIDE(self, other)


@pytest.mark.parametrize("division", ["cpu", "as-cuda"] + (["cuda"] if torch.cuda.is_available() else []))
def test_a_tiny_temperature_samples_what_greedy_picks(division, monkeypatch):
    """A positive temperature too small for the logits' range samples what greedy picks: as the CPU divides (it
    overflowed to NaN once) and as CUDA does, through the reciprocal, which overflows below ~2.9e-39 (the top
    logit became 0 * inf = NaN): emulated here, and on the GPU where there is one; just above the cut (6e-39)
    it samples, and still picks greedy's tokens."""
    model = _random_model().to("cuda" if division == "cuda" else "cpu")
    device = next(model.parameters()).device
    greedy = inference.generate(model, [1, 2], 6, temperature=0)
    if division == "as-cuda":
        monkeypatch.setattr(torch.Tensor, "__truediv__", _divide_as_cuda)
    for tiny in (1e-50, 1e-45, 1e-40, 3e-39, 6e-39):            # (1e-50 is 0 in the logits' fp32)
        generator = torch.Generator(device).manual_seed(0)
        assert inference.generate(model, [1, 2], 6, temperature=tiny, generator=generator) == greedy, tiny


def test_kv_cache_refuses_a_sequence_parallel_model():
    """With sp each rank embeds its own slice of the sequence: a cache's positions would be wrong silently."""
    ids = torch.randint(0, 96, (1, 4))
    with pytest.raises(ValueError, match="sp=False"):
        _random_model(sp=True)(ids, cache=KVCache())


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_generate_cli_cuda_without_a_gpu_is_one_line_exit_2(capsys):
    with pytest.raises(SystemExit) as stop:
        generate.main(["some/checkpoint", "--device", "cuda"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--device cuda: this machine has no CUDA device" in err and "Traceback" not in err


@torch.no_grad()
def _head_logits(tp: int, sp: bool, ids: torch.Tensor) -> torch.Tensor:
    return _random_model(tp, sp)(ids)


@pytest.mark.parametrize("sp", [False, True])
def test_head_logits_gathered_over_tp(sp):
    """Without labels the Head returns the whole real vocabulary's logits [s, b, V] on every TP rank."""
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(1))
    expected = _head_logits(1, False, ids)
    for logits in spawn(2, _head_logits, 2, sp, ids):
        assert logits.shape == (32, 2, 96)
        assert _rel_err(logits, expected) <= 1e-5, _rel_err(logits, expected)


def test_bad_checkpoint_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("a file")
    for path, fact in ((tmp_path / "missing", "no such checkpoint directory"), (tmp_path / "empty", "no meta.json"),
                       (tmp_path / "notes.txt", "is a file, not a checkpoint directory")):
        assert export_hf.main([str(path), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {path}") and err.count("\n") == 1 and fact in err, err    # (its path alone)
    (tmp_path / "empty" / "meta.json").write_text('{"config": {}}')
    (tmp_path / "empty" / "model_pp00_tp00.pt").write_bytes(b"not a torch file")
    assert generate.main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_carries_its_tokenizer(small_data, tmp_path, capsys):
    """Each checkpoint holds the run's tokenizer.model (the bytes the run encoded with, listed with its sha256), which
    the tools read first: a checkpoint copied elsewhere, or whose data directory lost its tokenizer (rebuilt, or
    removed), still generates and exports with its own; a damaged copy is refused as any damaged file of it is."""
    import shutil

    from megatron_mini.checkpoint import read_meta, sha256_file
    from megatron_mini.data import Tokenizer
    data = tmp_path / "data"
    shutil.copytree(small_data.dir, data)
    cfg = small_config(small_data, tmp_path / "run", steps=2, **{"data.dir": str(data)})
    path = train_on_ranks(2, cfg)["checkpoint"]
    tokenizer = Tokenizer(data / "tokenizer.model")
    meta = read_meta(path)
    assert meta["files"]["tokenizer.model"] == tokenizer.sha256 == meta["data"]["tokenizer_sha256"]
    moved = tmp_path / "elsewhere" / "step_000002"
    shutil.copytree(path, moved)
    shutil.rmtree(data)                              # (the data directory gone: before, "tokenizer not found")
    ckpt = inference.read_checkpoint(str(moved))
    assert inference.find_tokenizer(ckpt).path == moved / "tokenizer.model"
    assert generate.main([str(moved), "--prompt", "def", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    assert export_hf.main([str(moved), str(tmp_path / "hf")]) == 0
    assert sha256_file(str(tmp_path / "hf" / "tokenizer.model")) == tokenizer.sha256
    capsys.readouterr()
    (moved / "tokenizer.model").write_bytes(tokenizer.data[:-1] + bytes([tokenizer.data[-1] ^ 1]))
    assert generate.main([str(moved), "--prompt", "def", "--max-new-tokens", "3", "--device", "cpu"]) == 2
    assert f"{moved}/tokenizer.model does not match its sha256" in capsys.readouterr().err
