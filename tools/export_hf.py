"""Export a megatron_mini checkpoint as a Hugging Face transformers GPT-2 model directory.

    python tools/export_hf.py runs/tiny-dp/checkpoints/step_000300 hf/tiny-dp
    python -c "from transformers import GPT2LMHeadModel; GPT2LMHeadModel.from_pretrained('hf/tiny-dp')"

OUT_DIR gets config.json, model.safetensors (fp32; --dtype bf16 or fp16: half the size), tokenizer.model
(the run's sentencepiece model: not GPT-2's BPE), the same tokenizer as tokenizer.json and tokenizer_config.json
(for AutoTokenizer: the same ids) and a README.md on loading them. A checkpoint of any
layout (tp, pp, vpp, dp, ZeRO) exports the same way; the name map and the conversion are in
megatron_mini/hf.py. One export at a time writes into OUT_DIR (another is refused, naming it); an export removes
the staging directory (.export.tmp<pid>, a copy of the weights) that one killed outright left there.
"""
from __future__ import annotations

import argparse
import os
import sys

from checkpoint_args import add_checkpoint_arguments, chosen_dtype
from defaults_help import DefaultsHelp
from megatron_mini.errors import ConfigError, run_tool
from megatron_mini.hf import export, held_files
from megatron_mini.inference import CheckpointError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelp)
    add_checkpoint_arguments(p, device=False)
    p.add_argument("out_dir", help="the Hugging Face model directory to write")
    args = p.parse_args(argv)
    if os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        print(f"error: {args.out_dir} exists and is not a directory", file=sys.stderr)
        return 2
    held = held_files(args.out_dir)      # (a data directory, say; an export killed half-way may be redone)
    if held and "config.json" not in held:
        print(f"error: {args.out_dir} holds files but no config.json, so it is no model directory whose export "
              f"this would replace: export into a new or empty directory", file=sys.stderr)
        return 2
    try:
        ckpt = export(args.checkpoint, args.out_dir, args.tokenizer, chosen_dtype(args))
    except (CheckpointError, ConfigError) as e:       # (ConfigError: another export is writing into out_dir)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write {args.out_dir}: {e.strerror or e}", file=sys.stderr)
        return 2
    for note in ckpt.notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"exported {ckpt.path} -> {args.out_dir}")
    return 0


if __name__ == "__main__":
    run_tool(main)
