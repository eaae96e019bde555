"""One typed config object for a run, registered with Hydra's ConfigStore.

`TrainConfig` is the schema: Hydra (train.py) fills it from conf/*.yaml and the command line,
and rejects wrong types and, for the Enum fields, values outside their choices; `check_keys`
refuses keys that are no field (Hydra's `+key=value` would add them); `validate()` checks every
value's range and the layout against the world size before any process group exists. Tests build
`TrainConfig(...)` directly (plain strings for the choices are accepted and converted by validate).
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
import os
from dataclasses import dataclass, field
from enum import Enum
from fractions import Fraction
from pathlib import PurePath
from typing import List, Optional

from .checkpoint_dir import resume_path
from .errors import ConfigError, RunError  # noqa: F401  (re-exported: the errors of a config and a run)
from .partition import partition
from .schedules import KINDS, check_schedule


class Choice(str, Enum):
    """A config choice: an Enum for Hydra (which refuses other values), a str everywhere else
    (`cfg.device == "cpu"`, f-strings and JSON show the value)."""

    def __str__(self) -> str:
        return self.value

    __format__ = str.__format__


def choice(name: str, *values: str) -> type:
    """A Choice whose member names are its values (the functional API allows names like "1f1b")."""
    return Choice(name, [(v, v) for v in values])


Device = choice("Device", "auto", "cpu", "cuda")
Backend = choice("Backend", "auto", "nccl", "gloo")
DType = choice("DType", "fp32", "fp16", "bf16")
Schedule = choice("Schedule", *KINDS)
EmbeddingStage = choice("EmbeddingStage", "none", "layer", "own")
Recompute = choice("Recompute", "none", "full", "selective")
Decay = choice("Decay", "cosine", "linear", "sqrt", "constant")
# the last three: Triton for that op only
Kernels = choice("Kernels", "auto", "triton", "torch", "layer_norm", "attention", "cross_entropy")
WandbMode = choice("WandbMode", "auto", "online", "offline", "disabled")


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
        f = self.layer_flops_per_token()
        return self.num_layers * f["block"] + f["head"]

    def layer_flops_per_token(self, recompute: str = "none") -> dict:
        """flops_per_token() per layer kind, {"embedding", "block", "head"}; recomputation adds what it
        runs again: the attention core's q k^T and P v (selective, one fused kernel on a GPU), or a block's
        forward (full) but for its last GEMM, fc2 (2 h f), when no dropout follows it: torch's
        non-reentrant checkpoint stops recomputing once every tensor saved for backward is back, and fc2
        saves its input before it multiplies."""
        h, s, f = self.hidden_size, self.seq_len, self.ffn_hidden_size
        matmuls, attention = 4 * h * h + 2 * h * f, 2 * h * s                          # per token, forward
        fc2 = 0 if self.dropout else 2 * h * f
        rerun = {"none": 0, "full": 2 * matmuls + 2 * attention - fc2, "selective": 2 * attention}[recompute]
        return {"embedding": 0, "block": 6 * matmuls + 6 * attention + rerun, "head": 6 * self.padded_vocab_size * h}


@dataclass
class DataConfig:
    source: str = "stdlib"          # "stdlib", a .jsonl (.jsonl.gz) file, or a directory of them and of .txt files
    text_key: str = "text"          # the field of a .jsonl line that holds its document
    tokenizer: Optional[str] = None  # a tokenizer.model to encode the corpus with (another data.dir's: its runs'
                                     # checkpoints can then init_from), instead of training one
    dir: str = "data/stdlib-v8192"  # where tokenizer.model, tokens.bin/.idx and meta.json live
    blend: Optional[List[str]] = None  # [weight, dir, weight, dir, ...]: train on prepared directories mixed by
                                     # weight (Megatron's --data-path; one tokenizer), data.dir unread (null: data.dir)
    eval: Optional[List[str]] = None  # prepared directories (the run's tokenizer) also evaluated at each evaluation,
                                     # the same samples whatever the run's seed or data: eval_loss/<dir>
    vocab_size: int = 8192
    val_fraction: float = 0.02      # fraction of documents held out for validation
    tokenizer_sample_chars: int = 12_000_000  # text fed to sentencepiece training
    tokenizer_seed: int = 1234      # seeds the sample of text chunks the tokenizer is trained on
    num_workers: int = 2            # processes encoding the corpus

    def parts(self) -> list[tuple[Fraction, str]]:
        """[(share, directory)] of the prepared data a run reads: `blend`'s weights as exact fractions of their
        sum, in its order, else [(1, dir)]. ConfigError for a blend that is no list of weight, directory pairs, a
        weight that is no positive number, or a directory named twice."""
        if self.blend is None:
            return [(Fraction(1), self.dir)]
        items, example = [str(v).strip() for v in self.blend], "data.blend=[0.7,data/web,0.3,data/code]"
        if not items or len(items) % 2:
            raise ConfigError(f"data.blend={list(self.blend)} must be weight, directory pairs, as in {example}: "
                              f"{len(items)} item{'s' * (len(items) != 1)} are no pairs.")
        weights = []
        for w in items[::2]:
            try:
                weights.append(Fraction(w))
            except (ValueError, ZeroDivisionError):
                raise ConfigError(f"data.blend: {w!r} stands where a weight must (a number > 0), as in "
                                  f"{example}.") from None
            if weights[-1] <= 0:
                raise ConfigError(f"data.blend: the weight {w} must be > 0 (leave a directory out to read none "
                                  f"of it).")
        dirs = items[1::2]
        _check_dirs("data.blend", dirs, ", with the sum of its weights")
        total = sum(weights)
        return [(w / total, _spelled(d)) for w, d in zip(weights, dirs)]

    def check_blend_alone(self) -> None:
        """ConfigError where a data.blend stands beside the keys of a corpus to prepare (data.source, data.text_key,
        data.tokenizer): a blend trains on directories already prepared, and would leave them unread."""
        if self.blend is None:
            return
        unread = [f"data.{k}={getattr(self, k)}" for k in ("source", "text_key", "tokenizer")
                  if getattr(self, k) != getattr(DataConfig, k)]
        corpus = [u for u in unread if not u.startswith("data.tokenizer=")]
        if corpus:
            tokenizer = PurePath(self.parts()[0][1], "tokenizer.model")
            raise ConfigError(f"data.blend mixes directories already prepared, and reads no corpus: "
                              f"{' and '.join(unread)} would be unread. Prepare that corpus on its own first "
                              f"(tools/prepare_data.py {' '.join(corpus)} data.dir=DIR data.tokenizer={tokenizer}), "
                              f"then add DIR to the blend.")
        if unread:
            raise ConfigError(f"data.blend mixes directories already prepared, each with the tokenizer it was encoded "
                              f"with (one for all): {unread[0]} would be unread; leave it out.")

    def check_dirs_on_disk(self) -> None:
        """check_dirs_on_disk of data.blend's directories and of data.eval's, which a run reads."""
        if self.blend is not None:
            check_dirs_on_disk("data.blend", [d for _, d in self.parts()], ", with the sum of its weights")
        check_dirs_on_disk("data.eval", self.eval_dirs())

    def eval_dirs(self, key: str = "data.eval") -> list[str]:
        """data.eval's directories ([] without it); ConfigError for an empty list, an empty name, or one named twice
        (by `key`: data.eval, or a tool's argument that gave them)."""
        if self.eval is None:
            return []
        dirs = [str(d).strip() for d in self.eval]
        if not dirs:
            raise ConfigError("data.eval=[] names no directory: name the prepared directories each evaluation also "
                              "reads (null: none).")
        _check_dirs(key, dirs, "")
        return [_spelled(d) for d in dirs]


def check_dirs_on_disk(key: str, dirs: list, hint: str = "") -> None:
    """ConfigError where two of `dirs` (of config key `key`) are one directory on this machine's file system (a link
    to another, an absolute and a relative path): checked by what reads them (DataConfig.check_dirs_on_disk), never of
    a checkpoint's config by a tool that reads no data, on a machine where the run's paths may be others' or none."""
    _check_dirs(key, dirs, hint, os.path.realpath)


def _spelled(directory) -> str:
    """A directory's name as a run uses it (its metrics' keys: loss/<dir>, eval_loss/<dir>), whatever the spelling:
    "./data/web/" is "data/web" (".." is kept: a link may stand before it)."""
    return str(PurePath(directory))


def _check_dirs(key: str, dirs: list, hint: str, same_path=_spelled) -> None:
    """ConfigError where `dirs` (of config key `key`) holds an empty name, or a directory twice: by its name
    (`same_path` _spelled: A and ./A/, not link/../A and A, a check of values that a checkpoint's config passes on any
    machine), or on this machine's file system (os.path.realpath: a link to it too; check_dirs_on_disk)."""
    for d in dirs:
        same = [x for x in dirs if same_path(x) == same_path(d)]
        if not d or len(same) > 1:
            twice = f"{d} twice" + (f" (as {' and '.join(same)})" if len(set(same)) > 1 else "")
            raise ConfigError(f"{key} names {twice if d else 'an empty directory'}: give each prepared directory "
                              f"once{hint}.")


@dataclass
class OptimizerConfig:
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    decay_style: Decay = Decay.cosine  # from lr after the warmup to min_lr (constant: lr throughout)
    decay_steps: int = 0             # min_lr from step decay_steps on, warmup counted (0: from the last step)
    cooldown_steps: int = 0          # WSD: lr held after the warmup, decayed over the decay's last N steps only
                                     # (0: from the warmup's end)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0           # 0 disables clipping


@dataclass
class PrecisionConfig:
    dtype: DType = DType.fp32
    tf32: bool = True                # CUDA: fp32 matmuls on TF32 tensor cores (10-bit mantissa inputs)
    peak_tflops: float = 0.0         # the MFU denominator per GPU; 0: from hardware.py's table
    # fp16 dynamic loss scaling: Megatron-LM's defaults, but for the start: Megatron starts at 2^32 and skips
    # ~17 steps to come down to a usable scale; 2^16 (apex's and DeepSpeed's start) skips only the first few
    initial_loss_scale: float = 2.0 ** 16
    loss_scale_growth_factor: float = 2.0
    loss_scale_growth_interval: int = 1000
    loss_scale_backoff_factor: float = 0.5
    loss_scale_hysteresis: int = 2
    min_loss_scale: float = 1.0
    max_skips_at_min_scale: int = 10  # fp16: stop after this many overflows in a row at min_loss_scale


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.auto  # auto: online with an API key, else offline
    project: str = "megatron_mini"
    group: Optional[str] = None
    name: Optional[str] = None


@dataclass
class ProfileConfig:
    """torch.profiler over chosen steps (megatron_mini.profiling.StepProfiler): each chosen rank writes a Chrome
    trace and its top kernels to run_dir/profile/step_<first>-<last>/."""
    start: int = 0                        # the first step traced (0: none); the step before it warms up
    steps: int = 2                        # how many steps from start
    ranks: Optional[List[int]] = None     # the global ranks that trace (null: every rank)


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    # layout (dp is derived from the world size)
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    sp: bool = False
    zero: int = 0                    # 0 or 1
    ddp_bucket_numel: int = 1_000_000  # fp32 main-grad elements per DP bucket (Megatron's --ddp-bucket-size): a
                                     # bucket closes at the parameter that takes it to this many or more
    schedule: Schedule = Schedule["1f1b"]   # interleaved when vpp > 1
    embedding_stage: EmbeddingStage = EmbeddingStage.none
    pipeline_first_blocks: int = 0   # explicit block count of the first block stage (0: balanced)
    pipeline_last_blocks: int = 0    # explicit block count of the last block stage (0: balanced)
    recompute: Recompute = Recompute.none
    kernels: Kernels = Kernels.auto  # auto: torch, or triton where measured faster on this GPU; layer_norm /
                                     # attention / cross_entropy: Triton for that op, torch for the others
    compile: Optional[bool] = None   # torch.compile: a chunk's blocks as one graph at tp=1 without full recompute
                                     # or dropout (ParallelContext.compile_chunks), else each block; unset
                                     # (null): on CUDA where a chunk is one graph, else eager (model.compiles)
    # batch and schedule
    mbs: int = 4
    gbs: int = 32
    rampup_batch_size: Optional[List[int]] = None   # [start, increment, samples]: the global batch grows from
                                     # start by increment, each size for an equal share of the first `samples`
                                     # samples, up to gbs (Megatron's --rampup-batch-size; null: gbs throughout)
    steps: int = 300
    seed: int = 1234
    # bookkeeping
    run_dir: str = "runs/${run_name}"
    run_name: str = "tiny-dp"
    log_interval: int = 10
    eval_interval: int = 100
    eval_iters: int = 8
    memory_plan: bool = True         # rank 0 prints the layout planner's memory per rank next to the run's
    save_interval: int = 0           # 0: only at the end
    keep_checkpoints: int = 2        # the newest N complete checkpoints are kept
    keep_checkpoint_interval: int = 0  # and those of every Nth step (milestones, a multiple of save_interval),
                                     # never pruned (0: none)
    replica_check_interval: int = 0  # also compare the weights ranks hold in common every N steps (replicas.py;
                                     # 0: only before each save, which always does)
    async_save: bool = False         # interval saves write their files in a thread while training goes on
    exit_after_minutes: float = 0    # save and stop at the end of the first step (or evaluation batch) past
                                     # this many minutes since the start (a job's time limit less a step, a
                                     # save and the start-up; 0: none)
    resume: str = "auto"             # auto | never | PATH: a checkpoint directory, or a run directory (its newest)
    init_from: Optional[str] = None  # a checkpoint whose weights start a new run (any layout; the optimizer, step
                                     # and data start anew: fine-tuning, another corpus); a run that resumes its
                                     # own checkpoints ignores it
    device: Device = Device.auto     # auto: a GPU per rank when there are enough, else the CPU
    dist_backend: Backend = Backend.auto  # auto: nccl on CUDA unless ranks share a GPU, else gloo
    timeout_s: int = 300             # how long any collective may wait (a stalled peer ends the job)

    def logs(self, step: int) -> bool:
        """Whether the step line and metrics.jsonl record `step` (a step a stop comes in is recorded too)."""
        return step % self.log_interval == 0 or step == self.steps

    def num_microbatches(self, dp: int) -> int:
        """Microbatches per DP rank of a full global batch (gbs: after any rampup_batch_size)."""
        return self.gbs // (self.mbs * dp)

    def global_batch_size(self, consumed_samples: int) -> int:
        """The global batch of the step that starts at sample `consumed_samples`. With rampup_batch_size =
        [start, increment, samples] and n = (gbs - start) / increment increments, size start + k increment
        holds for the samples [k samples / n, (k + 1) samples / n), k < n (Megatron's ramp, in exact integers):

            start + increment * floor(consumed_samples * n / samples), and gbs from `samples` on.

        A function of the samples consumed alone: a resume, in any layout, takes up the ramp where it was."""
        if not self.rampup_batch_size:
            return self.gbs
        start, increment, samples = self.rampup_batch_size
        if consumed_samples >= samples:
            return self.gbs
        return start + increment * (consumed_samples * ((self.gbs - start) // increment) // samples)

    def ramp(self, consumed_samples: int) -> list[tuple[int, int]]:
        """(global batch, steps of it) of the steps from `consumed_samples` on whose batch is smaller than gbs, in
        order (empty past the ramp, and without one): one pair per size, so as many pairs as the ramp has sizes,
        whatever its length in steps. Size start + k increment holds for the steps that start below sample
        ceil((k + 1) samples / n) (global_batch_size)."""
        if not self.rampup_batch_size:
            return []
        start, increment, samples = self.rampup_batch_size
        n, out = (self.gbs - start) // increment, []
        while (size := self.global_batch_size(consumed_samples)) < self.gbs:
            k = (size - start) // increment
            bound = -(-(k + 1) * samples // n)                        # ceil: the first sample of the next size
            steps = -(-(bound - consumed_samples) // size)            # the steps that start below it
            out.append((size, steps))
            consumed_samples += size * steps
        return out

    def consumed_after(self, consumed_samples: int, steps: int) -> int:
        """The samples consumed after `steps` more steps from `consumed_samples`."""
        for size, count in self.ramp(consumed_samples):
            take = min(count, steps)
            consumed_samples, steps = consumed_samples + size * take, steps - take
        return consumed_samples + steps * self.gbs


MAX_LOSS_SCALE = 2.0 ** 64    # fp16's dynamic loss scale never grows past it (a larger one only overflows)
LEAST_LOSS_SCALE = 2.0 ** -24  # fp16's least number: a smaller scale is 0 in fp16 (every gradient 0, every step)
_LEAST = "2**-24: fp16's least number; a smaller scale is 0 in fp16"
FP32_TINY = 2.0 ** -126       # fp32's least normal number (a smaller eps may be 0 to the fp32 optimizer: 0 / 0)
# (key, test, requirement) for every numeric key; 0 means "off" where a key says so
_GE0, _GE1, _GT0 = (lambda v: v >= 0, ">= 0"), (lambda v: v >= 1, ">= 1"), (lambda v: v > 0, "> 0")
_UNIT = (lambda v: 0 <= v < 1, "in [0, 1)")
RANGES = {    # (data first: model.vocab_size is ${data.vocab_size} in the presets, so a bad one is the data's)
    "data.vocab_size": _GE1, "data.val_fraction": (lambda v: 0 < v < 1, "in (0, 1)"),
    "data.tokenizer_sample_chars": _GE1, "data.num_workers": _GE1,
    "model.num_layers": _GE1, "model.hidden_size": _GE1, "model.num_heads": _GE1, "model.seq_len": _GE1,
    "model.vocab_size": _GE1, "model.vocab_pad_multiple": _GE1, "model.ffn_mult": _GE1,
    "model.label_smoothing": _UNIT, "model.dropout": _UNIT, "model.ln_eps": _GT0, "model.init_std": _GT0,
    "optimizer.lr": _GE0, "optimizer.min_lr": _GE0, "optimizer.warmup_steps": _GE0,
    "optimizer.decay_steps": (_GE0[0], ">= 0 (0: decay until the last step)"),
    "optimizer.cooldown_steps": (_GE0[0], ">= 0 (0: decay from the warmup's end)"),
    "optimizer.weight_decay": _GE0, "optimizer.beta1": _UNIT, "optimizer.beta2": _UNIT,
    "optimizer.eps": (lambda v: v >= FP32_TINY, ">= 2**-126 (fp32's least normal number: a smaller one may be 0 to the "
                      "fp32 optimizer, and 0 / 0 a NaN)"),
    "optimizer.grad_clip": (_GE0[0], ">= 0 (0: no clipping)"),
    "precision.peak_tflops": (_GE0[0], ">= 0 (0: from the table of known GPUs)"),
    "precision.initial_loss_scale": (lambda v: LEAST_LOSS_SCALE <= v <= MAX_LOSS_SCALE,
                                     f"in [2**-24, 2**64] ({_LEAST})"),
    "precision.loss_scale_growth_factor": (lambda v: v >= 1, ">= 1"),
    "precision.loss_scale_growth_interval": _GE1,
    "precision.loss_scale_backoff_factor": (lambda v: 0 < v < 1, "in (0, 1)"),
    "precision.loss_scale_hysteresis": _GE1, "precision.max_skips_at_min_scale": _GE1,
    "precision.min_loss_scale": (lambda v: v >= LEAST_LOSS_SCALE, f">= 2**-24 ({_LEAST})"),
    "tp": _GE1, "pp": _GE1, "vpp": _GE1, "zero": (lambda v: v in (0, 1), "0 (off) or 1 (ZeRO-1)"),
    "ddp_bucket_numel": (_GE1[0], ">= 1 (fp32 main-grad elements per DP bucket)"),
    "pipeline_first_blocks": (_GE0[0], ">= 0 (0: balanced)"), "pipeline_last_blocks": (_GE0[0], ">= 0 (0: balanced)"),
    "mbs": _GE1, "gbs": _GE1, "steps": _GE1, "log_interval": _GE1,
    "eval_interval": (_GE0[0], ">= 0 (0: no evaluation)"), "eval_iters": _GE1,
    "save_interval": (_GE0[0], ">= 0 (0: save at the end only)"), "keep_checkpoints": _GE1,
    "keep_checkpoint_interval": (_GE0[0], ">= 0 (0: only the newest keep_checkpoints are kept)"),
    "replica_check_interval": (_GE0[0], ">= 0 (0: before each save only)"),
    "exit_after_minutes": (_GE0[0], ">= 0 (0: no time limit)"),
    "timeout_s": (lambda v: 1 <= v <= 10**8, "in [1, 10**8] seconds"),
    "profile.start": (_GE0[0], ">= 0 (0: no profile)"), "profile.steps": _GE1,
    "seed": (lambda v: 0 <= v < 2**32, "in [0, 2**32)"),
}


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


@functools.lru_cache(maxsize=None)
def _choice_fields(cls) -> tuple:
    """(name, the Choice enum of its values or None for a nested dataclass) of cls's fields that need it."""
    return tuple((f.name, type(f.default) if isinstance(f.default, Choice) else None) for f in dataclasses.fields(cls)
                 if isinstance(f.default, Choice) or f.default_factory is not dataclasses.MISSING)


def _choices(obj) -> None:
    """Turn the plain strings of Choice fields into their members (tests build configs with strings)."""
    for name, kind in _choice_fields(type(obj)):
        value = getattr(obj, name)
        if kind is None:
            if dataclasses.is_dataclass(value):
                _choices(value)
        elif not isinstance(value, Choice):
            try:
                setattr(obj, name, kind(value))
            except ValueError:
                raise ConfigError(f"{name}={value!r}: choose one of {', '.join(kind.__members__)}.") from None


def config_keys(schema=None, prefix: str = "") -> list:
    """Every key of TrainConfig, dotted (`optimizer.lr`), sections included."""
    keys = []
    for f in dataclasses.fields(schema or TrainConfig):
        keys.append(prefix + f.name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            keys += config_keys(type(default), f"{prefix}{f.name}.")
    return keys


def typed_keys(types: tuple, schema=None, prefix: str = "") -> set:
    """The dotted keys of `schema` (TrainConfig by default) whose field's type is one of `types` (as annotated)."""
    keys = set()
    for f in dataclasses.fields(schema or TrainConfig):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default):
            keys |= typed_keys(types, type(default), f"{prefix}{f.name}.")
        elif f.type in types:
            keys.add(prefix + f.name)
    return keys


def boolean_keys(schema=None) -> set:
    """The dotted keys of `schema` (TrainConfig by default) that hold a bool."""
    return typed_keys((bool, "bool", "Optional[bool]"), schema)


def split_override(arg: str) -> tuple[str, str, str]:
    """(key, "=", value) of a command-line override, its key without Hydra's prefixes (+key, ++key, ~key)."""
    key, equals, value = arg.partition("=")
    return key.lstrip("+~"), equals, value


def check_given(composed, argv: list, schema=None) -> None:
    """check_keys and check_booleans of a composed config (an OmegaConf DictConfig, unresolved) and the command line
    `argv` that made it (train.py, prepare_data.py, plan.py)."""
    from omegaconf import OmegaConf
    given = OmegaConf.to_container(composed, resolve=False)
    check_keys(given, schema)
    check_booleans(argv, schema, given)


def check_booleans(argv: list, schema=None, composed: dict | None = None) -> None:
    """Refuse a command line's bool key given anything but true or false: OmegaConf takes any integer as a bool
    (sp=2, an sp degree meant, is sp=true; async_save=0 is false), which Hydra's typed config does not refuse; in a
    group's dict too (precision={tf32:0}). `composed`: the composed config, unresolved (nested dicts): a bool key
    there (from a YAML of the user's own, untyped) or the value its interpolation leads to (sp=${vpp}) must be true
    or false too."""
    keys = boolean_keys(schema)
    for arg in argv:
        key, equals, value = split_override(arg)
        if not equals:
            continue
        if value.lstrip().startswith("{"):        # (a dict for a group: Hydra's parser reads it, as composing does)
            from hydra.core.override_parser.overrides_parser import OverridesParser
            try:
                given = OverridesParser.create().parse_override(arg).value()
            except Exception:                      # noqa: BLE001 - not Hydra's syntax: Hydra refuses it, with its words
                continue
            bad = next((k for k, v in _flat(given, key) if k in keys and not _boolean(v)), None)
        else:
            bad = key if key in keys and not _boolean(value.strip().strip("'\"")) else None
        if bad is not None:
            raise ConfigError(f"{arg}: {bad} is true or false")
    for key, value in _flat(composed or {}, ""):
        if key not in keys:
            continue
        target = value
        if isinstance(value, str) and value.startswith("${"):
            from omegaconf import OmegaConf
            try:
                target = OmegaConf.select(OmegaConf.create(composed), key, throw_on_resolution_failure=True)
            except Exception:                      # noqa: BLE001 - refused when it is resolved, with OmegaConf's words
                continue
        if not _boolean(target):                   # (a YAML of the user's own composes untyped: sp: 2 stays 2)
            said = f"{value} is {target!r}" if target is not value else f"{value!r}"
            raise ConfigError(f"{key}={said}: {key} is true or false")


def _boolean(value) -> bool:
    """What a bool key may be given: true, false or null (a bool, None, or such text in any case; ${...}: an
    interpolation, checked where it is composed)."""
    if isinstance(value, str):
        return value.lower() in ("true", "false", "null") or value.startswith("${")
    return value is None or isinstance(value, bool)


def _flat(given, prefix: str):
    """(dotted key, value) of every leaf of the nested dicts `given`, under `prefix`."""
    if not isinstance(given, dict):
        yield prefix, given
        return
    for k, v in given.items():
        yield from _flat(v, f"{prefix}.{k}" if prefix else str(k))


def unknown_key(key: str, schema=None) -> ConfigError:
    """The refusal of dotted `key`, naming the key meant where one is close: `lr` -> optimizer.lr,
    `optimizer.lrr` -> optimizer.lr, `tpp` -> tp (keys of `schema`, TrainConfig by default)."""
    keys = config_keys(schema)
    section, _, leaf = key.rpartition(".")
    close = [k for k in keys if k.rpartition(".")[2] == leaf] or difflib.get_close_matches(key, keys, n=1)
    hint = f" (did you mean {' or '.join(close[:2])}?)" if close else ""
    section = section if section in keys else ""
    siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == section]
    return ConfigError(f"Unknown config key {key}{hint}; the keys{' of ' + section if section else ''} are: "
                       f"{', '.join(siblings)}.")


def check_keys(given: dict, schema=None) -> None:
    """Refuse every key of the composed config `given` (nested dicts) that is no field of `schema`
    (TrainConfig by default): Hydra's `+key=value` adds keys that the dataclass would otherwise silently drop."""
    known = set(config_keys(schema))

    def check(given: dict, prefix: str) -> None:
        for key, value in given.items():
            if prefix + key not in known:
                raise unknown_key(prefix + key, schema)
            if isinstance(value, dict):             # a section (no field of ours holds a dict)
                check(value, f"{prefix}{key}.")
    check(given, "")


def structured(given, schema=None):
    """The composed config `given` (an OmegaConf DictConfig) as a `schema` object (TrainConfig by default), typed by
    the schema even where the primary config does not start from it (--config-path to a run's .hydra/, a config of the
    user's own: it composed into a plain dict, whose first use was an AttributeError). A value the schema cannot take,
    or an interpolation that does not resolve (${nope}, ${oc.env:X}), is a ConfigError."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema or TrainConfig), given))
    except OmegaConfBaseException as e:
        text, key = str(e).strip().splitlines()[0], getattr(e, "full_key", None)
        raise ConfigError(f"{key}: {text}" if key and key not in text else text) from None


@functools.lru_cache(maxsize=None)
def integer_keys() -> frozenset:
    """The dotted keys of TrainConfig that hold an int (model.num_layers, ...)."""
    return frozenset(typed_keys((int, "int")))


def check_ranges(cfg: TrainConfig, section: str = "") -> None:
    """The RANGES rules of the keys under `section` ("" = all); every value must be a finite number, an integer
    where its field is an int, never a bool, as Hydra holds train.py's (inf passed the ranges: an fp16 loss scale
    of inf skipped every step and never reached its minimum; a checkpoint's meta.json may hold a string, a 2.0 or a
    true); no data path is empty."""
    for key, (ok, requirement) in RANGES.items():
        if key.startswith(section):
            value = _get(cfg, key)
            integer = key in integer_keys()
            if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
                raise ConfigError(f"{key}={value!r} must be {'an integer' if integer else 'a number'} {requirement}.")
            if isinstance(value, float) and not math.isfinite(value):   # (an int of any size is finite)
                raise ConfigError(f"{key}={value} must be a finite number {requirement}.")
            if not ok(value):
                raise ConfigError(f"{key}={value} must be {requirement}.")
    for key, what in (("data.source", "stdlib, a .jsonl file or a directory of .jsonl and .txt files"),
                      ("data.text_key", "the field of a .jsonl line that holds its document"),
                      ("data.dir", "the directory of the prepared data"),
                      ("data.tokenizer", "a tokenizer.model to encode the corpus with (null: train one)")):
        value = _get(cfg, key)       # (data.tokenizer may be null)
        if key.startswith(section) and value is not None and not str(value).strip():   # ('' wrote into the cwd)
            raise ConfigError(f"{key} is empty: give {what}.")
    if "data.blend".startswith(section):
        cfg.data.parts()
        cfg.data.check_blend_alone()
    if "data.eval".startswith(section):
        cfg.data.eval_dirs()


def check_layout_free(cfg: TrainConfig) -> None:
    """What validate() checks that no layout changes: the choices, every value's range, run_name and resume,
    the lr and loss-scale bounds, the model's shape."""
    _choices(cfg)
    check_ranges(cfg)
    cfg.data.check_dirs_on_disk()
    if not cfg.run_name.strip() or set(cfg.run_name.replace("\\", "/").split("/")) & {"", ".", ".."}:
        raise ConfigError(f"run_name={cfg.run_name!r} must name a directory below runs/ (no empty, '.' or '..' "
                          f"part); to put a run elsewhere, set run_dir=PATH.")
    if not str(cfg.resume).strip():
        raise ConfigError("resume is empty: use resume=auto (continue this run directory's run, if any), "
                          "resume=never or resume=PATH (a checkpoint directory, or a run directory: its newest intact "
                          "checkpoint).")
    if cfg.init_from is not None and not str(cfg.init_from).strip():
        raise ConfigError("init_from is empty: give the checkpoint directory whose weights start this run "
                          "(null: the seed's initial weights).")
    if cfg.init_from and resume_path(cfg.resume):
        raise ConfigError(f"init_from={cfg.init_from} starts a new run from a checkpoint's weights, and "
                          f"resume={cfg.resume} continues the run of another: give one of them.")
    keep, save = cfg.keep_checkpoint_interval, cfg.save_interval
    if keep and (not save or keep % save):
        saved = f"the multiples of save_interval={save}" if save else "the last only (save_interval=0)"
        raise ConfigError(f"keep_checkpoint_interval={keep} keeps the checkpoints of its multiples, but the steps "
                          f"saved are {saved}: make it a multiple of save_interval (> 0).")
    _check_schedule(cfg)
    p = cfg.precision
    if p.min_loss_scale > p.initial_loss_scale:
        raise ConfigError(f"precision.min_loss_scale={p.min_loss_scale:g} is above precision.initial_loss_scale="
                          f"{p.initial_loss_scale:g}: the loss scale only falls from its initial value to the "
                          f"minimum; set precision.min_loss_scale <= {p.initial_loss_scale:g}.")
    if cfg.profile.start > cfg.steps:
        raise ConfigError(f"profile.start={cfg.profile.start} is past steps={cfg.steps}: no step would be traced; "
                          f"choose a step from 1 to {cfg.steps} (0: no profile).")
    if cfg.profile.ranks is not None and not cfg.profile.ranks:
        raise ConfigError("profile.ranks=[] names no rank: name the ranks that trace (null: every rank; "
                          "profile.start=0: no profile).")
    check_heads(cfg.model)
    _check_rampup(cfg)


def check_heads(m: ModelConfig) -> None:
    """The heads split the hidden size evenly (head dim = hidden_size / num_heads)."""
    if m.hidden_size % m.num_heads:
        raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}.")


def _check_schedule(cfg: TrainConfig) -> None:
    """The lr schedule's keys (learning_rate) make one: a decay from lr down to min_lr that ends after the peak, with
    room for its cooldown; under decay_style=constant (lr throughout) none of them applies but cooldown_steps, which
    would decay nothing there."""
    o = cfg.optimizer
    if o.decay_style == "constant":
        if o.cooldown_steps:
            raise ConfigError(f"optimizer.cooldown_steps={o.cooldown_steps} decays nothing under optimizer.decay_style="
                              f"constant (lr throughout): for warmup-stable-decay, give it with the decay's shape "
                              f"(optimizer.decay_style=sqrt, WSD's 1 - sqrt, or linear), which holds lr until then; "
                              f"else set it to 0.")
        return
    if o.min_lr > o.lr:
        raise ConfigError(f"optimizer.min_lr={o.min_lr} is above optimizer.lr={o.lr}: the schedule decays "
                          f"from lr to min_lr; set optimizer.min_lr <= {o.lr} (e.g. optimizer.min_lr={o.lr / 10:g}).")
    peak = max(o.warmup_steps, 1)        # (the step at which the lr peaks: the warmup's last, or the first)
    if 0 < o.decay_steps <= peak:
        raise ConfigError(f"optimizer.decay_steps={o.decay_steps} ends the decay no later than the lr peaks (step "
                          f"{peak}, optimizer.warmup_steps={o.warmup_steps}): set it above {peak}, or to 0 (the "
                          f"decay ends at the last step).")
    end = o.decay_steps or cfg.steps
    if o.cooldown_steps > max(end - peak, 0):
        where = f"optimizer.decay_steps={end}" if o.decay_steps else f"the last, steps={end}"
        raise ConfigError(f"optimizer.cooldown_steps={o.cooldown_steps} is longer than the decay can be: from the "
                          f"lr's peak (step {peak}) to the decay's end (step {end}, {where}) is {max(end - peak, 0)} "
                          f"steps; lower it, or raise {'optimizer.decay_steps' if o.decay_steps else 'steps'}.")


def _check_rampup(cfg: TrainConfig) -> None:
    """rampup_batch_size is [start, increment, samples] with a ramp that lands on gbs (any layout)."""
    ramp = cfg.rampup_batch_size
    if ramp is None:
        return
    ramp = list(ramp)
    if len(ramp) != 3:
        raise ConfigError(f"rampup_batch_size={ramp} must be [start, increment, samples]: the first global batch, "
                          f"how much it grows at a time, and over how many samples it reaches gbs (e.g. "
                          f"rampup_batch_size=[{max(cfg.gbs // 4, 1)},{max(cfg.gbs // 4, 1)},{100 * cfg.gbs}]; "
                          f"null: gbs throughout).")
    start, increment, samples = ramp
    if start < 1 or increment < 1 or samples < 0:
        raise ConfigError(f"rampup_batch_size={ramp}: start and increment must be >= 1, samples >= 0.")
    if start > cfg.gbs:
        raise ConfigError(f"rampup_batch_size={ramp} starts at {start} samples, above gbs={cfg.gbs}: the ramp grows "
                          f"the global batch up to gbs; start it at {cfg.gbs} or less.")
    if (cfg.gbs - start) % increment:
        # (the example: the largest one up to `increment` (or mbs) that is whole microbatches too, where the start
        # is and there is one: at dp = 1 the ramp's global batches then split into microbatches, _check_batches)
        gap = cfg.gbs - start
        top = max(min(increment, gap), cfg.mbs) // cfg.mbs * cfg.mbs
        whole = [d for d in range(top, 0, -cfg.mbs) if gap % d == 0] if start % cfg.mbs == 0 else []
        raise ConfigError(f"rampup_batch_size={ramp}: from start={start} the increments of {increment} miss "
                          f"gbs={cfg.gbs} (gbs - start = {gap} is no multiple of {increment}); "
                          f"use an increment that divides it, e.g. {(whole or [math.gcd(increment, gap)])[0]}.")


def check_rampup_layout(cfg: TrainConfig, dp: int, consumed_samples: int, steps: int) -> None:
    """The global batches of the ramp that the next `steps` steps from `consumed_samples` on take (TrainConfig.ramp)
    split into microbatches of mbs on each of the dp ranks, and the first has as many as the schedule needs (they
    only grow). A resume past the ramp, or with no step to train, checks nothing of it: its dp may be any that
    divides gbs (an evaluation reads batches of gbs)."""
    ramp, left = [], steps
    for size, count in cfg.ramp(consumed_samples):
        if left <= 0:
            break
        ramp.append(size)
        left -= count
    if not ramp:
        return
    unit, name = cfg.mbs * dp, f"rampup_batch_size={list(cfg.rampup_batch_size)}"
    at, other = (f" (from sample {consumed_samples:,}, where the run resumes)", ", or resume at another dp") \
        if consumed_samples else ("", "")
    bad = next((size for size in ramp if size % unit), None)
    if bad is not None:
        raise ConfigError(f"{name}: its global batch of {bad}{at} is not divisible by mbs x dp = {cfg.mbs} x {dp} = "
                          f"{unit}, so it would not split into microbatches of mbs on each DP rank; use a start and "
                          f"an increment that are multiples of {unit}{other}.")
    first = ramp[0] // unit
    try:
        check_schedule(cfg.schedule, cfg.pp, cfg.vpp, first)
    except ConfigError as e:
        raise ConfigError(f"{name}: its first step{at} has {first} microbatch{'es' * (first > 1)}: {e} For the ramp, "
                          f"start it at {cfg.pp * unit} or more{other}.") from None


def validate(cfg: TrainConfig, world_size: int, consumed_samples: int | None = 0) -> int:
    """Check every value, the layout, the pipeline split and the schedule; return dp. Raises
    ConfigError with one paragraph. Run by every rank before any process group exists. `consumed_samples`:
    where the run starts, for the global batches of a rampup_batch_size still to come (check_rampup_layout);
    None where a resume may set it: training.check_resume checks them once its checkpoint is found.
    Too few processes is said once the launch it advises (dp = 1) would pass the model's and the batch's checks."""
    check_layout_free(cfg)
    m = cfg.model
    # (hidden_size is a multiple of num_heads, check_heads: heads that divide by tp make it and the MLP width,
    # ffn_mult x hidden_size, divide by tp too)
    if m.num_heads % cfg.tp:
        raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by tp={cfg.tp}.")
    if m.padded_vocab_size % cfg.tp:
        raise ConfigError(
            f"The padded vocabulary {m.padded_vocab_size} (vocab_size={m.vocab_size} padded to a multiple of "
            f"{m.vocab_pad_multiple}) is not divisible by tp={cfg.tp}; "
            f"set model.vocab_pad_multiple to a multiple of {cfg.tp}."
        )
    if cfg.sp and m.seq_len % cfg.tp:
        raise ConfigError(f"Sequence parallelism needs model.seq_len={m.seq_len} divisible by tp={cfg.tp}.")
    partition(m.num_layers, cfg.pp * cfg.vpp, cfg.embedding_stage, cfg.pipeline_first_blocks, cfg.pipeline_last_blocks)
    model_parallel = cfg.tp * cfg.pp
    if world_size < model_parallel:
        _check_batches(cfg, 1, consumed_samples)
        raise ConfigError(
            f"The layout tp={cfg.tp} x pp={cfg.pp} needs at least {model_parallel} processes "
            f"(tp={cfg.tp} x pp={cfg.pp} x dp=1), but this run has {world_size}. "
            f"Launch it with the same arguments: torchrun --nproc_per_node={model_parallel} train.py <the same "
            f"arguments> (on several nodes, --nnodes times --nproc_per_node = {model_parallel})."
        )
    if world_size % model_parallel:
        raise ConfigError(
            f"World size {world_size} is not divisible by tp x pp = {cfg.tp} x {cfg.pp} = {model_parallel}; "
            f"use a multiple of {model_parallel} processes (dp = world_size / (tp x pp))."
        )
    dp = world_size // model_parallel
    outside = [r for r in cfg.profile.ranks or () if not 0 <= r < world_size]
    if outside:
        raise ConfigError(f"profile.ranks names rank{'s' if len(outside) > 1 else ''} "
                          f"{', '.join(map(str, outside[:8]))}, but this run's ranks are 0 to {world_size - 1}.")
    _check_batches(cfg, dp, consumed_samples)
    return dp


def _check_batches(cfg: TrainConfig, dp: int, consumed_samples: int | None) -> None:
    """The global batch over dp ranks: whole microbatches, as many as the schedule needs (validate)."""
    if cfg.gbs % (cfg.mbs * dp):
        raise ConfigError(
            f"gbs={cfg.gbs} is not divisible by mbs x dp = {cfg.mbs} x {dp} = {cfg.mbs * dp}; "
            f"choose gbs as a multiple of {cfg.mbs * dp}."
        )
    check_schedule(cfg.schedule, cfg.pp, cfg.vpp, cfg.num_microbatches(dp))
    if consumed_samples is not None:
        check_rampup_layout(cfg, dp, consumed_samples, cfg.steps)


def register_configs() -> None:
    """Store TrainConfig in Hydra's ConfigStore as "base_config" (the schema conf/config.yaml starts from)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="base_config", node=TrainConfig)
