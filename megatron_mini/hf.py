"""megatron_mini <-> Hugging Face transformers GPT-2: the state-dict adapter and the export.

The architectures are the same (pre-LN, learned positions, fused [q; k; v], GELU tanh =
"gelu_new", LayerNorm eps, tied embeddings). megatron_mini's Linear weights are [out, in], GPT-2's
Conv1D weights [in, out], hence the transposes; the padded vocabulary rows are dropped.
lm_head.weight is not stored: GPT2LMHeadModel ties it to transformer.wte.weight. The checkpoint's
full tensors come by global name from checkpoint.load_model_tensors, so a checkpoint of any layout
exports the same way. The run's sentencepiece model is exported as it is (tokenizer.model) and as a
Hugging Face `tokenizers` BPE (tokenizer.json) that AutoTokenizer loads and that gives the same ids.
"""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from .data import Tokenizer, plain_bpe
from .files import (DirectoryLock, existing_part, is_temporary, remove_empty_dirs, remove_left_temporaries,
                    temporary_name)
from .inference import Checkpoint, check_finite, check_tensors, read_with_tokenizer


def block_names(h: int, f: int) -> list:
    """(GPT-2 name, megatron_mini name, megatron_mini shape, transpose) inside one block."""
    return [
        ("ln_1.weight", "ln1.weight", (h,), False),
        ("ln_1.bias", "ln1.bias", (h,), False),
        ("attn.c_attn.weight", "attn.qkv.weight", (3 * h, h), True),
        ("attn.c_attn.bias", "attn.qkv.bias", (3 * h,), False),
        ("attn.c_proj.weight", "attn.proj.weight", (h, h), True),
        ("attn.c_proj.bias", "attn.proj.bias", (h,), False),
        ("ln_2.weight", "ln2.weight", (h,), False),
        ("ln_2.bias", "ln2.bias", (h,), False),
        ("mlp.c_fc.weight", "mlp.fc1.weight", (f, h), True),
        ("mlp.c_fc.bias", "mlp.fc1.bias", (f,), False),
        ("mlp.c_proj.weight", "mlp.fc2.weight", (h, f), True),
        ("mlp.c_proj.bias", "mlp.fc2.bias", (h,), False),
    ]


def hf_state_dict(ckpt: Checkpoint, dtype: torch.dtype = torch.float32) -> dict:
    """{GPT-2 name: contiguous tensor in `dtype`} from the checkpoint's {global name: full fp32 tensor}.
    wte is [vocab_size, h] (padding rows dropped), Conv1D weights [in, out]. A CheckpointError where the tensors are
    not the config's GPT-2 (check_tensors), or for a weight that is not finite in `dtype` (an fp16 one past 65504)."""
    m = ckpt.cfg.model
    h = m.hidden_size
    names = [("transformer.wte.weight", "embedding.word_embeddings.weight", (m.padded_vocab_size, h), False),
             ("transformer.wpe.weight", "embedding.position_embeddings", (m.seq_len, h), False),
             ("transformer.ln_f.weight", "head.ln_f.weight", (h,), False),
             ("transformer.ln_f.bias", "head.ln_f.bias", (h,), False)]
    for i in range(m.num_layers):
        names += [(f"transformer.h.{i}.{hf}", f"blocks.{i}.{mm}", shape, t)
                  for hf, mm, shape, t in block_names(h, m.ffn_hidden_size)]
    check_tensors(ckpt, {mm: shape for _, mm, shape, _ in names}, "GPT-2")
    out = {}
    for hf, mm, shape, transpose in names:
        t = ckpt.tensors[mm]
        cast = t.to(dtype)
        check_finite(cast, t, f"{ckpt.path}: {mm}", "export")
        out[hf] = (cast.t() if transpose else cast).contiguous()
    out["transformer.wte.weight"] = out["transformer.wte.weight"][:m.vocab_size].contiguous()
    return out


def hf_config(ckpt: Checkpoint, eos_id: int, dtype: torch.dtype = torch.float32) -> dict:
    """config.json of GPT2LMHeadModel (its weights in `dtype`); the "megatron_mini" field records the padding and
    the source."""
    m = ckpt.cfg.model
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": m.vocab_size,
        "n_positions": m.seq_len,
        "n_embd": m.hidden_size,
        "n_layer": m.num_layers,
        "n_head": m.num_heads,
        "n_inner": m.ffn_hidden_size,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": m.ln_eps,
        "initializer_range": m.init_std,
        "resid_pdrop": m.dropout,
        "embd_pdrop": m.dropout,
        "attn_pdrop": m.dropout,
        "scale_attn_weights": True,
        "tie_word_embeddings": True,
        "bos_token_id": eos_id,
        "eos_token_id": eos_id,
        "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
        "megatron_mini": {
            "padded_vocab_size": m.padded_vocab_size,
            "checkpoint": os.path.abspath(ckpt.path),
            "step": ckpt.meta.get("step"),
            "layout": {**(ckpt.meta.get("layout") or {}), "vpp": ckpt.cfg.vpp, "sp": ckpt.cfg.sp, "zero": ckpt.cfg.zero,
                       "embedding_stage": getattr(ckpt.cfg.embedding_stage, "value", ckpt.cfg.embedding_stage)},
            "model_name": m.name,
        },
    }


