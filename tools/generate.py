"""Sample text from a megatron_mini checkpoint on one process (CUDA when available, else CPU).

    python tools/generate.py runs/tiny-dp/checkpoints/step_000300 --prompt 'def main(' --max-new-tokens 200
    python tools/generate.py runs/tiny-dp --temperature 0      # a run directory: its latest checkpoint; greedy
    python tools/generate.py runs/tiny-dp --top-k 0 --top-p 0.9   # nucleus sampling
    python tools/generate.py runs/gpt2-medium --dtype bf16        # the weights in bf16: half the memory

The model is megatron_mini's own at tp=pp=dp=1 (megatron_mini/inference.py), decoding with a KV
cache: the prompt is prefilled once, then each new token runs one position; once the text fills the
model's window (seq_len) the last half window is prefilled again. --no-kv-cache reruns the last
seq_len tokens for every token instead (for comparison). Sampling stops at EOS (end of a document);
an empty prompt starts from EOS, i.e. at the start of a document; a prompt longer than seq_len is cut
to its last seq_len tokens (a note on stderr says so). The text goes to stdout; the checkpoint, device,
the prompt's prefill time and the tokens/s after it (a one-token warmup run first) go to stderr.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

from checkpoint_args import add_checkpoint_arguments, chosen_device, open_chosen
from defaults_help import DefaultsHelp
from megatron_mini.inference import CheckpointError, generate
from megatron_mini.errors import run_tool


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelp)
    add_checkpoint_arguments(p)
    p.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to sample after the prompt")
    p.add_argument("--temperature", type=float, default=0.8, help="divides the logits before sampling; 0: greedy")
    p.add_argument("--top-k", type=int, default=50, help="sample among the k most likely tokens; 0: all")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="then among the fewest most likely whose probabilities sum to at least p (nucleus); 1: all")
    p.add_argument("--seed", type=int, default=1234, help="of the sampling")
    p.add_argument("--num-samples", type=int, default=1, help="continuations of the prompt")
    p.add_argument("--no-kv-cache", dest="kv_cache", action="store_false",
                   help="rerun the last seq_len tokens for every new token (slower; for comparison)")
    args = p.parse_args(argv)
    for name in ("max_new_tokens", "temperature", "top_k"):
        if not getattr(args, name) >= 0:                                  # (NaN is not >= 0)
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if not 0 < args.top_p <= 1:
        p.error("--top-p must be in (0, 1]")
    if args.temperature == math.inf:
        p.error("--temperature must be finite")
    if args.num_samples < 1:
        p.error("--num-samples must be >= 1")
    if not 0 <= args.seed < 2 ** 64:
        p.error("--seed must be in [0, 2**64)")
    args.device = chosen_device(p, args)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        ckpt, tok, model = open_chosen(args)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompt = tok.encode(args.prompt) or [tok.eos_id]
    seq_len = ckpt.cfg.model.seq_len
    if len(prompt) > seq_len:
        print(f"note: the model's context is {seq_len} tokens: the first {len(prompt) - seq_len} of the prompt's "
              f"{len(prompt)} tokens are dropped (the printed text keeps them)", file=sys.stderr)
    generator = torch.Generator(args.device).manual_seed(args.seed)
    timing = {}
    try:
        if args.max_new_tokens:      # warmup: the first call's one-off set-up is not timed
            generate(model, prompt, 1, 0.0, kv_cache=args.kv_cache)
        samples = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.num_samples,
                           tok.eos_id, generator, kv_cache=args.kv_cache, timing=timing, top_p=args.top_p)
    except FloatingPointError as e:                        # (logits beyond fp16's range)
        print(f"error: {e}", file=sys.stderr)
        return 2
    decoded = sum(max(len(new) - 1, 0) for new in samples)              # the tokens after the first of each sample
    rate = f"{decoded / timing['decode_s']:.1f} tokens/s" if decoded and timing["decode_s"] > 0 else "-"
    if args.max_new_tokens:
        fed = min(len(prompt), seq_len)
        print(f"prefill of {fed} token{'s' * (fed != 1)} x {args.num_samples}: {timing['prefill_s']:.3f} s; "
              f"then {decoded} tokens in {timing['decode_s']:.2f} s: {rate} "
              f"({'KV cache' if args.kv_cache else 'no KV cache'})", file=sys.stderr)
    for i, new in enumerate(samples):
        if args.num_samples > 1:
            print(f"----- sample {i + 1} -----")
        print(tok.decode(prompt + new))
    return 0


if __name__ == "__main__":
    run_tool(main)
