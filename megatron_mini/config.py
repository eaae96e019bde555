"""One typed config object for a run, registered with Hydra's ConfigStore.

`TrainConfig` is the schema: Hydra (train.py) fills it from conf/*.yaml and the command
line, rejects unknown keys and wrong types, and `validate()` checks the layout against
the world size before any process group exists. Tests build `TrainConfig(...)` directly.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional


class ConfigError(Exception):
    """A bad configuration: the message is shown as is, on one rank, and every rank exits 2."""


@dataclass
class ModelConfig:
    name: str = "tiny"
    num_layers: int = 8
    hidden_size: int = 128
    num_heads: int = 4
    seq_len: int = 128
    vocab_size: int = 8192           # the tokenizer's size; the embedding is padded (below)
    vocab_pad_multiple: int = 128    # layout-independent padding (never depends on tp)
    label_smoothing: float = 0.0
    ffn_mult: int = 4
    dropout: float = 0.0
    ln_eps: float = 1e-5
    init_std: float = 0.02

    @property
    def padded_vocab_size(self) -> int:
        return int(math.ceil(self.vocab_size / self.vocab_pad_multiple) * self.vocab_pad_multiple)

    @property
    def ffn_hidden_size(self) -> int:
        return self.ffn_mult * self.hidden_size

    def num_params(self) -> int:
        """Exact parameter count of the GPT-2 model (tied embeddings, padded vocabulary)."""
        h, L = self.hidden_size, self.num_layers
        block = 4 * h * h + 4 * h + 2 * self.ffn_hidden_size * h + self.ffn_hidden_size + h + 4 * h
        return self.padded_vocab_size * h + self.seq_len * h + L * block + 2 * h

    def flops_per_token(self) -> int:
        """Model FLOPs of one trained token, forward + backward (recomputation not counted):

            6 N + 12 L h s,   N = L (4 h^2 + 2 h f) + V h   (f = ffn width, V = padded vocabulary)

        6 N: 2 FLOPs per weight per token forward, 4 backward, for every matrix (the attention
        projections, the MLP, the logits); 12 L h s: q k^T and P v (2 s h each per token and layer,
        x 3 for forward + backward), counted for the full s x s square as Megatron, PaLM and
        nanoGPT count it. Biases, LayerNorm and the embedding lookup are left out."""
        h, L = self.hidden_size, self.num_layers
        n = L * (4 * h * h + 2 * h * self.ffn_hidden_size) + self.padded_vocab_size * h
        return 6 * n + 12 * L * h * self.seq_len


@dataclass
class DataConfig:
    source: str = "stdlib"          # "stdlib", a directory of .txt files, or a .jsonl with a "text" field
    dir: str = "data/stdlib-v8192"  # where tokenizer.model, tokens.bin/.idx and meta.json live
    vocab_size: int = 8192
    val_fraction: float = 0.02      # fraction of documents held out for validation
    tokenizer_sample_chars: int = 12_000_000  # text fed to sentencepiece training
    tokenizer_seed: int = 1234      # seeds the sample of text chunks the tokenizer is trained on
    num_workers: int = 2


@dataclass
class OptimizerConfig:
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0           # 0 disables clipping


@dataclass
class PrecisionConfig:
    dtype: str = "fp32"              # fp32 | fp16 | bf16
    tf32: bool = True                # CUDA: fp32 matmuls on TF32 tensor cores (10-bit mantissa inputs)
    peak_tflops: float = 0.0         # the MFU denominator per GPU; 0: from hardware.py's table
    # fp16 dynamic loss scaling (Megatron-LM defaults)
    initial_loss_scale: float = 2.0 ** 32
    loss_scale_growth_factor: float = 2.0
    loss_scale_growth_interval: int = 1000
    loss_scale_backoff_factor: float = 0.5
    loss_scale_hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass
class WandbConfig:
    mode: str = "auto"               # auto (online with an API key, else offline) | online | offline | disabled
    project: str = "megatron_mini"
    group: Optional[str] = None
    name: Optional[str] = None


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # layout (dp is derived from the world size)
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    sp: bool = False
    zero: int = 0                    # 0 or 1
    schedule: str = "1f1b"           # gpipe | 1f1b (interleaved when vpp > 1)
    embedding_stage: str = "none"    # none | layer | own
    pipeline_first_blocks: int = 0   # explicit block count of the first block stage (0: balanced)
    pipeline_last_blocks: int = 0    # explicit block count of the last block stage (0: balanced)
    recompute: str = "none"          # none | full | selective
    kernels: str = "auto"            # auto (torch, or triton where measured faster on this GPU) | triton | torch
    compile: bool = False            # torch.compile each block (collectives and linears stay eager)
    # batch and schedule
    mbs: int = 4
    gbs: int = 32
    steps: int = 300
    seed: int = 1234
    # bookkeeping
    run_dir: str = "runs/${run_name}"
    run_name: str = "tiny-dp"
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 8
    save_interval: int = 0           # 0: only at the end
    resume: str = "auto"             # auto | never | PATH to a checkpoint directory
    device: str = "auto"             # auto (a GPU per rank when there are enough, else CPU) | cpu | cuda
    dist_backend: str = "auto"       # auto (nccl on CUDA unless ranks share a GPU, else gloo) | nccl | gloo
    timeout_s: int = 300             # collective timeout

    def num_microbatches(self, dp: int) -> int:
        return self.gbs // (self.mbs * dp)


def validate(cfg: TrainConfig, world_size: int) -> int:
    """Check the layout and shapes; return dp. Raises ConfigError with one paragraph."""
    m = cfg.model
    for key in ("tp", "pp", "vpp", "mbs", "gbs", "steps"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"{key}={getattr(cfg, key)} must be >= 1.")
    model_parallel = cfg.tp * cfg.pp
    if world_size < model_parallel:
        raise ConfigError(
            f"The layout tp={cfg.tp} x pp={cfg.pp} needs at least {model_parallel} processes "
            f"(tp={cfg.tp} x pp={cfg.pp} x dp=1), but this run has {world_size}. "
            f"Launch it with: torchrun --nproc_per_node={model_parallel} train.py tp={cfg.tp} pp={cfg.pp}"
        )
    if world_size % model_parallel:
        raise ConfigError(
            f"World size {world_size} is not divisible by tp x pp = {cfg.tp} x {cfg.pp} = {model_parallel}; "
            f"use a multiple of {model_parallel} processes (dp = world_size / (tp x pp))."
        )
    dp = world_size // model_parallel
    if cfg.gbs % (cfg.mbs * dp):
        raise ConfigError(
            f"gbs={cfg.gbs} is not divisible by mbs x dp = {cfg.mbs} x {dp} = {cfg.mbs * dp}; "
            f"choose gbs as a multiple of {cfg.mbs * dp}."
        )
    if m.num_heads % cfg.tp:
        raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by tp={cfg.tp}.")
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by num_heads={m.num_heads}.")
    if m.padded_vocab_size % cfg.tp:
        raise ConfigError(
            f"The padded vocabulary {m.padded_vocab_size} (vocab_size={m.vocab_size} padded to a multiple of "
            f"{m.vocab_pad_multiple}) is not divisible by tp={cfg.tp}; set model.vocab_pad_multiple to a multiple of {cfg.tp}."
        )
    if m.ffn_hidden_size % cfg.tp:
        raise ConfigError(f"The MLP width {m.ffn_hidden_size} is not divisible by tp={cfg.tp}.")
    if cfg.sp and m.seq_len % cfg.tp:
        raise ConfigError(f"Sequence parallelism needs model.seq_len={m.seq_len} divisible by tp={cfg.tp}.")
    if cfg.precision.dtype not in ("fp32", "fp16", "bf16"):
        raise ConfigError(f"precision.dtype={cfg.precision.dtype!r}: choose fp32, fp16 or bf16.")
    if cfg.zero not in (0, 1):
        raise ConfigError(f"zero={cfg.zero}: only ZeRO stage 0 (off) and 1 are supported.")
    if cfg.schedule not in ("gpipe", "1f1b"):
        raise ConfigError(f"schedule={cfg.schedule!r}: choose gpipe or 1f1b (interleaved when vpp > 1).")
    if cfg.embedding_stage not in ("none", "layer", "own"):
        raise ConfigError(f"embedding_stage={cfg.embedding_stage!r}: choose none, layer or own.")
    if cfg.recompute not in ("none", "full", "selective"):
        raise ConfigError(f"recompute={cfg.recompute!r}: choose none, full or selective.")
    if cfg.kernels not in ("auto", "triton", "torch"):
        raise ConfigError(f"kernels={cfg.kernels!r}: choose auto, triton or torch.")
    if cfg.wandb.mode not in ("auto", "online", "offline", "disabled"):
        raise ConfigError(f"wandb.mode={cfg.wandb.mode!r}: choose auto, online, offline or disabled.")
    return dp


def register_configs() -> None:
    """Store TrainConfig in Hydra's ConfigStore as "base_config" (the schema conf/config.yaml starts from)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base_config", node=TrainConfig)
