"""The training loop: one function, `train(cfg)`, run by every rank.

Order matters: the config, the pipeline split, the schedule, the device, the run directory, the
data files and the checkpoint to resume from are checked identically on every rank *before* any
process group exists (`prepare_run`), so a bad run ends everywhere with one message instead of
hanging in a collective. Rank 0 holds the run directory's lock for the whole run. A SIGTERM is
shared with every rank at the end of a step or evaluation batch (in the loss all-reduce); then all save and
stop, the step's evaluation owed to the resumed run if it was due (or cut short). What rank 0 writes
alone (metrics.jsonl, summary.json, history.json) and fails to write stops every rank too (Trainer.write_alone).
"""
from __future__ import annotations

import atexit
import dataclasses
import gc
import hashlib
import json
import logging
import math
import os
import shlex
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist

from . import checkpoint, replicas
from .comm import Group, Ledger
from .errors import CommError
from .files import DirectoryLock, atomic_write
from .hardware import configure_device, device_memory_bytes
from .kernels import attention_unsupported, interpreter_unsupported, interpreting, triton_installed
from .config import ConfigError, RunError, TrainConfig, check_rampup_layout, validate
from .data import DataError
from .dataset import (BlendedDataset, blend_note, check_token_ids, data_identity, first_sample, get_batch,
                      load_run_data, split_notes, trained_eval_notes)
from .launch import STOPPING, EarlyInterrupt, RunLock, StopRequest, Terminated, follow_parent, gpu_slot, launch_env
from .logger import RunLogger, Throughput, cut_metrics, format_duration, record_branch, step_line, strict_json
from .profiling import StepProfiler
from .memory_report import MemoryReport
from .mesh import ParallelMesh, choose_device, init_process_group, ranks_per_gpu
from .model import compiles, cpu_compile_missing, select_triton_ops, triton_build_missing
from .pipeline import PipelineEngine
from .rank import DTYPES, build_rank, reduce_loss, state_bytes_at_least
from .optimizer import learning_rate, schedule_note, warmup_note
from .rng import RNGTracker


