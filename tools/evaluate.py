"""The loss and perplexity of a megatron_mini checkpoint on its validation set or on prepared directories.

    python tools/evaluate.py runs/tiny-dp                         # what its evaluations read: its logged losses
    python tools/evaluate.py runs/tiny-dp data/wiki data/code     # directories prepared with the run's tokenizer
    python tools/evaluate.py runs/tiny-dp data/wiki --samples 0   # every sample of each
    python tools/evaluate.py runs/blended --samples 0             # every validation sample of each blended directory

One process (CUDA when available, else CPU), the model at tp=pp=dp=1 in fp32 (megatron_mini/inference.py;
--dtype bf16 or fp16: half the memory, to within that type's rounding; logits that are not finite, an fp16
activation past its range, are an error).
Without directories it reads what the run's evaluations read: its validation set and its data.eval sets. The
samples are the run's own: by default the eval_iters x gbs that each of its evaluations reads, so the figures
are its logged val_loss (a blend's: val_loss/<dir> too, in parentheses) and eval_loss/<dir> (a directory is
read as data.eval reads it), to within the
rounding of another layout and precision, and of label smoothing, which is not applied here. The
directories must be encoded with the run's tokenizer (tools/prepare_data.py data.tokenizer=...). A run's
relative data paths are read from the current directory, else the repository root; a set of the run's that
cannot be read (a data.eval directory gone) is a note, the others are evaluated. More samples than a set holds read
some of them twice or more (its next epochs, as a run's evaluation does): a note says so.
"""
from __future__ import annotations

import argparse
import math
import sys
import time

from checkpoint_args import add_checkpoint_arguments, chosen_device, open_chosen
from defaults_help import DefaultsHelp
from megatron_mini.config import ConfigError
from megatron_mini.inference import CheckpointError, evaluation_sets, mean_losses, whole_sets
from megatron_mini.errors import run_tool


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelp)
    add_checkpoint_arguments(p)
    p.add_argument("dirs", nargs="*", help="prepared directories to evaluate (default: the run's validation set and "
                                           "data.eval sets)")
    p.add_argument("--samples", type=int, help="samples of each (default: the run's eval_iters x gbs; 0: all, a "
                                               "blend's directories each whole, on a line of its own)")
    p.add_argument("--batch", type=int, help="samples per forward (default: the run's mbs)")
    args = p.parse_args(argv)
    if args.samples is not None and args.samples < 0:
        p.error("--samples must be >= 0 (0: all)")
    if args.batch is not None and args.batch < 1:
        p.error("--batch must be >= 1")
    args.device = chosen_device(p, args)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        ckpt, tok, model = open_chosen(args)
        sets, notes = evaluation_sets(ckpt, tok, args.dirs)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    cfg = ckpt.cfg
    if cfg.model.label_smoothing:
        print(f"note: the run trained with model.label_smoothing={cfg.model.label_smoothing}, which its logged "
              f"losses include; these are the plain cross entropy", file=sys.stderr)
    names = [directory for _, directory in cfg.data.parts()]           # (a blend's validation set's directories)
    if args.samples == 0:
        sets = whole_sets(sets, names)
    for name, dataset in sets.items():
        samples = len(dataset) if args.samples == 0 else args.samples or cfg.eval_iters * cfg.gbs
        if samples > len(dataset):         # (dataset[i] runs on into its next epochs, as a run's evaluation does)
            print(f"note: {name}: {samples:,} samples, but it holds {len(dataset):,}, so some are read twice or more "
                  f"(--samples 0: each once)", file=sys.stderr)
        start = time.perf_counter()
        try:
            losses = mean_losses(model, dataset, samples, args.batch or cfg.mbs, names)
        except FloatingPointError as e:                    # (logits beyond fp16's range)
            print(f"error: {name}: {e}", file=sys.stderr)
            return 2
        loss = losses.pop(None)
        parts = f" ({', '.join(f'{d} {part:.4f}' for d, part in losses.items())})" if losses else ""
        print(f"{name}: loss {loss:.4f}{parts} | perplexity {math.exp(loss):.2f} | {samples:,} samples of "
              f"{cfg.model.seq_len} tokens{' (its epoch)' if samples == len(dataset) else ''} | "
              f"{time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    run_tool(main)
