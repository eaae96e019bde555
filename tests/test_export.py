"""tools/export_hf.py and tools/generate.py: a checkpoint of any layout, exported to a Hugging Face
GPT2LMHeadModel, gives megatron_mini's logits (fp32, max abs diff <= 1e-5) and greedy continuations."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[test]')")

from harness import small_config, train_on_ranks  # noqa: E402

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
sys.path.insert(0, TOOLS)
import export_hf  # noqa: E402
import generate  # noqa: E402

PROMPT = "def main(args):\n    "


@pytest.fixture(scope="module")
def exported(small_data, tmp_path_factory):
    """{tp: (Checkpoint, HF model, Tokenizer)}: 3-step runs at tp=1 and tp=2, each exported and loaded.
    vocab_pad_multiple=96 pads the 512-token vocabulary to 576 rows."""
    runs = {}
    for tp in (1, 2):
        root = tmp_path_factory.mktemp(f"export_tp{tp}")
        cfg = small_config(small_data, root / "run", steps=3, tp=tp, **{"model.vocab_pad_multiple": 96})
        history = train_on_ranks(tp, cfg)
        out = root / "hf"
        assert export_hf.main([history["checkpoint"], str(out)]) == 0
        model, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True,
                                                                   local_files_only=True)
        assert not any(info.values()), info
        ckpt = generate.read_checkpoint(history["checkpoint"])
        assert ckpt.meta["layout"]["tp"] == tp
        tok = generate.find_tokenizer(ckpt)
        assert (out / "tokenizer.model").read_bytes() == tok.path.read_bytes()
        runs[tp] = ckpt, model.eval(), tok
    return runs


@pytest.mark.parametrize("tp", [1, 2])
def test_export_matches_megatron_logits(exported, tp):
    ckpt, hf, tok = exported[tp]
    m = ckpt.cfg.model
    assert hf.config.vocab_size == m.vocab_size < m.padded_vocab_size == hf.config.megatron_mini["padded_vocab_size"]
    assert hf.config.eos_token_id == hf.config.bos_token_id == tok.eos_id
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr(), "embeddings are not tied"
    ids = torch.randint(0, m.vocab_size, (3, m.seq_len), generator=torch.Generator().manual_seed(0))
    text = torch.tensor([tok.encode(PROMPT * 4)[:m.seq_len]])
    model = generate.load_model(ckpt)
    for batch in (ids, text, text[:, :5]):
        ours = generate.logits(model, batch)
        with torch.no_grad():
            theirs = hf(batch).logits
        assert ours.shape == theirs.shape == (*batch.shape, m.vocab_size)
        diff = (ours - theirs).abs().max().item()
        assert diff <= 1e-5, f"logits differ by {diff:.2e}"
    labels = ids.roll(-1, dims=1)
    with torch.no_grad():
        loss = model(ids, labels)  # the training path: the Head's vocab-parallel cross-entropy (sum)
    expected = F.cross_entropy(generate.logits(model, ids).flatten(0, 1), labels.flatten(), reduction="sum")
    assert torch.allclose(loss, expected, rtol=1e-6), (loss.item(), expected.item())


def test_greedy_generation_matches_hf(exported):
    ckpt, hf, tok = exported[1]
    model = generate.load_model(ckpt)
    prompt = tok.encode(PROMPT)
    n = ckpt.cfg.model.seq_len - len(prompt)
    ours = generate.generate(model, prompt, n, temperature=0, eos_id=tok.eos_id)
    assert ours == generate.generate(model, prompt, n, temperature=0, eos_id=tok.eos_id)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_id)
    assert ours[0] == out[0, len(prompt):].tolist()


def test_sampling_is_seeded(exported):
    ckpt, _, tok = exported[1]
    model = generate.load_model(ckpt)

    def sample(seed):
        return generate.generate(model, [tok.eos_id], 10, temperature=1.0, top_k=20, num_samples=2,
                                 generator=torch.Generator().manual_seed(seed))

    first = sample(0)
    assert first == sample(0) and first != sample(1)
    assert len(first) == 2 and all(len(s) == 10 for s in first)


def test_generate_cli(exported):
    """Greedy past the context window (it slides): the CLI prints what generate() gives in-process."""
    ckpt, _, tok = exported[1]
    n = 40
    run = subprocess.run([sys.executable, os.path.join(TOOLS, "generate.py"), ckpt.path, "--prompt", PROMPT,
                          "--max-new-tokens", str(n), "--temperature", "0", "--device", "cpu"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    prompt = tok.encode(PROMPT)
    assert len(prompt) + n > ckpt.cfg.model.seq_len
    new = generate.generate(generate.load_model(ckpt), prompt, n, temperature=0, eos_id=tok.eos_id)[0]
    assert run.stdout == tok.decode(prompt + new) + "\n"


def test_bad_checkpoint_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "missing", tmp_path / "empty"):
        assert export_hf.main([str(path), str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and str(path) in err
    (tmp_path / "empty" / "meta.json").write_text('{"config": {}}')
    (tmp_path / "empty" / "model_pp00.pt").write_bytes(b"not a torch file")
    assert generate.main([str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