def hf_tokenizer(tok: Tokenizer, seq_len: int) -> tuple[dict, dict] | str:
    """(tokenizer.json, tokenizer_config.json) of a `tokenizers` BPE that encodes and decodes as the sentencepiece BPE
    `tok` does (data.plain_bpe: train_tokenizer's settings, its byte fallback copied), or why not: a sentencepiece
    model of other settings or with user-defined pieces, or no protobuf to read them with. sentencepiece's BPE
    encodes the whole text (" " -> "▁") by merging, again and again, the adjacent pair whose concatenation is the
    piece of the highest score: the merges are every (left, right) split of a normal piece into two normal pieces,
    ranked by the piece's score. Its control and unknown pieces are special tokens that text never yields
    (split_special_tokens, which transformers >= 4.42 honours: "</s>" in a prompt is characters, as sentencepiece
    reads it; the `tokenizers` library alone reads it as EOS). It decodes as sentencepiece does, but for a run of
    byte pieces that is not UTF-8 as a whole (a generated character cut short beside a whole one), whose every byte
    becomes U+FFFD in `tokenizers`' ByteFallback (sentencepiece replaces the broken character's alone), for <unk>,
    which sentencepiece decodes as " ⁇ ", and for EOS, which sentencepiece drops and AutoTokenizer writes as "</s>"
    (unless skip_special_tokens). Without the file, AutoTokenizer turned tokenizer.model into a GPT2Tokenizer that
    encodes otherwise (spaces dropped) and whose EOS is past the vocabulary. Its merges are pairs, which tokenizers
    >= 0.20 reads (transformers >= 4.45: 4.40's 0.19 refused the file, "data did not match any variant of untagged
    enum ModelWrapper")."""
    proto = plain_bpe(tok)
    if isinstance(proto, str):
        return proto
    spec, Piece = proto.trainer_spec, proto.SentencePiece
    if any(p.type == Piece.USER_DEFINED for p in proto.pieces):
        return "a sentencepiece model with user-defined pieces"
    pieces = list(proto.pieces)
    vocab = {p.piece: i for i, p in enumerate(pieces)}
    normal = {p.piece for p in pieces if p.type == Piece.NORMAL}
    merges = sorted((-p.score, i, vocab[p.piece[:k]], vocab[p.piece[k:]]) for i, p in enumerate(pieces)
                    if p.piece in normal for k in range(1, len(p.piece))
                    if p.piece[:k] in normal and p.piece[k:] in normal)
    special = [i for i, p in enumerate(pieces) if p.type in (Piece.CONTROL, Piece.UNKNOWN)]
    unk = pieces[spec.unk_id].piece
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": pieces[i].piece, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for i in special],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": spec.byte_fallback,
                  "ignore_merges": False, "vocab": vocab,
                  "merges": [[pieces[a].piece, pieces[b].piece] for *_, a, b in merges]},
    }
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": unk, "model_max_length": seq_len,
              "clean_up_tokenization_spaces": False, "split_special_tokens": True}
    if spec.eos_id >= 0:
        config["eos_token"] = pieces[spec.eos_id].piece
    return tokenizer, config


README = """# {name}: a megatron_mini GPT-2, exported for Hugging Face transformers

Exported from `{checkpoint}` (step {step}): {layers} layers, hidden {hidden}, {heads} heads,
context {seq_len} tokens, vocabulary {vocab}.

```python
from transformers import AutoTokenizer, GPT2LMHeadModel

model = GPT2LMHeadModel.from_pretrained("{out}")
tok = AutoTokenizer.from_pretrained("{out}")
ids = tok("def main(", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=min(50, {seq_len} - ids.shape[1]), do_sample=False)  # {seq_len} positions
print(tok.decode(out[0], skip_special_tokens=True))
```

The tokenizer is the run's **sentencepiece** BPE (`tokenizer.model`, EOS id {eos} ends a
document, no BOS), not GPT-2's byte-level BPE: do not load it with `GPT2Tokenizer`.
{tokenizer_json}
Keep prompt + generated tokens within {seq_len} positions.
"""


STAGING = ".export"      # an export writes its files in temporary_name's of it, inside out_dir, before moving them
# the files an export writes (the tokenizer's mirror where it can be made), in the order it moves them in: the weights
# last (export)
FILES = ("config.json", "tokenizer.model", "tokenizer.json", "tokenizer_config.json", "README.md", "model.safetensors")


