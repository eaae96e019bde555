"""Inference from a checkpoint on one process: read it, find its tokenizer, build the model, sample, evaluate.

The model is megatron_mini's own, built at tp=pp=dp=1 without torch.distributed from the
checkpoint's config, with the full tensors loaded by global name (checkpoints are layout-free).
Its logits are the Head's (`model(ids)` without labels). Generation keeps a `KVCache`: the prompt
is prefilled once, then each new token runs one position. `mean_losses` is the cross entropy of its
predictions over a dataset's samples: the run's validation set or prepared directories read as data.eval
reads them. tools/generate.py, tools/evaluate.py and tools/export_hf.py are the command lines over this
module and megatron_mini/hf.py.
"""
from __future__ import annotations

import dataclasses
import math
import operator
import os
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import checkpoint
from .checkpoint import CheckpointError
from .config import ConfigError, TrainConfig, check_dirs_on_disk, check_heads, check_ranges
from .data import DataError, Tokenizer
from .dataset import BlendedDataset, data_identity, load_datasets, load_eval_sets
from .errors import first_line
from .files import VANISHED_RETRIES
from .model import GPTChunk, KVCache, ParallelContext, build_chunks
from .rank import DTYPES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Checkpoint:
    path: str          # the checkpoint directory (step_NNNNNN)
    meta: dict         # meta.json: step, consumed_samples, loss, layout, config, ...
    cfg: TrainConfig   # the training config, rebuilt from meta["config"]
    tensors: dict      # {global name: full fp32 tensor}
    notes: list = dataclasses.field(default_factory=list)   # newer checkpoints of the run passed over, and why


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


# the config keys (sections) the tools read from a checkpoint's meta.json, which no checksum covers: checked as
# train.py checks them (a hand-edited value was a traceback in the model or the data split, or a broken export); their
# values alone: the data paths are the run's machine's, which this one may lack or hold as other files (config's
# check_dirs_on_disk is for what reads them)
READ_KEYS = ("model.", "data.", "seed", "mbs", "gbs", "eval_iters")


def read_checkpoint(path: str) -> Checkpoint:
    """A checkpoint directory, or a run directory's newest intact checkpoint, verified (sha256 of every
    file) and read into memory (CPU); a CheckpointError where meta.json's config holds a value train.py refuses
    (READ_KEYS), where its files, which verify, do not hold the tensors it lists (checkpoint.NotTheTensors: a file
    written by other code, or put together by hand), or where they cannot be read (an I/O error, no memory: said as
    such). Any other exception is a bug, raised as it is."""
    found = checkpoint.chosen(path)
    path, meta, notes = found.path, found.meta, found.notes
    try:
        cfg = config_from_dict(meta["config"])
        for section in READ_KEYS:
            check_ranges(cfg, section)
        check_heads(cfg.model)
    except ConfigError as e:
        raise CheckpointError(f"{path}/meta.json: its config's {e}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}/meta.json: unreadable ({first_line(e)})") from None
    try:
        tensors = checkpoint.load_model_tensors(path)
    except checkpoint.NotTheTensors as e:
        raise CheckpointError(f"{path}: its files do not hold the tensors its meta.json lists ({e}): a damaged "
                              f"checkpoint, or one of other code") from None
    except (OSError, MemoryError, RuntimeError) as e:
        if checkpoint.removed(e):
            raise Removed(path) from None
        if checkpoint.unreadable(e):        # (the disk or the memory, not the checkpoint: no "damaged")
            raise CheckpointError(f"{path}: its files could not be read ({checkpoint.describe(e)})") from None
        raise                               # (a bug: its traceback)
    return Checkpoint(path, meta, cfg, tensors, notes)


class Removed(CheckpointError):
    """A checkpoint removed while it was read, after its verification (its live run's keep_checkpoints)."""

    def __init__(self, path: str):
        super().__init__(f"{path} was removed while it was read (a live run pruning its checkpoints: "
                         f"keep_checkpoints); give its run directory to read the newest one")


