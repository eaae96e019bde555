"""What the training benchmarks run: the S2 shape, seeded synthetic tokens, and one training step of
a megatron_mini Trainer or of the plain GPT-2 of tools/baseline_gpt2.py."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from megatron_mini.config import ModelConfig, PrecisionConfig, TrainConfig, WandbConfig

S2 = ModelConfig(name="S2", num_layers=4, hidden_size=256, num_heads=8, seq_len=256, vocab_size=1024)
SMOKE = replace(S2, name="smoke", hidden_size=64, num_heads=8, seq_len=32, vocab_size=256)   # --smoke
MBS, GBS = 8, 32


def lib_cfg(model: ModelConfig, **overrides) -> TrainConfig:
    """A TrainConfig of `model` at mbs 8, gbs 32 on the CPU, with no logging, eval or checkpoints;
    `dtype=` sets the precision, any other key a TrainConfig field."""
    cfg = TrainConfig(model=model, mbs=MBS, gbs=GBS, steps=100_000, kernels="torch", device="cpu",
                      wandb=WandbConfig(mode="disabled"), log_interval=10 ** 9, eval_interval=0, resume="never")
    for key, value in overrides.items():
        if key == "dtype":
            cfg = replace(cfg, precision=PrecisionConfig(dtype=value))
        else:
            cfg = replace(cfg, **{key: value})
    return cfg


class SyntheticTokens:
    """Seeded random token ids < vocab: item i is the same array whoever asks."""

    def __init__(self, vocab: int, seq_len: int, seed: int):
        self.vocab, self.seq_len, self.seed = vocab, seq_len, seed

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, i: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, int(i)])
        return rng.integers(0, self.vocab, self.seq_len + 1, dtype=np.int64)


def synthetic_datasets(model: ModelConfig) -> tuple:
    """(train, validation, tokenizer) as a Trainer takes them: seeds 1 and 2, no tokenizer."""
    return tuple(SyntheticTokens(model.vocab_size, model.seq_len, seed) for seed in (1, 2)) + (None,)


class LibRunner:
    """One megatron_mini Trainer on synthetic data (train_step's loss; `skipped`: whether the last step was
    an fp16 overflow the optimizer skipped)."""

    def __init__(self, cfg: TrainConfig, mesh, device: torch.device = torch.device("cpu")):
        from megatron_mini.training import Trainer
        self.cfg, self.mesh, self.skipped = cfg, mesh, False
        self.tf32 = cfg.precision.tf32
        self.trainer = Trainer(cfg, mesh, synthetic_datasets(cfg.model), device)

    def params(self) -> list:
        return [p for c in self.trainer.chunks for p in c.parameters()]

    def step(self) -> float:
        out = self.trainer.train_step()
        self.skipped = bool(out.get("skipped", False))
        return out["loss"]

    def memory_bytes(self) -> dict:
        """Optimizer.memory_bytes() of this rank, and its parameter count."""
        return dict(self.trainer.optimizer.memory_bytes(), params=sum(p.numel() for p in self.params()))


class BaselineRunner:
    """tools/baseline_gpt2.py's trainer at `model`'s shape (its padded vocabulary), mbs x m microbatches.
    `tokens`: a dataset of token rows, batched by megatron_mini.dataset.get_batch as the framework's are
    (the same sequences at the same step); None: the baseline's own random tokens."""
    skipped = False

    def __init__(self, model: ModelConfig, mbs: int, m: int, device: torch.device | str = "cpu", dtype: str = "fp32",
                 compile: bool = False, tokens=None):
        from baseline_gpt2 import BaselineTrainer, GPTConfig
        cfg = GPTConfig(model.num_layers, model.num_heads, model.hidden_size, model.seq_len, model.padded_vocab_size)
        self.trainer = BaselineTrainer(cfg, mbs, m, device=device, dtype=dtype, compile=compile)
        self.tf32 = self.trainer.device.type == "cuda" and dtype == "fp32"      # BaselineTrainer's rule
        self.tokens, self.mbs, self.gbs, self.consumed = tokens, mbs, mbs * m, 0

    def params(self) -> list:
        return list(self.trainer.model.parameters())

    def step(self) -> float:
        if self.tokens is None:
            return self.trainer.train_step()
        from megatron_mini.dataset import get_batch
        batch = get_batch(self.tokens, self.consumed, self.gbs, self.mbs, 0, 1)
        self.consumed += self.gbs
        return self.trainer.train_step(batch)