def setup_device(cfg: TrainConfig) -> tuple[torch.device, str]:
    """This rank's device and the process-group backend (mesh.choose_device), set up as hardware.configure_device
    says: on CUDA, fp32 matmuls on TF32 tensor cores unless precision.tf32=false; on the CPU, freed tensors' memory
    reused. Kernels the device cannot run, compile=true on a CPU without the C++ compiler or the Python headers
    that inductor builds with (model.cpu_compile_missing), and torch.compile or Triton kernels on CUDA without the C
    compiler or the headers that Triton builds with (model.triton_build_missing) are refused here, before any
    collective."""
    gpus = torch.cuda.device_count() if cfg.device != "cpu" else 0
    device, backend = choose_device(cfg.device, cfg.dist_backend, *gpu_slot(), gpus)
    if cfg.kernels not in ("auto", "torch"):
        if not triton_installed():
            raise ConfigError(f"kernels={cfg.kernels} needs the triton package (Linux with a GPU); use kernels=torch "
                              "or auto.")
        if device.type == "cpu" and not interpreting():
            raise ConfigError(f"kernels={cfg.kernels} on the CPU runs Triton kernels in Triton's interpreter "
                              "(slow; for tests): set TRITON_INTERPRET=1 in the environment to do that, "
                              "or use kernels=torch.")
        if device.type == "cpu" and (why := interpreter_unsupported()):
            raise ConfigError(f"kernels={cfg.kernels}: {why}; or use kernels=torch.")
    m = cfg.model
    triton = select_triton_ops(cfg.kernels, m, device, cfg.tp, cfg.precision.dtype, cfg.mbs)
    if triton.attention:
        why = attention_unsupported(m.hidden_size // m.num_heads, m.seq_len, m.dropout, cfg.mbs * m.num_heads // cfg.tp)
        if why:
            raise ConfigError(f"kernels={cfg.kernels}: the Triton attention {why}; use kernels=torch (or "
                              f"kernels=layer_norm or cross_entropy for the other Triton kernels).")
    compiled = compiles(cfg, device)
    if device.type == "cpu" and compiled and (why := cpu_compile_missing()):
        raise ConfigError(f"compile=true on the CPU: {why}; or set compile=false.")
    if device.type == "cuda":
        needs = {}          # what needs Triton's C build: the setting that does without it
        if compiled:
            needs["compile=true" if cfg.compile else "compile (unset: true on CUDA)"] = "compile=false"
        if ops := [op for op, on in dataclasses.asdict(triton).items() if on]:
            needs[f"kernels={cfg.kernels} (the Triton {', '.join(ops)})"] = "kernels=torch"
        if needs and (why := triton_build_missing()):
            raise ConfigError(f"{' and '.join(needs)} on CUDA: {why}; or set {' and '.join(needs.values())}.")
    configure_device(device, cfg.precision.tf32)
    return device, backend


@dataclasses.dataclass
class Run:
    """What prepare_run found: the layout's dp, device, backend, data and what to resume from."""
    dp: int
    device: torch.device
    backend: str
    datasets: tuple
    data: dict                      # the data's identity, recorded in checkpoints
    resume: checkpoint.Resume | None
    init: checkpoint.Resume | None  # init_from's checkpoint, when the run starts anew (it resumes nothing)
    lock: RunLock | None            # rank 0's lock on the run directory
    refused: str | None = None      # rank 0: why it could not take the lock (another run holds it) or start from
                                    # what the run names (resume, init_from), told to all


def check_run_dir(run_dir: str) -> None:
    """The run directory exists (created) and this rank can write into it."""
    try:
        os.makedirs(run_dir, exist_ok=True)
        probe = os.path.join(run_dir, f".probe-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"run_dir={run_dir} cannot be written ({e.strerror or e}); choose another one with "
                          f"run_name=NAME or run_dir=PATH.") from None


def prepare_run(cfg: TrainConfig, rank: int, world_size: int, datasets: tuple | None = None) -> Run:
    """Everything that can be wrong before the first collective, the same on every rank (`datasets`: load_run_data's,
    where the caller has loaded them); rank 0 also
    takes the run directory's lock (before anything reads the run's checkpoints) and finds what the run starts
    from (resume, init_from: every rank's, agree_on_run_dir). A lock another run holds, or a start refused, is
    rank 0's alone to find: kept in Run.refused, it stops every rank together once they have met (_train), not
    rank 0 alone while the others wait for it in the rendezvous (srun without --kill-on-bad-exit stops nobody)
    until timeout_s."""
    dp = validate(cfg, world_size, consumed_samples=None)    # (the ramp's batches once the resume is known)
    device, backend = setup_device(cfg)
    check_run_dir(cfg.run_dir)
    lock, refused = None, None
    if rank == 0:
        try:
            lock = RunLock(cfg.run_dir)
        except ConfigError as e:
            if world_size == 1:
                raise
            refused = str(e)
    try:
        if datasets is None:
            datasets = load_run_data(cfg)
        data = data_identity(cfg.data, datasets)
        resume = init = None
        # rank 0's start is every rank's (agree_on_run_dir): the others list nothing of their own (a node's stale
        # listing, or its own copy of the data, failed it alone, the others waiting); the files' sha256 are checked
        # once the ranks can share the hashing (_train): here, that they exist
        if rank == 0 and not refused:
            try:
                resume = check_resume(cfg, checkpoint.find_resume(cfg, checkpoint.present), datasets, data, dp)
                init = checkpoint.check_init(cfg, datasets[2].sha256, checkpoint.present) \
                    if cfg.init_from and not resume else None
            except Exception as e:     # noqa: BLE001 - an OSError, a bug: every rank's, as a ConfigError is
                if world_size == 1:
                    raise
                refused = str(e) if isinstance(e, ConfigError) else checkpoint.describe(e)
    except BaseException:
        if lock:
            lock.release()
        raise
    return Run(dp, device, backend, datasets, data, resume, init, lock, refused)


def check_resume(cfg: TrainConfig, resume: checkpoint.Resume | None, datasets: tuple, data: dict, dp: int):
    """`resume`, once it is known to be of this model and data, the global batches of a rampup_batch_size still to
    come from it (config.check_rampup_layout), and the first batches it reads (and the validation set's, and each of
    data.eval's) hold only ids of the vocabulary."""
    if resume:
        checkpoint.check_compatible(resume, cfg, data)
    consumed = resume.meta["consumed_samples"] if resume else 0
    check_rampup_layout(cfg, dp, consumed, cfg.steps - (resume.meta["step"] if resume else 0))
    check_token_ids(datasets[0], consumed, cfg.gbs, cfg.model.vocab_size, cfg.data)   # the first batches
    for evaluated in (datasets[1], *datasets[3].values()):
        check_token_ids(evaluated, 0, cfg.gbs, cfg.model.vocab_size, cfg.data)
    return resume


class Trainer:
    """Holds the model chunks, optimizer and engine of this rank."""

    def __init__(self, cfg: TrainConfig, mesh: ParallelMesh, datasets, device: torch.device):
        self.cfg, self.mesh, self.device = cfg, mesh, device
        self.train_data, self.val_data, self.tokenizer = datasets[:3]
        self.evals = datasets[3] if len(datasets) > 3 else {}     # data.eval's sets, {directory: GPTDataset}
        self.dtype = DTYPES[cfg.precision.dtype]
        self.chunks, self.buffers, self.optimizer = build_rank(cfg, mesh, RNGTracker(cfg.seed, mesh.tp_rank, device),
                                                               device)
        self.engine = PipelineEngine(self.chunks, self.buffers, mesh, cfg, self.dtype, device)
        self.vocab = (cfg.model.vocab_size, cfg.data)      # every batch's ids are checked against it (get_batch)
        self.blend_names = [directory for _, directory in cfg.data.parts()]    # (a blend's losses, per directory)
        self.step, self.consumed_samples = 0, 0
        self.loss = float("nan")           # this step's mean loss (kept in its checkpoint, as the next two)
        self.evaluation_owed = False       # this step's evaluation was due but a stop came first (the resumed
                                           # run evaluates before its first step)
        self.last_checkpoint = None        # the newest complete checkpoint of this run (saved or resumed from)
        self.pending = None                # a checkpoint.Save whose files are being written (async_save)
        self.failure = None                # what must stop every rank (the first): a failed write_alone, replicas
                                           # that differ (check_replicas)
        self.gc_frozen = False

    def _global_loss(self, sample_losses: torch.Tensor, dataset, first: int,
                     stop: StopRequest | None = None) -> tuple[float, dict, dict, int]:
        """(mean loss per token, {directory: (its samples' summed token losses, its samples)} of a data.blend ({}
        without one), {reason: ranks that asked to stop for it} (`stop`: this rank's StopRequest), ranks still
        writing a checkpoint) of this step or evaluation batch: the global batch of `dataset` from sample `first`,
        whose samples' losses (the engine's, `sample_losses` [m, mbs] on this rank) reduce_loss gathers; RunError on
        every rank when a rank's write_alone failed."""
        writing = self.pending is not None and self.pending.writing
        t = reduce_loss(self.mesh, sample_losses, stop and stop.asked(), self.device, writing,
                        self.failure is not None).cpu()                 # (one copy: the step's only wait for it)
        gbs = sample_losses.numel() * self.mesh.dp
        losses, (writers, failed, *counts) = t[:gbs].double(), t[gbs:].tolist()
        if failed:
            self.stop_on_failure()
        stops = {name: int(n) for name, n in zip(StopRequest.REASONS, counts) if n}
        parts = {}
        if isinstance(dataset, BlendedDataset):
            which = torch.from_numpy(dataset.which(first, gbs))
            for d, name in enumerate(self.blend_names):
                mine = which == d
                if mine.any():
                    parts[name] = (losses[mine].sum().item(), int(mine.sum()))
        return losses.sum().item() / (gbs * self.cfg.model.seq_len), parts, stops, int(writers)

    def write_alone(self, path: str, fn, *args) -> None:
        """fn(*args): a write of `path` that this rank does alone (rank 0's metrics.jsonl, summary.json,
        history.json). Its failure (a full disk, a file size limit, a permission) must not end this rank alone
        while the others wait for it in their next collective (until timeout_s): it is kept, later writes are
        skipped, and every rank stops on it together (stop_on_failure) at the end of the next step or
        evaluation batch (a count in their loss all-reduce: a step communicates nothing more), before the next
        save (no checkpoint is newer than a line rank 0 could not write: resume=auto logs it again) or at the
        end of the run."""
        if self.failure is None:
            why = checkpoint.failure_of(fn, *args)
            self.failure = f"could not write {path}: {why}" if why else None

    def stop_on_failure(self) -> None:
        """Every rank (a collective) raises the same RunError when any rank's write_alone failed or found replicas
        that differ, once the save still being written (of an earlier step) is published."""
        found = checkpoint.first_failure(self.failure, self.mesh, self.device)
        if found:
            rank, why = found
            self.finish_save()
            raise RunError(f"rank {rank} {why} (stopped after step {self.step}; the last checkpoint: "
                           f"{self.last_checkpoint or 'none'})", reporter=rank)

    def check_replicas(self) -> None:
        """Stop every rank (stop_on_failure) when weights that ranks hold in common differ (replicas.compare): a
        checkpoint keeps one copy, so such a run could not be resumed as it is."""
        differ = replicas.compare(self.buffers, self.optimizer, self.mesh)      # (every rank: its groups' collectives)
        if differ and self.failure is None:
            self.failure = f"found copies of the weights that differ between ranks: {differ}"
        self.stop_on_failure()

    def train_step(self, stop: StopRequest | None = None) -> dict:
        """One optimizer step. `stop`: this rank's StopRequest, read after the forward and backward (a step is
        long: a signal during it stops the run after it, not after the next); out["stop"]: {reason (a signal,
        the time limit): how many ranks asked to stop for it}, empty when none; out["writing"]: how many ranks
        were still writing the pending checkpoint (async_save); out["gbs"]: the step's global batch
        (TrainConfig.global_batch_size); out["param_norm"]: the weights' norm at a step the log records
        (TrainConfig.logs; Optimizer.step), else None."""
        cfg = self.cfg
        for chunk in self.chunks:
            chunk.train()
        lr = learning_rate(self.optimizer.step_count, cfg.optimizer, cfg.steps)
        gbs = cfg.global_batch_size(self.consumed_samples)
        batch = get_batch(self.train_data, self.consumed_samples, gbs, cfg.mbs, self.mesh.dp_rank, self.mesh.dp,
                          self.vocab)
        scaler = self.optimizer.scaler
        scale = scaler.scale if scaler else None
        first = first_sample(self.consumed_samples, gbs, self.mesh.dp_rank, self.mesh.dp)
        sample_losses = self.engine.train_step(batch, scale or 1.0, gbs * cfg.model.seq_len, first)
        loss, parts, stop, writing = self._global_loss(sample_losses, self.train_data, self.consumed_samples, stop)
        if not math.isfinite(loss) and scaler is None:
            raise FloatingPointError(f"the training loss is {loss} at step {self.step + 1}")
        try:
            grad_norm, skipped, param_norm = self.optimizer.step(lr, weight_norm=cfg.logs(self.step + 1))
        except FloatingPointError as e:          # (no loss scaler: an inf or nan gradient ends the run)
            raise FloatingPointError(f"{e} at step {self.step + 1}") from None
        if scaler and scaler.skips_at_min >= cfg.precision.max_skips_at_min_scale:
            # (a loss that is not finite overflowed in the forward, which the loss scale, applied to the backward
            # only, cannot prevent; the loss is global, so every rank says the same)
            why = f"the training loss itself is {loss}: the forward overflows fp16, whatever the loss scale" \
                if not math.isfinite(loss) else "the gradients are not finite at any scale"
            raise FloatingPointError(f"{scaler.skips_at_min} steps in a row overflowed at the minimum loss scale "
                                     f"{scaler.min_scale:g} (step {self.step + 1}): {why}")
        self.step += 1
        self.consumed_samples += gbs
        self.loss = loss
        if not self.gc_frozen:
            # what the first step built (compiled graphs, autotuned kernels: millions of objects) is set
            # aside from the garbage collector, whose full passes would otherwise walk it mid-step; given back
            # at exit, where frozen objects are never freed (triton's bindings then print hundreds of "leaked")
            gc.collect()
            gc.freeze()
            atexit.unregister(gc.unfreeze)     # (once, however many Trainers a process builds)
            atexit.register(gc.unfreeze)
            self.gc_frozen = True
        return {"loss": loss, "lr": lr, "grad_norm": grad_norm, "param_norm": param_norm, "skipped": skipped,
                "loss_scale": scale, "stop": stop,
                "writing": writing, "gbs": gbs, "parts": self.mean_losses(parts)}

    def mean_losses(self, parts: dict) -> dict:
        """{directory: mean loss per token} of _global_loss's {directory: (summed token losses, samples)}."""
        return {name: total / (samples * self.cfg.model.seq_len) for name, (total, samples) in parts.items()}

    @property
    def skipped_steps(self) -> int:
        """fp16 steps skipped on an overflow since the run began (resumes included; 0 without a loss scale)."""
        return self.optimizer.scaler.skipped_steps if self.optimizer.scaler else 0

    def evaluate(self, stop: StopRequest | None = None) -> tuple[float | None, dict, dict]:
        """(the mean loss per token of eval_iters global batches of the validation set, {"val_loss/<dir>": the mean
        loss per token of a data.blend's directory's samples among them, "eval_loss/<dir>": that of eval_iters global
        batches of a data.eval set} ({} without either), {reason: ranks that asked to stop for it}). The batches are
        of gbs samples during a rampup_batch_size too: every evaluation reads the same samples.
        A stop request (`stop`: this rank's) rides each batch's loss all-reduce, as a step's does: when one comes
        before the last batch, every rank ends the evaluation after the same batch (an evaluation can outlast a
        scheduler's grace period) and the loss is None."""
        for chunk in self.chunks:
            chunk.eval()
        cfg, sums, parts = self.cfg, {}, {}
        batches = [(name, dataset, i) for name, dataset in ((None, self.val_data), *self.evals.items())
                   for i in range(cfg.eval_iters)]
        for n, (name, dataset, i) in enumerate(batches, 1):
            batch = get_batch(dataset, i * cfg.gbs, cfg.gbs, cfg.mbs, self.mesh.dp_rank, self.mesh.dp, self.vocab)
            loss, batch_parts, stops, _ = self._global_loss(self.engine.eval_step(batch), dataset, i * cfg.gbs, stop)
            sums[name] = sums.get(name, 0.0) + loss
            for part, (summed, samples) in batch_parts.items():
                parts[part] = tuple(a + b for a, b in zip(parts.get(part, (0.0, 0)), (summed, samples)))
            if stops and n < len(batches):
                return None, {}, stops
        evals = {f"eval_loss/{name}": total / cfg.eval_iters for name, total in sums.items() if name is not None}
        return sums[None] / cfg.eval_iters, {**{f"val_loss/{part}": loss for part, loss in
                                                 self.mean_losses(parts).items()}, **evals}, stops

    def save(self, run_dir: str, data: dict, background: bool = False) -> str:
        """Checkpoint this step into run_dir/checkpoints (keeping cfg.keep_checkpoints); `data` is the
        data's identity (dataset.data_identity), checked when the run resumes. `background`: return once
        the state is copied to the host; the files are written while training goes on, and finish_save
        publishes them (a pending save is finished first). A failed write_alone, or replicas that differ,
        stop every rank first (check_replicas)."""
        self.check_replicas()
        self.finish_save()
        path = os.path.join(run_dir, "checkpoints", f"step_{self.step:06d}")
        progress = {"step": self.step, "consumed_samples": self.consumed_samples, "loss": self.loss,
                    "evaluation_owed": self.evaluation_owed}
        self.pending = checkpoint.Save(path, progress, self.buffers, self.optimizer, self.mesh,
                                       dataclasses.asdict(self.cfg), data, self.cfg.keep_checkpoints, background,
                                       self.cfg.keep_checkpoint_interval, getattr(self.tokenizer, "data", None))
        return path if background else self.finish_save()

    def finish_save(self) -> str | None:
        """Finish the pending save (every rank; it waits for this rank's files): the path it published."""
        if self.pending is None:
            return None
        pending, self.pending = self.pending, None
        self.last_checkpoint = pending.finish()
        return self.last_checkpoint

    def init_weights(self, path: str) -> None:
        """This run's weights and fp32 masters from the checkpoint `path` (any layout: init_from; of a seq_len no
        shorter: the first rows of its position embeddings); the optimizer, the step count and the data start anew."""
        checkpoint.load(path, self.buffers, self.optimizer, self.mesh, self.device, weights_only=True,
                        seq_len=self.cfg.model.seq_len)

    def load(self, path: str) -> None:
        meta = checkpoint.load(path, self.buffers, self.optimizer, self.mesh, self.device)
        self.step, self.consumed_samples = meta["step"], meta["consumed_samples"]
        self.loss = meta.get("loss", float("nan"))
        self.last_checkpoint = path


def _setup_logging(run_dir: str, rank: int) -> logging.Logger:
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    log = logging.getLogger(f"megatron_mini.rank{rank}")
    log.setLevel(logging.INFO)
    log.handlers.clear()
    log.propagate = False
    handler = logging.FileHandler(os.path.join(run_dir, "logs", f"rank{rank:04d}.log"))
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log.addHandler(handler)
    if rank == 0:
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(console)
    return log


def _write_config(cfg: TrainConfig) -> None:
    """Rank 0 alone records the run's config (ranks must not race on one file)."""
    from omegaconf import OmegaConf

    os.makedirs(os.path.join(cfg.run_dir, ".hydra"), exist_ok=True)
    atomic_write(os.path.join(cfg.run_dir, ".hydra", "config.yaml"), OmegaConf.to_yaml(OmegaConf.structured(cfg)))


def _start_rank(cfg: TrainConfig, mesh: ParallelMesh, datasets, device: torch.device) -> tuple[logging.Logger, Trainer]:
    """This rank's log (logs/rankNNNN.log) and Trainer, once every rank has its own (neither communicates): where a
    rank fails to open its log (a file system's error) or to build its model (its device's memory is full), every
    rank raises the same RunError naming it, which that rank reports (one line), rather than going on to change
    the run directory (_tidy_run_dir) and waiting for it in a collective until timeout_s. Another exception (a
    bug) is raised as it is on its rank, with its traceback, and the others' RunError names it."""
    log = trainer = error = None
    doing = f"open its log {os.path.join(cfg.run_dir, 'logs', f'rank{mesh.rank:04d}.log')}"
    try:
        log = _setup_logging(cfg.run_dir, mesh.rank)
        doing = "build its model"
        _refuse_what_cannot_fit(cfg, mesh, device)
        trainer = Trainer(cfg, mesh, datasets, device)
    except Exception as e:      # noqa: BLE001 - told to every rank, then raised below
        error = e
    found = checkpoint.first_failure(error and f"could not {doing}: {checkpoint.describe(error)}", mesh, device)
    if error and not _environmental(error):
        raise error
    if found:
        raise RunError(f"rank {found[0]} {found[1]}", reporter=found[0]) from error
    return log, trainer


def _refuse_what_cannot_fit(cfg: TrainConfig, mesh: ParallelMesh, device: torch.device) -> None:
    """MemoryError when what this rank keeps for the whole run (rank.state_bytes_at_least: no activations), with at
    least the smallest such floor of any stage for each other rank on its device (the node's ranks share the host;
    ranks share a GPU round-robin, mesh.choose_device), is more than the device's memory: a model that large would
    be built in seconds on a GPU and fail at its first step, and layer by layer on the CPU until the kernel killed
    the process, without a word."""
    local_rank, local = gpu_slot()
    gpus = torch.cuda.device_count() if device.type == "cuda" else 1
    others = len(range(local_rank % gpus, local, gpus)) - 1

    def floors(c: TrainConfig) -> tuple[int, int]:
        """(this rank's floor, the other ranks' on its device at least) under config c."""
        return (state_bytes_at_least(c, mesh.dp, mesh.pp_rank),
                others * min(state_bytes_at_least(c, mesh.dp, r) for r in range(c.pp)) if others else 0)
    have, (need, least) = device_memory_bytes(device), floors(cfg)
    if have and need + least > have:
        beside = f" (and the {others} other rank{'s' * (others > 1)} on it at least {least / 2**30:.3g} GiB more)" \
            if others else ""
        zero = ", or zero=1" if not cfg.zero and sum(floors(dataclasses.replace(cfg, zero=1))) <= have else ""
        raise MemoryError(f"its weights, fp32 gradients and Adam state alone need at least {need / 2**30:.3g} GiB"
                          f"{beside}, more than {device}'s {have / 2**30:.3g} GiB: use a smaller model, more tensor "
                          f"or pipeline parallelism{zero}")


def _environmental(e: Exception) -> bool:
    """A failure of the machine rather than of the code: a file system's error, memory that ran out (on a GPU
    torch's OutOfMemoryError, on a CPU its allocator's RuntimeError)."""
    return isinstance(e, (OSError, MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in str(e)


def _owes_evaluation(cfg: TrainConfig, resume: checkpoint.Resume | None) -> bool:
    """Whether this start evaluates its checkpoint's step before its first step: a stop cut that evaluation short
    or came before it (meta.json's evaluation_owed), and this run evaluates at all (eval_interval > 0)."""
    return bool(resume and resume.meta.get("evaluation_owed") and cfg.eval_interval)


def _tidy_run_dir(cfg: TrainConfig, resume: checkpoint.Resume | None, mesh: ParallelMesh,
                  device: torch.device) -> tuple[list, int, RunLogger]:
    """Rank 0's writes to the run directory before the first step, once every rank has built its model and loaded
    what it resumes from; returns (notes on checkpoints set aside and interrupted saves removed, lines of metrics.jsonl
    moved aside, the run's RunLogger) on rank 0, ([], 0, a no-op RunLogger) on the others. In order: the config; a
    branch's record (before the checkpoints it branches away from are set aside: a restart after a kill in between
    branches again), and the saves a crash interrupted removed; metrics.jsonl cut at the start, since the lines past
    it are another attempt's (a crashed run's after its checkpoint, a branch's older future, or on a fresh start every
    line, of an attempt that died before its first checkpoint), so that this run's lines are the file's and a torn
    last line is not glued to its first; then metrics.jsonl opened (RunLogger; wandb started). A failure (a full
    disk, a permission) stops every rank with rank 0's message, rather than rank 0 alone while the others wait in the
    next collective."""
    step, done = resume.meta["step"] if resume else -1, {"moved": [], "cut": 0}

    def tidy():
        _write_config(cfg)
        if resume and resume.superseded:
            record_branch(cfg.run_dir, step)
        done["moved"] = (checkpoint.set_aside(resume) if resume else []) + checkpoint.remove_interrupted(cfg.run_dir)
        done["cut"] = cut_metrics(cfg.run_dir, step, _owes_evaluation(cfg, resume))
        done["logger"] = RunLogger(cfg.run_dir, cfg.wandb, dataclasses.asdict(cfg), enabled=True)
    found = checkpoint.first_failure(checkpoint.failure_of(tidy) if mesh.rank == 0 else None, mesh, device)
    if found:
        raise RunError(f"rank 0 could not write to the run directory {cfg.run_dir}: {found[1]}")
    logger = done.get("logger") or RunLogger(cfg.run_dir, cfg.wandb, dataclasses.asdict(cfg), enabled=False)
    return done["moved"], done["cut"], logger


def evaluation_note(eval_iters: int, gbs: int, val_samples: int, what: str = "the validation set") -> str | None:
    """A log line when one evaluation (eval_iters global batches of gbs samples) reads the validation set (`what`:
    a data.eval set) more than once: its loss then weighs the samples read twice double."""
    read = eval_iters * gbs
    if read <= val_samples:
        return None
    fix = (f"eval_iters={val_samples // gbs} reads each at most once" if val_samples >= gbs else
           f"it holds less than one batch of {gbs}" + (": raise data.val_fraction" if what == "the validation set"
                                                        else ""))
    return (f"evaluation: eval_iters {eval_iters} x gbs {gbs} = {read} samples, but {what} holds "
            f"{val_samples}, so each evaluation reads some of them twice or more ({fix}).")


def sp_note(cfg: TrainConfig) -> str | None:
    """The start-up line of sp=true at tp=1, which has nothing to split (Megatron turns it off with a warning)."""
    if not cfg.sp or cfg.tp > 1:
        return None
    return ("note: sp=true at tp=1 splits nothing: sequence parallelism divides the LayerNorm and dropout tokens "
            "[s, b, h] of a tensor-parallel group among its tp ranks (s/tp each), and tp=1 is one rank")


def rampup_note(cfg: TrainConfig, step: int, consumed_samples: int) -> str | None:
    """The start-up line of a rampup_batch_size run that is still ramping after `step`: the global batch it starts
    with, and the step from which it is gbs (TrainConfig.global_batch_size); None without a ramp, or past it."""
    ramp = cfg.ramp(consumed_samples)
    if not ramp:
        return None
    start, increment, samples = cfg.rampup_batch_size
    full = step + sum(n for _, n in ramp) + 1
    past = f", past steps={cfg.steps}" if full > cfg.steps else ""
    return (f"rampup_batch_size=[{start}, {increment}, {samples}]: step {step + 1} takes a global batch of "
            f"{ramp[0][0]}, growing by {increment} up to gbs {cfg.gbs} from step {full} on (sample "
            f"{consumed_samples + sum(s * n for s, n in ramp):,}){past}")


def _evaluate(trainer: Trainer, history: dict, logger: RunLogger, log: logging.Logger, stop: StopRequest,
              note: str = "") -> dict:
    """Evaluate this step (Trainer.evaluate) and record its loss; a stop request that cuts it short leaves it
    owed (Trainer.evaluation_owed). Returns the stop votes that came during it ({reason: ranks}; {} if none)."""
    val, metrics, stops = trainer.evaluate(stop)
    trainer.evaluation_owed = val is None
    if val is None:
        log.info(f"step {trainer.step:>5}/{trainer.cfg.steps} | evaluation cut short by {_stopped_by(stops, trainer)}")
        return stops
    history["val_loss"].append((trainer.step, val))
    trainer.write_alone(logger.metrics_path, logger.log, trainer.step, {"val_loss": val, **metrics})
    blend = [f"{key[9:]} {loss:.4f}" for key, loss in metrics.items() if key.startswith("val_loss/")]
    each = f" ({', '.join(blend)})" if blend else ""
    evals = "".join(f" | eval {key[10:]} {loss:.4f}" for key, loss in metrics.items() if key.startswith("eval_loss/"))
    log.info(f"step {trainer.step:>5}/{trainer.cfg.steps} | val loss {val:.4f}{each}{evals}{note}")
    return stops


def _stopped_by(stops: dict, trainer: Trainer) -> str:
    """'SIGTERM (to 1 of 2 ranks)': what asked the run to stop (signals, the time limit), and on how many ranks."""
    w = trainer.mesh.world_size
    return ", ".join(f"exit_after_minutes={trainer.cfg.exit_after_minutes:g} (reached on {n} of {w} ranks)"
                     if name == StopRequest.TIME_LIMIT else f"{name} (to {n} of {w} ranks)"
                     for name, n in stops.items())


def _evaluate_first(trainer: Trainer, history: dict, logger: RunLogger, log: logging.Logger,
                    stop: StopRequest) -> str | None:
    """The evaluation before the first step: at step 0, and on resuming from a checkpoint whose evaluation a
    stop cut short or came before (_owes_evaluation). Returns what cut this one short too (nothing new to save:
    the run stops), or None."""
    if not trainer.cfg.eval_interval or (trainer.step and not trainer.evaluation_owed):
        return None
    stops = _evaluate(trainer, history, logger, log, stop,
                      " (owed by the run that stopped)" if trainer.step else " (before training)")
    if not trainer.evaluation_owed:      # (a stop during its last batch: the first step votes it again)
        return None
    why = _stopped_by(stops, trainer)
    hint = (f" (exit_after_minutes={trainer.cfg.exit_after_minutes:g} passed before the first step: raise it, or "
            f"every start stops here)" if StopRequest.TIME_LIMIT in stops else "")
    log.info(f"stopped by {why} before step {trainer.step + 1}: nothing trained since "
             f"{trainer.last_checkpoint or 'the start'}; continue with resume=auto{hint}")
    return why


def _train_loop(trainer: Trainer, run: Run, logger: RunLogger, log: logging.Logger, history: dict,
                rate: Throughput, stop: StopRequest, memory: MemoryReport) -> str | None:
    """Steps until cfg.steps, logging every log_interval, evaluating and saving on their intervals, tracing
    the steps profile.* names; when any rank asks to stop (a signal, the time limit), every rank saves after the
    step (or the evaluation batch) and the loop ends. Returns what stopped the run, or None (also when the
    request came with the last step, the run then whole)."""
    profiler = StepProfiler(trainer.cfg.profile, trainer.cfg.run_dir, trainer.mesh.rank, trainer.device,
                            trainer.step, trainer.cfg.steps, log)
    if profiler.note:
        log.info(profiler.note)
    try:
        return _steps(trainer, run, logger, log, history, rate, stop, memory, profiler)
    finally:
        profiler.close()               # (a run that ends inside the window writes what was traced)


def _steps(trainer: Trainer, run: Run, logger: RunLogger, log: logging.Logger, history: dict, rate: Throughput,
           stop: StopRequest, memory: MemoryReport, profiler: StepProfiler) -> str | None:
    cfg = trainer.cfg
    first_consumed = interval_consumed = trainer.consumed_samples
    last_consumed = cfg.consumed_after(first_consumed, cfg.steps - trainer.step)    # (at the last step: the ETA)
    start_time = interval_start = time.time()
    warm = None                     # (time, samples) after this start's first step: the ETA's rate leaves it out
    while trainer.step < cfg.steps:
        with memory.first_step(), profiler.step(trainer.step + 1):     # (the memory of the first step only)
            out = trainer.train_step(stop)
        interval_start += profiler.take_overhead()     # (the profiler's start, stop and files: not the step's time)
        warm = warm or (time.time(), trainer.consumed_samples)
        history["loss"].append(out["loss"])
        history["grad_norm"].append(out["grad_norm"])
        step = trainer.step
        if cfg.logs(step) or out["stop"]:
            now = time.time()
            consumed = trainer.consumed_samples
            r = rate((consumed - interval_consumed) * cfg.model.seq_len, now - interval_start)
            record = {"loss": out["loss"], **{f"loss/{name}": loss for name, loss in out["parts"].items()},
                      "lr": out["lr"], "grad_norm": out["grad_norm"], **r}
            if out["param_norm"] is not None:        # (a step logged because a stop came has none)
                record["param_norm"] = out["param_norm"]
            if cfg.rampup_batch_size:
                record.update(gbs=out["gbs"], consumed_samples=consumed)
            if out["loss_scale"] is not None:
                record.update(loss_scale=out["loss_scale"], skipped_steps=trainer.skipped_steps)
            trainer.write_alone(logger.metrics_path, logger.log, step, record)
            # the time per sample since the first step (which compiles, autotunes, warms the allocator up:
            # a minute on a GPU), or of the first step while it is the only one
            since, base = warm if consumed > warm[1] else (start_time, first_consumed)
            eta = (now - since) / (consumed - base) * (last_consumed - consumed)
            log.info(step_line(step, cfg, out, r, rate, now - start_time, eta, trainer.skipped_steps))
            interval_start, interval_consumed = now, consumed
        paused = time.time()
        if cfg.eval_interval and (step % cfg.eval_interval == 0 or step == cfg.steps):
            if out["stop"]:             # the save comes first (a grace period is short); the resumed run evaluates
                trainer.evaluation_owed = True
            else:                       # (a stop that comes during it: saved and stopped now too)
                out["stop"] = _evaluate(trainer, history, logger, log, stop)
        if out["stop"]:
            profiler.close()            # (the trace ends with the step, or the evaluation cut short: not the save)
        due = (cfg.save_interval and step % cfg.save_interval == 0) or step == cfg.steps or out["stop"]
        if cfg.replica_check_interval and step % cfg.replica_check_interval == 0 and not due:   # (a save checks)
            trainer.check_replicas()
        if due or not out["writing"]:                  # (not writing: every rank's files are done)
            _finish_pending(trainer, log)
        if due:
            background = cfg.async_save and step < cfg.steps and not out["stop"]
            path = trainer.save(cfg.run_dir, run.data, background)
            log.info(f"saving {path} while training" if background else f"saved {path}")
        interval_start += time.time() - paused    # a step line's rate is the training steps' own
        if out["stop"] and (step < cfg.steps or trainer.evaluation_owed):   # (else the run is whole: it ends)
            why = _stopped_by(out["stop"], trainer)
            owed = f" (which evaluates step {step} first)" if trainer.evaluation_owed else ""
            log.info(f"stopped by {why} after step {step}: saved {trainer.last_checkpoint}; continue with "
                     f"resume=auto{owed}")
            return why
    return None


def _finish_pending(trainer: Trainer, log: logging.Logger) -> None:
    """Publish the async save being written, if any (every rank together: Trainer.finish_save)."""
    if trainer.pending:
        log.info(f"saved {trainer.finish_save()} (written while training)")


def _summarize(trainer: Trainer, logger: RunLogger, log: logging.Logger, history: dict, rate: Throughput,
               steps_run: int, samples_run: int, elapsed: float, stopped_by: str | None, memory: MemoryReport) -> None:
    """The run's final figures, into `history` with its checkpoint and memory report; rank 0's last writes
    (summary.json and wandb's summary, metrics.jsonl closed, history.json), then the run's last collective: a
    failure of any stops every rank with rank 0's message and exit 1 (the run's record is incomplete, though
    its last checkpoint is whole), rather than rank 0 alone while the others exit 0; then wandb's finish (an
    upload may take longer than a collective's timeout_s) and the closing lines of the console."""
    cfg = trainer.cfg
    r = rate(samples_run * cfg.model.seq_len, elapsed)
    val = history["val_loss"][-1][1] if history["val_loss"] else None
    summary = {"final_loss": strict_json(trainer.loss),     # (a resumed run that trained no step: its checkpoint's;
               "final_val_loss": strict_json(val),           # None for none, or one that is not finite)
               "steps": trainer.step, "skipped_steps": trainer.skipped_steps, "elapsed_s": elapsed, **r}
    if stopped_by:
        summary["stopped_by"] = stopped_by
    history.update(summary=summary, checkpoint=trainer.last_checkpoint, memory=memory.history())
    trainer.write_alone(logger.summary_path, logger.summary, summary)
    trainer.write_alone(logger.metrics_path, logger.close)
    if trainer.mesh.rank == 0:
        path = os.path.join(cfg.run_dir, "history.json")
        trainer.write_alone(path, lambda: atomic_write(path, json.dumps(strict_json(history))))
    trainer.stop_on_failure()
    logger.finish()                      # wandb's own closing lines come before our summary
    log.info("-" * 72)
    evals = history["val_loss"]
    if not evals:
        val_text = "val loss not evaluated"
    elif len(evals) == 1:               # (a resumed start's one evaluation: no comparison with itself)
        val_text = f"val loss {evals[0][1]:.4f} (step {evals[0][0]})"
    else:
        val_text = f"val loss {evals[-1][1]:.4f} (step {evals[0][0]}: {evals[0][1]:.4f})"
    trained = "no train loss" if math.isnan(trainer.loss) else f"final train loss {trainer.loss:.4f}"
    ended = "stopped" if stopped_by else "done"          # (a stop's own line, above, says how to continue)
    log.info(f"{ended}: {steps_run} step{'s' * (steps_run != 1)} in {format_duration(elapsed)} | {trained} | "
             f"{val_text} | {rate.text(r, ', ')} (the first step's warm-up, evaluations "
             f"and checkpoints included) | {rate.memory_text(r)}")
    sync = logger.wandb_segments if logger.wandb_path and logger.mode == "offline" else None
    for line in closing_lines(trainer.last_checkpoint, os.path.join(cfg.run_dir, "metrics.jsonl"), logger.wandb_path,
                              sync):
        log.info(line)


def closing_lines(last_checkpoint: str | None, metrics: str, wandb_path: str | None, sync: str | None) -> list[str]:
    """The lines below a run's done line: its checkpoint, metrics and wandb directory, and the commands to copy (`sync`:
    offline directories to upload: shell words), the commands' paths quoted for a shell; no sample without a
    checkpoint."""
    lines = [f"checkpoint: {last_checkpoint or 'none'}", f"metrics:    {metrics}",
             f"wandb:      {wandb_path or 'disabled'}" + (f"  (upload every start's with: wandb sync {sync} )"
                                                         if sync else "")]
    if last_checkpoint:
        lines.append(f"sample:     python tools/generate.py {shlex.quote(last_checkpoint)} --prompt 'def main(' "
                     f"--max-new-tokens 200")
    return lines


def train(cfg: TrainConfig, datasets: tuple | None = None) -> dict:
    """Train on every rank of the job; returns the history (losses per step, eval losses, summary). `datasets`:
    dataset.load_run_data(cfg)'s, where the caller has loaded them (train.py, before it imports torch)."""
    minutes = cfg.exit_after_minutes                                  # (counted from here, set-up included)
    deadline = time.monotonic() + 60 * minutes if minutes else None
    rank, world_size, _, _ = launch_env()
    follow_parent()
    EarlyInterrupt.raise_if_lost(signal.getsignal(signal.SIGINT))    # (a Ctrl-C that a callback swallowed: now)
    run = prepare_run(cfg, rank, world_size, datasets)
    # a stop signal is a request once the ranks have met (_train); until then it ends a rank of a job at once: a rank
    # that took it as a request waited in the rendezvous for the others it ended (a SIGINT's KeyboardInterrupt does
    # not interrupt that wait either), until torchrun's SIGKILL 30 s later (without torchrun: timeout_s)
    stop = StopRequest(deadline, take_signals=False)
    main_thread = threading.current_thread() is threading.main_thread()     # (only there can Python take signals)
    try:
        if main_thread and world_size > 1:
            stop.take(STOPPING, signal.SIG_DFL)
        return _train(cfg, run, rank, world_size, stop, main_thread)
    except CommError:
        if stop.requested:              # the launcher is tearing the job down: the cause is elsewhere
            raise Terminated() from None
        raise
    finally:
        stop.close()
        if run.lock:
            run.lock.release()


def agree_on_config(cfg: TrainConfig, data: dict, device: torch.device) -> None:
    """The job's first collective, before the mesh (whose groups cfg's layout decides): every rank runs rank
    0's resolved config and read the same prepared data (`data`, dataset.data_identity: the tokenizer's and the
    corpus's sha256, its token count), or every rank stops with one ConfigError. Hydra resolves the command line on
    each rank, so ${now:...} or ${oc.env:...} can differ between them (ranks then wrote to different run directories,
    found only when a checkpoint's files went missing), and so can the command lines of two nodes; each node may read
    data.dir from a disk of its own (ranks then trained on other token ids, or another corpus, without a word)."""
    world = dist.get_world_size()
    if world == 1:
        return
    text = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)
    group = Group("world", list(range(world)), dist.group.WORLD, Ledger())
    seen = [json.loads(x) for x in checkpoint.gather_text(json.dumps(
        [hashlib.sha256(text.encode()).hexdigest(), cfg.run_dir, data], sort_keys=True), group, device)]
    differ = checkpoint.unlike_rank_0([h for h, _, _ in seen])
    if differ:
        r = differ[0]
        where = f" (run_dir: rank 0 {seen[0][1]}, rank {r} {seen[r][1]})" if seen[r][1] != seen[0][1] else ""
        raise ConfigError(f"{checkpoint.ranks_text(differ)} resolved the config differently from rank 0{where}: "
                          f"an interpolation such as ${{now:...}} or ${{oc.env:...}} gives each rank its own value, "
                          f"or the nodes were started with other arguments; give the value itself on the command "
                          f"line, the same on every node.")
    differ = checkpoint.unlike_rank_0([d for _, _, d in seen])
    if differ:
        r = differ[0]
        ours, theirs = seen[0][2], seen[r][2]
        keys = ", ".join(f"{key} {str(ours.get(key))[:12]} | {str(theirs.get(key))[:12]}"
                         for key in sorted(set(ours) | set(theirs)) if ours.get(key) != theirs.get(key))
        where = f"data.blend={list(cfg.data.blend)}" if cfg.data.blend else f"data.dir={cfg.data.dir}"
        raise ConfigError(f"{checkpoint.ranks_text(differ)} read other data than rank 0 at {where} ({keys}: rank 0 "
                          f"| rank {r}): each node holds a build of its own there, and they differ; give every node "
                          f"the same prepared directory (a copy of one build, or a file system they share).")


def agree_on_run_dir(cfg: TrainConfig, run: Run, mesh: ParallelMesh, device: torch.device) -> str:
    """How the job starts: "resume", "init_from" or "none", as rank 0 found at prepare_run (every rank's, as are
    the listings that then choose the checkpoint, agree_verify's: a listing that NFS caches may be older on one
    node). Every rank must see rank 0's run directory, or every rank stops with one ConfigError, before any rank
    reads a checkpoint: each rank reads run_dir/.lock, which rank 0 holds and which names it (host, pid); where each
    node has a run_dir of its own (a node-local disk, a relative run_dir in each node's working directory), the
    others find no such file or an earlier run's: their checkpoint files would be written where rank 0 never
    publishes them."""
    start = "resume" if run.resume else "init_from" if run.init else "none"
    seen = [text.split(" ", 1) for text in
            checkpoint.gather_text(f"{start} {DirectoryLock.holder(cfg.run_dir) or ''}", mesh.world_group, device)]
    differ = checkpoint.unlike_rank_0([holder for _, holder in seen])
    if differ:
        r, holder = differ[0], seen[0][1]
        there = f"names {seen[r][1]} there" if seen[r][1] else "is missing there"
        relative = "" if os.path.isabs(cfg.run_dir) else \
            f" (run_dir={cfg.run_dir} is relative: each node finds it in its own working directory)"
        raise ConfigError(f"{checkpoint.ranks_text(differ)} do{'es' * (len(differ) == 1)} not see rank 0's run "
                          f"directory {cfg.run_dir}{relative}: its lock, held by rank 0 ({holder}), {there}. Every "
                          f"rank must see the same run_dir, on a file system that all nodes share (not a node-local "
                          f"disk): each rank writes its part of every checkpoint there, and rank 0 publishes them; "
                          f"data.dir may be each node's own copy.")
    return seen[0][0]


def _train(cfg: TrainConfig, run: Run, rank: int, world_size: int, stop: StopRequest, main_thread: bool) -> dict:
    history = {"loss": [], "val_loss": [], "grad_norm": [], "summary": None, "checkpoint": None}
    init_process_group(run.device, run.backend, cfg.timeout_s)
    if main_thread:
        stop.take()
    agree_on_config(cfg, run.data, run.device)
    mesh = ParallelMesh(cfg.tp, cfg.pp, run.dp, timeout_s=cfg.timeout_s)
    refused = checkpoint.first_failure(run.refused, mesh, run.device)      # before anything touches the run dir
    if refused:
        raise ConfigError(refused[1])
    start = agree_on_run_dir(cfg, run, mesh, run.device)
    if start == "resume":              # every file's sha256, each rank hashing its share; an older one if need be
        found = checkpoint.find_resume(cfg, checkpoint.agree_verify(mesh, run.device))   # (one choice: its listing)
        if found is None:
            raise checkpoint.CheckpointError(f"{cfg.run_dir}'s checkpoints were removed as the job started; start "
                                             f"again.")
        checkpoint.agree_on_files(found.path, mesh, run.device)
        run.resume = check_resume(cfg, found, run.datasets, run.data, run.dp)   # (every rank: the same meta.json and
                                                                                # data, so the same answer)
        at = run.resume.meta["step"]          # (at `steps`, a start may still owe the last step's evaluation)
        if at > cfg.steps or (at == cfg.steps and not _owes_evaluation(cfg, run.resume)):
            if rank == 0:
                print(f"{run.resume.path} is at step {at}, and steps={cfg.steps}: nothing to "
                      f"train (raise steps to train further; optimizer.decay_steps fixes where the lr decay "
                      f"ends, which otherwise moves with steps).", flush=True)
            dist.destroy_process_group()
            return {**history, "checkpoint": run.resume.path}
    if start == "init_from":           # its files' sha256 too, before they are read; an older one if need be
        found = checkpoint.chosen(cfg.init_from, checkpoint.agree_verify(mesh, run.device), "init_from")
        checkpoint.agree_on_files(found.path, mesh, run.device)     # (then its checks are the same on every rank)
        run.init = checkpoint.init_of(cfg, found, run.datasets[2].sha256)
    log, trainer = _start_rank(cfg, mesh, run.datasets, run.device)
    if run.resume:
        trainer.load(run.resume.path)
        trainer.evaluation_owed = _owes_evaluation(cfg, run.resume)
    elif run.init:
        trainer.init_weights(run.init.path)
    moved, cut, logger = _tidy_run_dir(cfg, run.resume, mesh, run.device)
    if run.resume:
        schedule = schedule_note(run.resume.meta["config"], cfg, trainer.optimizer.step_count,
                                 cfg.steps - trainer.step)
        evals = checkpoint.evaluation_changes(run.resume.meta, run.data, cfg) + \
            checkpoint.loss_scaler_changes(run.resume.meta, cfg)
        for note in run.resume.notes + moved + ([schedule] if schedule else []) + evals:
            log.info(f"resume: {note}")
        log.info(f"resumed from {run.resume.path} at step {trainer.step} ({trainer.consumed_samples} samples consumed)")
    elif run.init:
        log.info(f"init_from: the weights of {run.init.path} (step {run.init.meta['step']} of the run that saved it); "
                 f"the optimizer, the step count and the data start anew{''.join(f'; {n}' for n in run.init.notes)}")
    for note in [] if run.resume else moved:          # (a fresh start's: an attempt that saved nothing whole)
        log.info(note)
    if cut:
        past = f"past step {trainer.step}" if run.resume else "of an earlier attempt (it left no checkpoint)"
        log.info(f"moved {cut} line{'s' * (cut != 1)} of metrics.jsonl {past} to metrics.superseded.jsonl")
    log.info(f"{mesh} | model {cfg.model.name}: {cfg.model.num_params() / 1e6:.2f}M parameters | "
             f"gbs {cfg.gbs} = {cfg.num_microbatches(mesh.dp)} microbatches x mbs {cfg.mbs} x dp {mesh.dp} | "
             f"{cfg.precision.dtype} | "
             f"{run.device} ({run.backend}){' | torch.compile' if compiles(cfg, run.device) else ''}")
    if isinstance(trainer.train_data, BlendedDataset):
        log.info(blend_note(trainer.train_data))
    for note in split_notes(trainer.train_data, trainer.val_data, cfg.data.val_fraction):
        log.info(note)
    if cfg.eval_interval:
        for what, dataset in (("the validation set", trainer.val_data),
                              *((f"data.eval's {name}", ds) for name, ds in trainer.evals.items())):
            if (note := evaluation_note(cfg.eval_iters, cfg.gbs, len(dataset), what)) is not None:
                log.info(note)
        for note in trained_eval_notes(cfg.data):
            log.info(note)
    elif cfg.data.eval:
        log.info(f"note: eval_interval=0 evaluates nothing, so data.eval's {', '.join(cfg.data.eval_dirs())} "
                 f"(checked) are never read: set eval_interval to evaluate them")
    memory = MemoryReport(trainer, log, cfg.memory_plan)
    memory.start()

    sharing = ranks_per_gpu(run.device, gpu_slot()[1], torch.cuda.device_count())
    rate = Throughput(cfg, world_size, run.device, run.backend, ranks_per_device=sharing, rank=rank)
    if (note := rate.missing_peak_note()) is not None:
        log.info(f"note: {note}")
    if stop.deadline is not None:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() + stop.deadline - time.monotonic()))
        log.info(f"exit_after_minutes={cfg.exit_after_minutes:g}: every rank saves and stops after the first step "
                 f"past {at} on any of them")
    for note in (sp_note(cfg), rampup_note(cfg, trainer.step, trainer.consumed_samples),
                 warmup_note(cfg.optimizer, cfg.steps)):
        if note is not None:
            log.info(note)
    first_step, first_consumed, start_time = trainer.step, trainer.consumed_samples, time.time()
    try:
        stopped_by = _evaluate_first(trainer, history, logger, log, stop) or \
            _train_loop(trainer, run, logger, log, history, rate, stop, memory)
        _summarize(trainer, logger, log, history, rate, trainer.step - first_step,
                   trainer.consumed_samples - first_consumed, time.time() - start_time, stopped_by, memory)
    except (FloatingPointError, DataError, RunError) as e:
        # every rank raises these at the same step (the global loss; the fp16 scaler's state; the ids of the
        # whole global batch, which every rank reads; a failed save, or write_alone): the save still being
        # written, of an earlier step, is published as a sync save would have been
        _finish_pending(trainer, log)
        logger.finish()
        if not isinstance(e, FloatingPointError):
            raise
        advice = ("use precision=bf16 (fp32's exponent range, no loss scale) or lower optimizer.lr"
                  if cfg.precision.dtype == "fp16" else "lower optimizer.lr (or raise optimizer.warmup_steps)")
        raise RunError(f"Training stopped ({cfg.precision.dtype}): {e}. Nothing was saved over the last good "
                       f"checkpoint ({trainer.last_checkpoint or 'none'}); {advice}.") from None
    except KeyboardInterrupt:
        # a second Ctrl-C (the first asks for a save): the command ends at once, unsaved and without a traceback
        # (train.py's quiet_interrupt, which replaces the hook wandb.init installed), so wandb's hook cannot record
        # the interrupted run as it would (exit code 255, wandb's for Ctrl-C): done here, as its atexit would finish it
        logger.finish(exit_code=255)
        raise
    dist.destroy_process_group()
    return history