def held_files(out_dir: str) -> list:
    """The files in `out_dir` (none where it is no directory), but an export's lock file and the staging directories
    that killed exports left (the next export takes them away)."""
    return [n for n in os.listdir(out_dir) if n != DirectoryLock.FILE and not is_temporary(n, (STAGING,))] \
        if os.path.isdir(out_dir) else []


def export(checkpoint: str, out_dir: str, tokenizer: str | None = None,
           dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Write the GPT-2 directory `out_dir` (its weights in `dtype`) from a checkpoint (or a run's latest); returns
    the checkpoint read
    (inference.Checkpoint: its path, and notes on newer ones of the run that were passed over). The files
    are written into a staging directory inside `out_dir` (one filesystem) and then moved into place, so an
    export that fails (a full disk) leaves the files already there as they were, and no directory it created;
    its failure to write is an OSError (safetensors' own error too). An earlier export's files that this one does not
    write (its tokenizer.json where this tokenizer has no mirror) are removed. A kill as the files are moved leaves
    the earlier export whole, or no model.safetensors (nothing transformers loads), or this export whole.
    One export at a time writes into `out_dir` (its .lock, removed at the end: another is refused, a ConfigError
    naming it); it first removes the staging directories of exports killed outright (a note on each)."""
    existing = existing_part(out_dir)
    try:
        with DirectoryLock(out_dir, "another export", "Wait for it to finish, or export into another directory."):
            removed = remove_left_temporaries(out_dir, (STAGING,))
            ckpt = _export(checkpoint, out_dir, tokenizer, dtype)
    finally:
        remove_empty_dirs(out_dir, existing)          # (what makedirs created, when nothing was exported into it)
    ckpt.notes[:0] = [f"removed {os.path.join(out_dir, name)} ({size:,} bytes), left by an export that was killed"
                      for name, size in removed]
    return ckpt


def _export(checkpoint: str, out_dir: str, tokenizer: str | None, dtype: torch.dtype) -> Checkpoint:
    """export()'s work in `out_dir`, which exists and whose lock it holds."""
    ckpt, tok = read_with_tokenizer(checkpoint, tokenizer)
    tensors = hf_state_dict(ckpt, dtype)
    m = ckpt.cfg.model
    converted = hf_tokenizer(tok, m.seq_len)
    unmirrored = converted if isinstance(converted, str) else None
    if unmirrored:
        ckpt.notes.append(f"{tok.path}: {unmirrored}; exported as tokenizer.model alone (read it with "
                          f"sentencepiece, not AutoTokenizer)")
    staging = temporary_name(os.path.join(out_dir, STAGING))      # (none is left: the lock's holder removed them)
    os.mkdir(staging)
    try:
        try:
            save_file(tensors, os.path.join(staging, "model.safetensors"), metadata={"format": "pt"})
        except SafetensorError as e:     # (a full disk: "I/O error: No space left on device (os error 28)")
            raise OSError(f"model.safetensors: {e}") from None
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(hf_config(ckpt, tok.eos_id, dtype), f, indent=2)
        with open(os.path.join(staging, "tokenizer.model"), "wb") as f:
            f.write(tok.data)                        # (the bytes find_tokenizer checked, not the path read again)
        for name, content in zip(("tokenizer.json", "tokenizer_config.json"), () if unmirrored else converted):
            with open(os.path.join(staging, name), "w") as f:
                json.dump(content, f)
        mirror = ("`tokenizer.json` is the same BPE for `AutoTokenizer` of transformers >= 4.45 (the same ids; "
                  "`\"</s>\"` in a text is characters, as sentencepiece reads it)." if not unmirrored else
                  f"There is no `tokenizer.json` ({unmirrored}): read "
                  "`tokenizer.model` with `sentencepiece.SentencePieceProcessor`, not `AutoTokenizer` as above.")
        with open(os.path.join(staging, "README.md"), "w") as f:
            f.write(README.format(name=m.name, checkpoint=ckpt.path, step=ckpt.meta.get("step"), layers=m.num_layers,
                                  hidden=m.hidden_size, heads=m.num_heads, seq_len=m.seq_len, vocab=m.vocab_size,
                                  out=os.path.abspath(out_dir), eos=tok.eos_id, tokenizer_json=mirror))
        # safetensors creates its file 0600 whatever the umask: give it the mode the other files got
        os.chmod(os.path.join(staging, "model.safetensors"), os.stat(os.path.join(staging, "config.json")).st_mode)
        staged = os.listdir(staging)
        # the weights out first and in last: a kill in between leaves no model.safetensors, a directory transformers
        # refuses to load (the next export completes it), never one export's weights beside the other's config
        if os.path.lexists(os.path.join(out_dir, "model.safetensors")):
            os.remove(os.path.join(out_dir, "model.safetensors"))
        for name in FILES:
            if name in staged:
                os.replace(os.path.join(staging, name), os.path.join(out_dir, name))
            elif os.path.lexists(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return ckpt