def find_tokenizer(ckpt: Checkpoint, path: str | None = None) -> Tokenizer:
    """The run's sentencepiece model: `path`, else the checkpoint's own copy (checkpoint.TOKENIZER, verified with its
    files), else, in a checkpoint older than those, `data.dir/tokenizer.model` of the training config (a data.blend's
    first directory's; absolute, or relative to the current directory or the repository root). It must be the file
    the checkpoint was trained with (its sha256, recorded in meta.json's "data"): the same ids are other tokens in
    another one."""
    own = os.path.join(ckpt.path, checkpoint.TOKENIZER)
    candidates = [path] if path else [own] if checkpoint.TOKENIZER in ckpt.meta["files"] else \
        _candidates(os.path.join(ckpt.cfg.data.parts()[0][1], "tokenizer.model"))
    found = next((c for c in candidates if os.path.isfile(c)), None)
    if found is None:
        if candidates == [own]:                          # (verified with the checkpoint's files: removed since)
            raise Removed(ckpt.path)
        raise CheckpointError(f"tokenizer not found at {' or '.join(candidates)}; pass --tokenizer PATH")
    try:
        tok = Tokenizer(found)
    except (DataError, FileNotFoundError) as e:
        if found == own and not os.path.isfile(own):
            raise Removed(ckpt.path) from None
        raise CheckpointError(str(e).split("; rebuild")[0]) from None
    if tok.vocab_size != ckpt.cfg.model.vocab_size:
        raise CheckpointError(f"{found}: {tok.vocab_size} tokens, but the checkpoint's model.vocab_size is "
                              f"{ckpt.cfg.model.vocab_size}; pass the run's tokenizer with --tokenizer PATH")
    trained = (ckpt.meta.get("data") or {}).get("tokenizer_sha256")   # (dataset.data_identity)
    if trained and tok.sha256 != trained:
        raise CheckpointError(f"{found} is not the tokenizer {ckpt.path} was trained with (sha256 {tok.sha256[:12]}, "
                              f"the checkpoint's {trained[:12]}: another run's, or a data directory rebuilt since); "
                              f"pass the run's tokenizer with --tokenizer PATH")
    return tok


