"""Sample text from a megatron_mini checkpoint on one process (CUDA when available, else CPU).

    python tools/generate.py runs/tiny-dp/checkpoints/step_000300 --prompt 'def main(' --max-new-tokens 200
    python tools/generate.py runs/tiny-dp --temperature 0      # a run directory: its latest checkpoint; greedy

The model is megatron_mini's own, built at tp=pp=dp=1 without torch.distributed from the
checkpoint's config, with the full tensors loaded by global name (checkpoints are layout-free).
There is no KV cache: each new token reruns the last `seq_len` tokens, so the context window
slides once the text is longer than the model's. Sampling stops at EOS (end of a document);
an empty prompt starts from EOS, i.e. at the start of a document. The text goes to stdout.

tools/export_hf.py and tests/test_export.py use `read_checkpoint`, `find_tokenizer`,
`load_model`, `logits` and `generate` from here.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)
from megatron_mini import checkpoint  # noqa: E402
from megatron_mini.config import TrainConfig  # noqa: E402
from megatron_mini.data import DataError, Tokenizer  # noqa: E402
from megatron_mini.mesh import ParallelMesh  # noqa: E402
from megatron_mini.model import GPTChunk, build_chunks  # noqa: E402
from megatron_mini.tensor_parallel import RNGTracker  # noqa: E402


class CheckpointError(Exception):
    """A missing or invalid checkpoint or tokenizer; the message is one line."""


@dataclass
class Checkpoint:
    path: str          # the checkpoint directory (step_NNNNNN)
    meta: dict         # meta.json: step, consumed_samples, layout, config
    cfg: TrainConfig   # the training config, rebuilt from meta["config"]
    tensors: dict      # {global name: full fp32 tensor}


def config_from_dict(d: dict, cls=TrainConfig):
    """A (nested) config dataclass from its `dataclasses.asdict` form; unknown keys are ignored."""
    if not isinstance(d, dict):
        raise TypeError(f"{cls.__name__} must be a mapping, not {type(d).__name__}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name in d:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            value = d[f.name]
            kwargs[f.name] = config_from_dict(value, type(default)) if dataclasses.is_dataclass(default) else value
    return cls(**kwargs)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"


def read_checkpoint(path: str) -> Checkpoint:
    """A checkpoint directory, or a run directory's latest checkpoint, read into memory (CPU)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not os.path.isfile(os.path.join(path, "meta.json")):
        latest = checkpoint.latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"{path}: not a megatron_mini checkpoint (no meta.json); pass a checkpoint "
                                  f"directory such as runs/NAME/checkpoints/step_000100, or a run directory")
        path = latest
    if not glob.glob(os.path.join(path, "model_pp*.pt")):
        raise CheckpointError(f"{path}: no model_pp*.pt files (an incomplete checkpoint?)")
    try:
        meta = checkpoint.read_meta(path)
        cfg = config_from_dict(meta["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}/meta.json: unreadable ({_first_line(e)})") from None
    try:
        tensors = checkpoint.load_model_tensors(path)
    except Exception as e:  # noqa: BLE001 - torch.load of a damaged file raises many kinds of error
        raise CheckpointError(f"{path}: cannot read the model_pp*.pt files ({_first_line(e)})") from None
    return Checkpoint(path, meta, cfg, tensors)


def find_tokenizer(ckpt: Checkpoint, path: str | None = None) -> Tokenizer:
    """The run's sentencepiece model: `path`, else `data.dir/tokenizer.model` of the training config
    (absolute, or relative to the current directory or the repository root)."""
    if path:
        candidates = [path]
    else:
        data_dir = ckpt.cfg.data.dir
        roots = [""] if os.path.isabs(data_dir) else [os.getcwd(), REPO]
        candidates = list(dict.fromkeys(os.path.join(r, data_dir, "tokenizer.model") for r in roots))
    found = next((c for c in candidates if os.path.isfile(c)), None)
    if found is None:
        raise CheckpointError(f"tokenizer not found at {' or '.join(candidates)}; pass --tokenizer PATH")
    try:
        tok = Tokenizer(found)
    except DataError as e:
        raise CheckpointError(str(e).split("; rebuild")[0]) from None
    if tok.vocab_size != ckpt.cfg.model.vocab_size:
        raise CheckpointError(f"{found}: {tok.vocab_size} tokens, but the checkpoint's model.vocab_size is "
                              f"{ckpt.cfg.model.vocab_size}; pass the run's tokenizer with --tokenizer PATH")
    return tok


def load_model(ckpt: Checkpoint, device: torch.device | str = "cpu") -> GPTChunk:
    """megatron_mini's model at tp=pp=dp=1 (torch kernels, fp32, eval mode) with the checkpoint's weights."""
    device = torch.device(device)
    cfg = dataclasses.replace(ckpt.cfg, tp=1, pp=1, vpp=1, sp=False, recompute="none", kernels="torch")
    rng = RNGTracker(cfg.seed, 0, 0, device)
    (model,) = build_chunks(cfg, ParallelMesh(1, 1, 1), [(0, cfg.model.num_layers + 2)], rng, device)
    params = dict(model.named_global_parameters())
    missing, unexpected = sorted(params.keys() - ckpt.tensors.keys()), sorted(ckpt.tensors.keys() - params.keys())
    if missing or unexpected:
        raise CheckpointError(f"{ckpt.path}: tensors do not match the config's model "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    with torch.no_grad():
        for name, p in params.items():
            t = ckpt.tensors[name]
            if t.shape != p.shape:
                raise CheckpointError(f"{ckpt.path}: {name} has shape {tuple(t.shape)}, the config's model "
                                      f"needs {tuple(p.shape)}")
            p.copy_(t)
    return model.eval()


@torch.no_grad()
def logits(model: GPTChunk, ids: torch.Tensor) -> torch.Tensor:
    """ids [b, s] (s <= seq_len) -> fp32 logits [b, s, vocab_size] over the real vocabulary.

    Runs the embedding and blocks, then the head's final LayerNorm times the tied word embedding;
    the padded vocabulary rows are dropped (as if masked to -inf)."""
    *body, head = model.layers
    seq_len = body[0].position_embeddings.shape[0]
    if ids.shape[1] > seq_len:
        raise ValueError(f"{ids.shape[1]} tokens exceed the model's context of {seq_len}")
    x = ids
    for layer in body:
        x = layer(x)                                                       # [s, b, h]
    y = F.linear(head.ln_f(x), head.word_embeddings)[..., :head.vocab_size]  # [s, b, V]
    return y.transpose(0, 1).float()


@torch.no_grad()
def generate(model: GPTChunk, ids: list, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             num_samples: int = 1, eos_id: int | None = None, generator: torch.Generator | None = None) -> list:
    """Continue the prompt `ids` num_samples times: a list of num_samples lists of at most max_new_tokens
    new ids, each ending at its first eos_id (kept). Greedy when temperature == 0; top_k=0 keeps all."""
    device = next(model.parameters()).device
    seq_len = model.layers[0].position_embeddings.shape[0]
    x = torch.tensor([list(ids)] * num_samples, dtype=torch.long, device=device)  # [n, t]
    done = torch.zeros(num_samples, dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        last = logits(model, x[:, -seq_len:])[:, -1]                                 # [n, V]
        if temperature == 0:
            nxt = last.argmax(-1)
        else:
            last = last / temperature
            if top_k:
                kth = last.topk(min(top_k, last.shape[-1]), dim=-1).values[:, -1:]
                last = last.masked_fill(last < kth, float("-inf"))
            nxt = torch.multinomial(last.softmax(-1), 1, generator=generator).squeeze(-1)
        x = torch.cat([x, nxt.unsqueeze(1)], dim=1)
        if eos_id is not None:
            done |= nxt == eos_id
            if done.all():
                break
    rows = x[:, len(ids):].tolist()
    return [row[:row.index(eos_id) + 1] if eos_id in row else row for row in rows]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="a checkpoint directory (runs/NAME/checkpoints/step_N) or a run directory")
    p.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens; 0: all")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--tokenizer", help="sentencepiece model (default: data.dir/tokenizer.model of the run)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = p.parse_args(argv)
    for name in ("max_new_tokens", "temperature", "top_k"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.num_samples < 1:
        p.error("--num-samples must be >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
                          else "cpu")
    try:
        ckpt = read_checkpoint(args.checkpoint)
        tok = find_tokenizer(ckpt, args.tokenizer)
        model = load_model(ckpt, device)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{ckpt.path} (step {ckpt.meta['step']}) on {device}", file=sys.stderr)
    prompt = tok.encode(args.prompt) or [tok.eos_id]
    generator = torch.Generator(device).manual_seed(args.seed)
    samples = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.num_samples,
                       tok.eos_id, generator)
    for i, new in enumerate(samples):
        if args.num_samples > 1:
            print(f"----- sample {i + 1} -----")
        print(tok.decode(prompt + new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
