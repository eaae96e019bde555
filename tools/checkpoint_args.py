"""What the tools that read a checkpoint share (generate.py, evaluate.py, export_hf.py): the arguments naming the
checkpoint, its tokenizer, the device and the dtype, the device and dtype they choose, and the model they open."""
from __future__ import annotations

import argparse

import torch

from megatron_mini.hardware import configure_device
from megatron_mini.inference import device_for, open_checkpoint
from megatron_mini.rank import DTYPES


def add_checkpoint_arguments(p: argparse.ArgumentParser, device: bool = True) -> None:
    """CHECKPOINT (first positional), --tokenizer, --dtype (a key of DTYPES) and, with `device`, --device."""
    p.add_argument("checkpoint", help="a checkpoint directory (runs/NAME/checkpoints/step_N) or a run directory")
    p.add_argument("--tokenizer", help="sentencepiece model (default: the checkpoint's own tokenizer.model; in a "
                                       "checkpoint older than that copy, data.dir's of the run, or its data.blend's "
                                       "first directory's)")
    p.add_argument("--dtype", default="fp32", choices=list(DTYPES),
                   help="the weights' type (bf16, fp16: half the memory); generate and evaluate also "
                        "compute in it (faster on a GPU), LayerNorm statistics in fp32")
    if device:
        p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                       help="auto: CUDA when there is a GPU, else the CPU")


def chosen_device(p: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """--device as a torch.device (auto: CUDA when there is one); a parser error for cuda on a machine without."""
    try:
        return device_for(args.device)
    except ValueError as e:
        p.error(f"--device {e}")


def chosen_dtype(args: argparse.Namespace) -> torch.dtype:
    """--dtype as a torch.dtype."""
    return DTYPES[args.dtype]


def open_chosen(args: argparse.Namespace) -> tuple:
    """(checkpoint, tokenizer, model) of CHECKPOINT with --tokenizer, on args.device (chosen_device) in --dtype, the
    device configured first as train.py's ranks configure theirs (on the CPU freed memory reused; no TF32 on CUDA).
    CheckpointError where CHECKPOINT cannot be read (inference.open_checkpoint)."""
    configure_device(args.device)
    return open_checkpoint(args.checkpoint, args.tokenizer, args.device, chosen_dtype(args))