def load_model(ckpt: Checkpoint, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> GPTChunk:
    """megatron_mini's model at tp=pp=dp=1 (torch kernels, eval mode) with the checkpoint's weights rounded to
    `dtype` (bf16, fp16: half the memory; the matmuls in it, LayerNorm statistics in fp32, the logits returned as
    fp32). Built uninitialised on the CPU in `dtype`, given the checkpoint's weights there, then moved: `device`
    holds the model in `dtype` alone. A CheckpointError where the tensors are not the config's model (check_tensors),
    or for a weight that is not finite in `dtype` (an fp16 one past 65504)."""
    device = torch.device(device)
    m = ckpt.cfg.model
    (model,) = build_chunks(m, ParallelContext.one_device(device, ckpt.cfg.seed), [(0, m.num_layers + 2)],
                            None, torch.device("cpu"))
    model.to(dtype)              # (of untouched memory: no fp32 copy of the model is ever written)
    params = dict(model.named_global_parameters())
    check_tensors(ckpt, {name: p.shape for name, p in params.items()}, "model")
    with torch.no_grad():
        for name, p in params.items():
            t = ckpt.tensors[name]
            p.copy_(t)
            check_finite(p, t, f"{ckpt.path}: {name}", "load")
    return model.to(device).eval()     # (in place, parameter by parameter: the tied embedding stays one)


def check_tensors(ckpt: Checkpoint, shapes: dict, model: str) -> None:
    """A CheckpointError where the checkpoint's tensors are not `shapes` ({global name: shape}: the config's `model`,
    built from meta.json's config, which no checksum covers): a name missing or extra, or another shape."""
    missing, unexpected = sorted(shapes.keys() - ckpt.tensors.keys()), sorted(ckpt.tensors.keys() - shapes.keys())
    if missing or unexpected:
        raise CheckpointError(f"{ckpt.path}: tensors do not match the config's {model} "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
    for name, shape in shapes.items():
        if tuple(ckpt.tensors[name].shape) != tuple(shape):
            raise CheckpointError(f"{ckpt.path}: {name} has shape {tuple(ckpt.tensors[name].shape)}, the config's "
                                  f"{model} needs {tuple(shape)}")


def check_finite(cast: torch.Tensor, source: torch.Tensor, what: str, verb: str) -> None:
    """A CheckpointError naming `what` where `cast`, the checkpoint's tensor `source` rounded to a 16-bit type (an
    fp16 one past 65504), is not finite: the `verb` (load, export) to use instead."""
    if not cast.isfinite().all():
        kind = dtype_name(cast.dtype)
        why = "the checkpoint holds inf or nan" if not source.isfinite().all() else \
            f"it passes {kind}'s largest value, {torch.finfo(cast.dtype).max:.6g}: {verb} it in bf16 or fp32"
        raise CheckpointError(f"{what} is not finite in {kind} ({why})")


def dtype_name(dtype: torch.dtype) -> str:
    """"fp32", "bf16" or "fp16", as precision.dtype and the tools' --dtype spell it."""
    return next(name for name, d in DTYPES.items() if d == dtype)


def device_for(name: str) -> torch.device:
    """The device a tool runs on: "auto" (CUDA when there is one, else the CPU), "cpu" or "cuda" (a ValueError,
    "cuda: this machine has no CUDA device ...", where there is none)."""
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{name}: this machine has no CUDA device (use --device cpu or auto)")
    return torch.device("cuda" if name == "cuda" or (name == "auto" and torch.cuda.is_available()) else "cpu")


def read_with_tokenizer(path: str, tokenizer: str | None) -> tuple[Checkpoint, Tokenizer]:
    """(read_checkpoint, find_tokenizer) of `path`; a run directory whose live run prunes the checkpoint while it is
    read is read again (its newest then), up to VANISHED_RETRIES times."""
    run_dir = checkpoint.is_run_dir(path)        # (before: a checkpoint being removed loses its meta.json first)
    for _ in range(VANISHED_RETRIES if run_dir else 1):
        try:
            ckpt = read_checkpoint(path)
            return ckpt, find_tokenizer(ckpt, tokenizer)
        except Removed as e:
            if not run_dir:
                raise
            removed = e
    raise CheckpointError(f"{path}: its checkpoints were removed while they were read, {VANISHED_RETRIES} "
                          f"times (its live run saves and prunes them faster than they are read: keep_checkpoints); "
                          f"try again, or give a checkpoint it keeps (keep_checkpoint_interval)") from removed


def open_checkpoint(path: str, tokenizer: str | None, device: torch.device,
                    dtype: torch.dtype = torch.float32) -> tuple[Checkpoint, Tokenizer, GPTChunk]:
    """(read_checkpoint, find_tokenizer, load_model) of a checkpoint or run directory `path`, with the tokenizer
    `tokenizer` or the run's; a CheckpointError names what does not fit. Its notes (checkpoints passed over) and
    what it is go to stderr, as the tools print them."""
    ckpt, tok = read_with_tokenizer(path, tokenizer)
    model = load_model(ckpt, device, dtype)
    for note in ckpt.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"{ckpt.path} (step {ckpt.meta['step']}) on {device} in {dtype_name(dtype)}", file=sys.stderr)
    return ckpt, tok, model


@torch.no_grad()
def logits(model: GPTChunk, ids: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
    """ids [b, s] -> the Head's fp32 logits (an fp64 model's fp64) [b, s, vocab_size] over the real vocabulary: of
    positions 0 .. s - 1, or with a cache of positions cache.length .. cache.length + s - 1 (the cache grows by s).
    A ValueError when the positions pass the model's context (seq_len); a FloatingPointError for an fp16 model's
    logits that are not finite (an activation past its range: its weights are finite, load_model)."""
    out = model(ids, cache=cache).transpose(0, 1)
    if next(model.parameters()).dtype == torch.float16 and not out.isfinite().all():   # (a sync: fp16's alone)
        raise FloatingPointError("the model's logits are not finite in fp16: an activation passed its largest value; "
                                 "load it in bf16 or fp32")
    return out


def evaluation_sets(ckpt: Checkpoint, tok: Tokenizer, dirs: list) -> tuple[dict, list]:
    """({name: dataset}, notes) that tools/evaluate.py reads: each prepared directory of `dirs` as data.eval reads it
    ({dir: all its documents, shuffled by EVAL_SEED}), encoded with the run's tokenizer `tok`; without `dirs`, what
    the run's evaluations read: its validation set ("validation"; its data.dir or data.blend, which must still hold
    the corpus and tokenizer the checkpoint records) and its data.eval sets, each opened on its own (a relative
    path from the current directory, else the repository root, as find_tokenizer reads the tokenizer): one that
    cannot be is a note, and a DataError (a ConfigError) only when none can. With `dirs`, a DataError naming the
    first that does not fit."""
    cfg, seq_len, vocab_size = ckpt.cfg, ckpt.cfg.model.seq_len, ckpt.cfg.model.vocab_size
    if dirs:
        given = dataclasses.replace(cfg.data, eval=list(dirs))
        key = "evaluate.py's DIRS"                 # (a directory twice: named as the user gave it, or a link to it)
        check_dirs_on_disk(key, given.eval_dirs(key))
        return load_eval_sets(given, seq_len, vocab_size, tok, "the directories evaluate.py reads and the run's"), []
    data = dataclasses.replace(cfg.data, tokenizer=None, dir=_located(cfg.data.dir), blend=cfg.data.blend and [
        _located(v) if i % 2 else v for i, v in enumerate(cfg.data.blend)], eval=cfg.data.eval and [
        _located(d) for d in cfg.data.eval])
    sets, failures = {}, []
    try:
        sets["validation"] = _validation_set(ckpt, data)
    except DataError as e:
        failures.append(e)
    for name, located in zip(cfg.data.eval_dirs(), data.eval_dirs()):
        try:
            (sets[name],) = load_eval_sets(dataclasses.replace(data, eval=[located]), seq_len, vocab_size,
                                           tok).values()
        except DataError as e:
            failures.append(e)
    if not sets:
        raise failures[0]
    return sets, [f"not evaluated: {e}" for e in failures]


def _validation_set(ckpt: Checkpoint, data) -> object:
    """The run's validation set, read from `data` (its DataConfig, paths located), which must hold the corpus and
    tokenizer the checkpoint records."""
    cfg = ckpt.cfg
    datasets = load_datasets(data, cfg.model.seq_len, cfg.seed, cfg.model.vocab_size)
    saved, now = ckpt.meta.get("data") or {}, data_identity(data, datasets)
    changed = [key for key in ("tokenizer_sha256", "corpus_sha256", "num_tokens", "tokens_fingerprint") if key in saved
               and saved[key] != now.get(key)]
    if changed:
        where = f"data.blend={list(cfg.data.blend)}" if cfg.data.blend else f"data.dir={cfg.data.dir}"
        raise DataError(where, f"is not the data {ckpt.path} was trained on (another {', '.join(changed)} than "
                        f"it records: rebuilt since?), so its validation documents are not the run's; name "
                        f"prepared directories to evaluate instead", rebuild=None)
    return datasets[1]


def _candidates(path: str) -> list:
    """Where the tools look for a run's data path, in order: the path itself where absolute, else from the current
    directory, then from the repository root (where the run was most likely launched)."""
    return [path] if os.path.isabs(path) else list(dict.fromkeys(os.path.join(r, path) for r in (os.getcwd(), REPO)))


def _located(path: str) -> str:
    """A run's data path as the tools read it: the first of _candidates that exists (else the path as it is)."""
    return next((c for c in _candidates(path) if os.path.exists(c)), path)


def whole_sets(sets: dict, names: list) -> dict:
    """evaluation_sets' {name: dataset} to read every sample of: a blend's directories each on its own
    ("validation (<names[d]>)"), as the blend's epoch ends at its first sample read again, when a directory of a
    smaller share is still part read (tools/evaluate.py --samples 0)."""
    out = {}
    for name, dataset in sets.items():
        if isinstance(dataset, BlendedDataset):
            out.update({f"{name} ({d})": part for d, part in zip(names, dataset.datasets)})
        else:
            out[name] = dataset
    return out


@torch.no_grad()
def mean_losses(model: GPTChunk, dataset, samples: int, batch: int, names: list | None = None) -> dict:
    """The mean cross entropy (nats per token, no label smoothing) of the model's next-token predictions over
    samples [0, samples) of `dataset` (each [seq_len + 1] tokens: inputs [:-1], targets [1:]), run `batch` samples
    at a time: {None: over all of them} and, for a BlendedDataset, {names[d]: over those of its dataset d}. The
    losses a run logs for those samples (val_loss and val_loss/<dir>, eval_loss/<dir>)."""
    device = next(model.parameters()).device
    summed = []                                                                     # each sample's token losses
    for start in range(0, samples, batch):
        rows = torch.from_numpy(np.stack([dataset[i] for i in range(start, min(start + batch, samples))]))
        rows = rows.to(device, torch.long)
        out = logits(model, rows[:, :-1])                                           # [b, s, V] fp32
        losses = F.cross_entropy(out.flatten(0, 1), rows[:, 1:].flatten(), reduction="none").double()
        summed.append(losses.view(len(rows), -1).sum(-1).cpu())
    summed = torch.cat(summed).numpy()
    tokens = len(dataset[0]) - 1
    means = {None: summed.sum() / (samples * tokens)}
    if isinstance(dataset, BlendedDataset):
        which = dataset.which(0, samples)
        means.update({names[d]: summed[which == d].sum() / ((which == d).sum() * tokens)
                      for d in range(len(dataset.datasets)) if (which == d).any()})
    return means


def sampling_logits(last: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """[n, V] logits -> the logits sampled from (softmax): shifted to a maximum of 0 and divided by temperature
    (> 0), then -inf but for the top_k largest (0: all; ties with the k-th kept), then -inf but for the fewest
    largest whose probabilities (after top_k) sum to at least top_p (nucleus sampling; 1: all; the largest is
    always kept; ties with the least likely of them kept, as top_k keeps ties with the k-th: tokens of one
    probability are all in or all out, whatever order a sort gives them), in fp32 at least (a 16-bit cumulative
    sum would cut the nucleus at steps of 2^-8)."""
    last = last.to(torch.promote_types(last.dtype, torch.float32))
    last = (last - last.max(-1, keepdim=True).values) / temperature
    if top_k:
        kth = last.topk(min(top_k, last.shape[-1]), dim=-1).values[:, -1:]
        last = last.masked_fill(last < kth, float("-inf"))
    if top_p < 1:
        probs = last.softmax(-1)
        ranked = probs.sort(-1, descending=True).values
        before = ranked.cumsum(-1) - ranked                # the probability of the tokens ranked above each
        cut = before >= top_p
        cut[:, 0] = False                 # (a top_p below fp32's least, 1.4e-45, compares as 0: the largest stays)
        needed = ranked.masked_fill(cut, float("inf")).amin(-1, keepdim=True)   # the least likely one kept
        last = last.masked_fill(probs < needed, float("-inf"))
    return last


def _is_int(value) -> bool:
    """An int, or what stands for one (a numpy or 0-d tensor integer): not a float, even a whole one."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return not (isinstance(value, torch.Tensor) and value.dim())


def _token_ids(ids) -> list | None:
    """One prompt as a list of ints; None where `ids` is not one sequence of ints (floats, or a batch of prompts:
    operator.index alone takes a tensor's 1-element row, [[1], [2]] as [1, 2])."""
    try:
        ids = list(ids)                     # (once: an iterator is read by the check and the conversion alike)
    except TypeError:
        return None
    return [operator.index(i) for i in ids] if all(_is_int(i) for i in ids) else None


@torch.no_grad()
def generate(model: GPTChunk, ids: list, max_new_tokens: int, temperature: float = 1.0, top_k: int = 0,
             num_samples: int = 1, eos_id: int | None = None, generator: torch.Generator | None = None,
             kv_cache: bool = True, timing: dict | None = None, top_p: float = 1.0) -> list:
    """Continue the prompt `ids` (one prompt: a sequence of int ids) num_samples times, the batch: a list of
    num_samples lists of at most max_new_tokens new ids, each ending at its first eos_id (kept). Greedy when
    temperature == 0, else sampled from sampling_logits (top_k=0 and top_p=1 keep all).
    `timing`, when given and max_new_tokens > 0, receives the seconds to the first new token (the prompt's
    prefill) and after it ("prefill_s", "decode_s": the device synchronised at both).

    The first forward runs the prompt's last seq_len tokens (the model's context, learned positions).
    With the KV cache (default) each later token runs one position. When the cache holds seq_len
    positions it is dropped and the last seq_len // 2 tokens (at least 1) are prefilled again (positions from 0),
    so past the window the context is between seq_len // 2 and seq_len tokens and costs one half-window
    prefill per seq_len // 2 new tokens. Without the cache (kv_cache=False) every token reruns the last
    seq_len tokens: the same tokens as the cache while the text fits the window, a window that slides
    one token at a time beyond it. (Hugging Face's GPT-2 generate() stops there: an IndexError past its
    n_positions, the token after the one predicted from a full window.)
    """
    device = next(model.parameters()).device
    seq_len = model.layers[0].position_embeddings.shape[0]
    vocab = model.layers[-1].vocab_size
    ids = _token_ids(ids)
    bad = [f"{name}={value} must be an int" for name, value in
           (("max_new_tokens", max_new_tokens), ("top_k", top_k), ("num_samples", num_samples)) if not _is_int(value)]
    bad += [f"{name}={value} must be >= {low}" for name, value, low in
            (("max_new_tokens", max_new_tokens, 0), ("temperature", temperature, 0), ("top_k", top_k, 0),
             ("num_samples", num_samples, 1)) if not value >= low]          # (NaN is not >= anything)
    if not 0 < top_p <= 1:
        bad.append(f"top_p={top_p} must be in (0, 1]")
    if temperature == math.inf:
        bad.append("temperature=inf: every token would be equally likely")
    if ids is None:
        bad.append("the prompt must be one sequence of int token ids (prompts of different lengths are not batched: "
                   "the batch is its num_samples continuations)")
    elif not len(ids):
        bad.append("the prompt is empty (start from [eos_id] for none)")
    elif not all(0 <= i < vocab for i in ids):
        bad.append(f"prompt ids must be in [0, {vocab}): got {[i for i in ids if not 0 <= i < vocab][:5]}")
    if bad:
        raise ValueError("generate(): " + "; ".join(bad))
    max_new_tokens, top_k, num_samples = map(operator.index, (max_new_tokens, top_k, num_samples))
    x = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)  # [n, t]
    done = torch.zeros(num_samples, dtype=torch.bool, device=device)
    cache, feed = (KVCache() if kv_cache else None), x[:, -seq_len:]             # feed: what the model runs next
    clock = _Clock(device) if timing is not None else None
    for step in range(max_new_tokens):
        last = logits(model, feed, cache)[:, -1]                                   # [n, V]
        # 0, or so small that 1 / temperature overflows the logits' dtype (CUDA divides by a number as the product
        # with its reciprocal: the top logit became 0 * inf = NaN there): greedy, what sampling at it would pick
        if temperature < 2 / torch.finfo(last.dtype).max:
            nxt = last.argmax(-1)
        else:
            last = sampling_logits(last, temperature, top_k, top_p)
            nxt = torch.multinomial(last.softmax(-1), 1, generator=generator).squeeze(-1)
        x = torch.cat([x, nxt.unsqueeze(1)], dim=1)
        if clock is not None and step == 0:
            timing["prefill_s"] = clock.lap()
        if eos_id is not None:
            done |= nxt == eos_id
            if done.all():
                break
        if cache is None:
            feed = x[:, -seq_len:]
        elif cache.length < seq_len:
            feed = x[:, -1:]
        else:                                                                       # the window is full
            cache, feed = KVCache(), x[:, -max(1, seq_len // 2):]
    rows = x[:, len(ids):].tolist()
    if clock is not None and max_new_tokens:
        timing["decode_s"] = clock.lap()
    return [row[:row.index(eos_id) + 1] if eos_id in row else row for row in rows]


class _Clock:
    """Seconds between laps, with the device's queued work finished at each."""

    def __init__(self, device: torch.device):
        self.device = device
        self.t = self._now()

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self) -> float:
        t, self.t = self.t, self._now()
        return self.t - t
