"""The plain baseline: a nanoGPT-style GPT-2 and its training step in one file, no framework.

    python tools/baseline_gpt2.py [--layers 4 --heads 8 --hidden 256 --seq 256 --mbs 8 --accum 4 --vocab 1024
                                   --steps 10 --threads 2 --device auto --dtype fp32 --compile]

Same model as megatron_mini's (learned positions, pre-LayerNorm blocks, fused QKV, causal
F.scaled_dot_product_attention, GELU(tanh) MLP of width 4h, biases, tied input/output embeddings,
LayerNorm eps 1e-5), laid out [b, s, h] as nanoGPT does, with F.cross_entropy and
torch.optim.AdamW (nanoGPT's decay / no-decay groups, its default implementation on CPU),
gradient accumulation over `accum` microbatches and clipping at 1.0. tools/bench_train.py
times it side by side with the framework on CPU, tools/bench_gpu.py on a GPU.

On a GPU, as nanoGPT runs it: `--dtype bf16` is torch.autocast(bfloat16) around the forward with
fp32 weights, gradients and AdamW state; AdamW is the fused implementation (`fused=True`);
`--compile` wraps the model in torch.compile (mode default); fp32 on CUDA turns TF32 matmuls on
(megatron_mini.hardware.set_tf32, process-wide). The weights are initialised on the
CPU from the seed and then moved, so every device starts from the same model, and the batch
tokens are drawn on the CPU generator seeded with the seed.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from megatron_mini.hardware import set_tf32

from bench.report import at_least
from defaults_help import RawDescriptionDefaultsHelp
from megatron_mini.errors import run_tool


@dataclass
class GPTConfig:
    num_layers: int = 4
    num_heads: int = 8
    hidden_size: int = 256
    seq_len: int = 256
    vocab_size: int = 1024
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.c_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.n_head, self.dropout = cfg.num_heads, cfg.dropout

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.c_attn(x).split(h, dim=2)
        q, k, v = (t.view(b, s, self.n_head, h // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, s, h))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.hidden_size, 4 * cfg.hidden_size)
        self.c_proj = nn.Linear(4 * cfg.hidden_size, cfg.hidden_size)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.hidden_size), CausalSelfAttention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.hidden_size), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight                      # tied
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.num_layers))

    @staticmethod
    def _init(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, 0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, 0.0, 0.02)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def make_optimizer(model: nn.Module, lr: float = 3e-3, weight_decay: float = 0.1,
                   fused: bool = False) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    extra = {"fused": True} if fused else {}
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, **extra)


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class BaselineTrainer:
    """One training step = `accum` microbatches of forward + backward, clip, AdamW, zero_grad.

    device: "cpu" (default), "cuda" or "auto"; dtype: "fp32" (default) or "bf16" (autocast with fp32
    weights); compile: torch.compile the model. On CUDA AdamW is fused and fp32 uses TF32."""

    def __init__(self, cfg: GPTConfig, mbs: int, accum: int, seed: int = 1234, device: str | torch.device = "cpu",
                 dtype: str = "fp32", compile: bool = False):
        if dtype not in ("fp32", "bf16"):
            raise ValueError(f"dtype={dtype!r}: choose fp32 or bf16")
        torch.manual_seed(seed)
        self.cfg, self.mbs, self.accum = cfg, mbs, accum
        self.device, self.dtype = resolve_device(device), dtype
        cuda = self.device.type == "cuda"
        if cuda and dtype == "fp32":
            set_tf32(True)    # the library's switch: one TF32 API in a process that also runs megatron_mini
        self.model = GPT(cfg).to(self.device)       # initialised on the CPU: the same weights on any device
        self.forward = torch.compile(self.model) if compile else self.model
        self.optimizer = make_optimizer(self.model, fused=cuda)
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self) -> torch.Tensor:
        return torch.randint(0, self.cfg.vocab_size, (self.accum, self.mbs, self.cfg.seq_len + 1), generator=self.gen)

    def _autocast(self):
        if self.dtype == "bf16":
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self, batch: torch.Tensor | None = None) -> float:
        batch = self.batch() if batch is None else batch
        if batch.device != self.device:
            batch = (batch.pin_memory() if self.device.type == "cuda" else batch).to(self.device, non_blocking=True)
        self.model.train()
        losses = []
        for micro in batch:
            with self._autocast():
                loss = self.forward(micro[:, :-1], micro[:, 1:]) / self.accum
            loss.backward()
            losses.append(loss.detach())
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return sum(loss.item() for loss in losses)   # read after the step is queued: one wait on a GPU


def _device(text: str) -> str:
    """An argparse type: auto, cpu, cuda or cuda:N (N a GPU's index)."""
    kind, _, index = text.partition(":")
    if text in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"wants auto, cpu, cuda or cuda:N (N the index of a GPU), got {text!r}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=RawDescriptionDefaultsHelp)
    ap.add_argument("--layers", type=at_least(1), default=4, help="transformer blocks")
    ap.add_argument("--heads", type=at_least(1), default=8, help="attention heads (dividing --hidden)")
    ap.add_argument("--hidden", type=at_least(1), default=256, help="hidden size h (the MLP: 4h)")
    ap.add_argument("--seq", type=at_least(1), default=256, help="sequence length")
    ap.add_argument("--vocab", type=at_least(1), default=1024, help="vocabulary size")
    ap.add_argument("--mbs", type=at_least(1), default=8, help="sequences per microbatch")
    ap.add_argument("--accum", type=at_least(1), default=4, help="microbatches per step (gradient accumulation)")
    ap.add_argument("--steps", type=at_least(1), default=10, help="timed steps (the median is reported)")
    ap.add_argument("--warmup", type=at_least(0), default=2, help="untimed steps before them")
    ap.add_argument("--threads", type=at_least(1), default=2, help="CPU threads (torch.set_num_threads)")
    ap.add_argument("--device", default="auto", type=_device, metavar="{auto,cpu,cuda,cuda:N}",
                    help="auto: cuda when available; cpu, cuda or cuda:N (the Nth visible GPU)")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                    help="bf16: torch.autocast(bfloat16) with fp32 weights (nanoGPT's mixed precision)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    args = ap.parse_args(argv)
    if args.hidden % args.heads:
        ap.error(f"--hidden {args.hidden} is not divisible by --heads {args.heads}")
    gpus = torch.cuda.device_count()
    if args.device.startswith("cuda") and not gpus:
        ap.error(f"--device {args.device}: this machine has no CUDA device (use --device cpu or auto)")
    if args.device.startswith("cuda:") and int(args.device[5:]) >= gpus:
        ap.error(f"--device {args.device}: this machine has {gpus} CUDA device{'s' if gpus > 1 else ''} "
                 f"(cuda:0 to cuda:{gpus - 1})")
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda:"):
        torch.cuda.set_device(int(args.device[5:]))      # (what torch puts on "cuda", compile's kernels included)
    cfg = GPTConfig(args.layers, args.heads, args.hidden, args.seq, args.vocab)
    trainer = BaselineTrainer(cfg, args.mbs, args.accum, device=args.device, dtype=args.dtype, compile=args.compile)
    sync = (lambda: torch.cuda.synchronize(trainer.device)) if trainer.device.type == "cuda" else (lambda: None)
    print(f"device {trainer.device}, {args.dtype}{', compiled' if args.compile else ''}")
    times = []
    for step in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        loss = trainer.train_step()
        sync()
        dt = time.perf_counter() - t0
        if step >= args.warmup:
            times.append(dt)
        print(f"step {step:3d} loss {loss:.4f} {dt * 1e3:.0f} ms")
    tokens = args.mbs * args.accum * args.seq
    print(f"median {statistics.median(times) * 1e3:.0f} ms/step, {tokens / statistics.median(times):,.0f} tokens/s")


if __name__ == "__main__":
    run_tool(main)
