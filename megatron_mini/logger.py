"""What a run reports: a crash-safe `metrics.jsonl` in the run directory, mirrored to wandb (rank 0's
RunLogger), and the throughput figures of the console line (Throughput, step_line).

Every `log()` appends one JSON line (written at once, unbuffered) and, when wandb is on, calls `wandb.log`.
wandb is imported only when it is used, and any wandb failure prints one warning and leaves
`metrics.jsonl` as the record of the run.
"""
from __future__ import annotations

import hashlib
import json
import math
import netrc
import os
import re
import resource
import shlex
import sys
from urllib.parse import urlsplit

import torch

from .config import TrainConfig, WandbConfig
from .files import atomic_write
from .hardware import math_dtype, peak_tflops


def resolve_mode(mode: str) -> str:
    """Turn a WandbConfig.mode (a config.WandbMode, checked by validate) into online | offline | disabled.

    "auto" follows $WANDB_MODE when it is set, else "online" when an API key is configured
    ($WANDB_API_KEY, or a netrc entry for the wandb host), else "offline".
    """
    if mode != "auto":
        return mode
    env_mode = os.environ.get("WANDB_MODE")
    if env_mode in ("online", "offline", "disabled"):
        return env_mode
    return "online" if _has_api_key() else "offline"


def _has_api_key() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlsplit(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).netloc
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


BRANCHES = "branches.json"


def branches(run_dir: str) -> list:
    """The steps from which the run directory's branches resumed, oldest first ({run_dir}/branches.json; a
    branch is a resume=PATH to a checkpoint older than the run's newest, which it sets aside). A file that is
    not such a list counts as none, with a warning. Without the file, the branches f689540 recorded as wandb ids
    (wandb_ids.json, {name: [first id, <first id>-b1, ...]}), at steps it did not keep (-1)."""
    path = os.path.join(run_dir, BRANCHES)
    try:
        with open(path, encoding="utf-8") as f:
            steps = json.load(f)
    except FileNotFoundError:
        return _wandb_ids_branches(run_dir)
    except (OSError, ValueError) as e:
        steps = e
    if isinstance(steps, list) and all(type(s) is int for s in steps):
        return steps
    return _no_branches(path, "a list of steps", steps)


def _wandb_ids_branches(run_dir: str) -> list:
    """branches() of a run directory that f689540 branched: its wandb_ids.json ({name: [first id, -b1, ...]})."""
    path = os.path.join(run_dir, "wandb_ids.json")
    try:
        with open(path, encoding="utf-8") as f:
            ids = json.load(f)
    except FileNotFoundError:
        return []
    except (OSError, ValueError) as e:
        ids = e
    if isinstance(ids, dict) and all(isinstance(v, list) for v in ids.values()):
        return [-1] * max((len(v) - 1 for v in ids.values()), default=0)
    return _no_branches(path, "a mapping of names to wandb ids", ids)


def _no_branches(path: str, what: str, found) -> list:
    print(f"warning: {path} is not {what} ({found!r:.80}); counting no branch before this one, so "
          "wandb may log this run to an earlier branch's run", file=sys.stderr, flush=True)
    return []


def record_branch(run_dir: str, step: int) -> None:
    """Add a branch from `step` to {run_dir}/branches.json (rank 0, before it sets the newer checkpoints aside:
    a restart after a kill in between branches again, and a wandb run is never shared by two branches)."""
    atomic_write(os.path.join(run_dir, BRANCHES), json.dumps(branches(run_dir) + [step]))


def run_id(run_dir: str, name: str) -> str:
    """The wandb run id this run directory logs to under `name`: the same on every restart, so that a resumed run
    continues its wandb run; after k branches (branches.json) `<first id>-b<k>`, a new wandb run, since wandb
    keeps the first value logged at a step: the branch's steps up to the old history's last would be dropped
    from the old run. Whatever wandb's mode was when the branch was made."""
    digest = hashlib.sha1(f"{os.path.realpath(run_dir)}|{name}".encode()).hexdigest()[:10]
    first = f"{re.sub(r'[^A-Za-z0-9_-]', '-', name)[:40]}-{digest}"
    k = len(branches(run_dir))
    return f"{first}-b{k}" if k else first


def _plain(value):
    """A tensor / numpy scalar / number as a plain int or float (strings and None pass through)."""
    if hasattr(value, "item"):
        value = value.item()
    return value if value is None or isinstance(value, (int, str)) else float(value)


def strict_json(value):
    """value with null for every float that is not finite, in dicts, lists and tuples: NaN and Infinity are not
    JSON, and strict readers (JavaScript's, Go's) refuse the lines Python writes for them (an fp16 step's skipped
    grad_norm is NaN). For metrics.jsonl, summary.json and history.json; wandb is given the numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def cut_metrics(run_dir: str, step: int, evaluates_it: bool = False) -> int:
    """A run starting from `step` (-1: a fresh start, which keeps none): metrics.jsonl keeps its lines up to that
    step; the later ones, which the run logs again (after a crash) or replaces (a branch from an older
    checkpoint, or a fresh start after an attempt that died before its first checkpoint), those of an
    evaluation at `step` when the run evaluates it first (`evaluates_it`: its checkpoint owes it, and an
    earlier resume may have logged it), and a line a kill cut short, are appended to metrics.superseded.jsonl.
    Returns their count.

    A kill anywhere in between moves every line exactly once: a journal, metrics.cut.json (metrics.jsonl's
    sha256 and metrics.superseded.jsonl's size before the cut), is written first, then each file is
    rewritten atomically, and the journal removed. The next start finishes or undoes what the journal names:
    where metrics.jsonl is still the one it names, the cut may have reached metrics.superseded.jsonl (cut
    back to its size; the cut then runs again), else the cut is whole."""
    path, superseded = os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "metrics.superseded.jsonl")
    journal = os.path.join(run_dir, "metrics.cut.json")
    text, before = _read_bytes(path), _read_bytes(superseded)
    if os.path.exists(journal):
        with open(journal, encoding="utf-8") as f:
            left = json.load(f)
        if text is not None and hashlib.sha256(text).hexdigest() == left["metrics_sha256"]:
            before = (before or b"")[:left["superseded_size"]]
            atomic_write(superseded, before)
        os.unlink(journal)
    if text is None:
        return 0

    def kept(line: bytes) -> bool:
        try:
            record = json.loads(line) if line.endswith(b"\n") else {}
            return record["step"] < step or record["step"] == step and not (evaluates_it and "val_loss" in record)
        except (ValueError, KeyError, TypeError):
            return False
    keep, cut = [], []
    for line in text.splitlines(keepends=True):
        (keep if kept(line) else cut).append(line)
    if cut:
        before = before or b""
        atomic_write(journal, json.dumps({"metrics_sha256": hashlib.sha256(text).hexdigest(),
                                          "superseded_size": len(before)}))
        atomic_write(superseded, before + b"".join(line if line.endswith(b"\n") else line + b"\n" for line in cut))
        atomic_write(path, b"".join(keep))
        os.unlink(journal)
    return len(cut)


def _read_bytes(path) -> bytes | None:
    """The file's bytes, None where there is no such file."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None


def offline_segments(folder: str, run_id: str) -> str:
    """Every offline directory in `folder` of the wandb run `run_id`, one per start, as words for a shell: the
    pattern `.../offline-run-*-<id>` (`*` a start's date and time), then each directory that wandb named
    `...-<id>-<n>` (a start within the same second as an earlier one), quoted. `wandb sync` takes a run's
    directories in the order they started, whatever the order of its arguments."""
    same_second = re.compile(rf"offline-run-\d{{8}}_\d{{6}}-{re.escape(run_id)}-\d+")
    named = sorted(n for n in os.listdir(folder) if same_second.fullmatch(n)) if os.path.isdir(folder) else []
    return " ".join([f"{shlex.quote(os.path.join(folder, 'offline-run-'))}*{shlex.quote('-' + run_id)}",
                     *(shlex.quote(os.path.join(folder, n)) for n in named)])


class RunLogger:
    """Writes `{run_dir}/metrics.jsonl` and logs to wandb; every method is a no-op when not enabled. The lines
    go straight to the file (opened to append, unbuffered): a line that fails to be written (a full disk)
    raises in `log` and is not left behind for `close` to try again."""

    def __init__(self, run_dir: str, wandb_cfg: WandbConfig, config: dict, enabled: bool):
        self.mode = resolve_mode(wandb_cfg.mode)
        self.enabled = enabled
        self.run_dir = run_dir
        self.metrics_path = os.path.join(run_dir, "metrics.jsonl")
        self.summary_path = os.path.join(run_dir, "summary.json")
        self._run = None
        self._file = None
        self._wandb_path = self._wandb_id = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self._file = open(self.metrics_path, "ab", buffering=0)
        if self.mode == "disabled":
            return
        name = wandb_cfg.name or os.path.basename(os.path.normpath(run_dir))
        try:
            import wandb

            self._run = wandb.init(
                project=wandb_cfg.project, group=wandb_cfg.group, name=name, config=config,
                dir=run_dir, mode=self.mode, id=run_id(run_dir, name), resume="allow",
            )
            self._wandb_path, self._wandb_id = os.path.abspath(self._run.settings.sync_dir), self._run.id
        except Exception as e:  # wandb must never stop training
            self._wandb_failed("init", e)

    @property
    def wandb_path(self) -> str | None:
        """The local wandb run directory (what `wandb sync` takes), or None when wandb is off or failed to start."""
        return self._wandb_path

    @property
    def wandb_segments(self) -> str | None:
        """Every offline directory of this wandb run, one per start (the run's restarts each write one, under the
        same id), as shell words for `wandb sync` (offline_segments)."""
        if self._wandb_path is None:
            return None
        return offline_segments(os.path.dirname(self._wandb_path), self._wandb_id)

    def log(self, step: int, metrics: dict) -> None:
        """Record `metrics` at `step`: one line in metrics.jsonl, one wandb.log call."""
        if not self.enabled:
            return
        data = {key: _plain(value) for key, value in metrics.items()}
        line = (json.dumps({"step": int(step), **strict_json(data)}) + "\n").encode()
        while line:                                  # (a write may take part of it)
            line = line[self._file.write(line):]
        if self._run is not None:
            try:
                self._run.log(data, step=int(step))
            except Exception as e:
                self._wandb_failed("log", e)

    def summary(self, values: dict) -> None:
        """Final values of the run: into wandb.summary and `{run_dir}/summary.json`."""
        if not self.enabled:
            return
        data = {key: _plain(value) for key, value in values.items()}
        atomic_write(self.summary_path, json.dumps(strict_json(data), indent=2))
        if self._run is not None:
            try:
                self._run.summary.update(data)
            except Exception as e:
                self._wandb_failed("summary", e)

    def close(self) -> None:
        """Close metrics.jsonl (safe to call twice)."""
        if self._file is not None:
            file, self._file = self._file, None
            file.close()

    def finish(self, exit_code: int | None = None) -> None:
        """Close metrics.jsonl, finish the wandb run (`exit_code`: how wandb records its end, 0 by default: a
        non-zero one shows it as failed) and wait until its files are on disk (safe to call twice)."""
        self.close()
        if self._run is not None:
            try:
                import wandb

                self._run.finish(exit_code=exit_code)
                wandb.teardown()  # run.finish() can return before the .wandb file is fully written
            except Exception as e:
                self._wandb_failed("finish", e)
            self._run = None

    def _wandb_failed(self, what: str, error: Exception) -> None:
        print(f"warning: wandb {what} failed ({type(error).__name__}: {error}); "
              f"continuing with {self.run_dir}/metrics.jsonl only", file=sys.stderr, flush=True)
        self._run = None


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class Throughput:
    """Tokens/s, model TFLOP/s per GPU (per rank on a CPU, or where ranks share a GPU) and MFU over a logging
    interval, and this rank's peak memory.

    TFLOP/s per rank = ModelConfig.flops_per_token() x tokens/s / world size (model FLOPs:
    recomputation is not counted); MFU = the device's TFLOP/s (ranks_per_device x the rank's, where
    ranks share a GPU) / its dense peak (hardware.py, or precision.peak_tflops), None where the peak is
    unknown (a CPU)."""

    def __init__(self, cfg: TrainConfig, world_size: int, device: torch.device, backend: str,
                 ranks_per_device: float = 1.0, *, rank: int):
        self.flops_per_token, self.world_size, self.device = cfg.model.flops_per_token(), world_size, device
        self.rank = rank                                # (whose peak memory this is: the console shows rank 0's)
        self.ranks_per_device = ranks_per_device
        self.peak = peak_tflops(device, cfg.precision.dtype, cfg.precision.tf32, cfg.precision.peak_tflops)
        self.dtype = math_dtype(cfg.precision.dtype, cfg.precision.tf32)
        self.per = "GPU" if device.type == "cuda" and backend == "nccl" else "rank"   # (gloo: ranks may share one)

    def missing_peak_note(self) -> str | None:
        """A GPU whose dense peak is not known (not in hardware.GPUS, no precision.peak_tflops): the one line
        that says why there is no MFU and how to get it; None otherwise (a CPU has no MFU to miss)."""
        if self.device.type != "cuda" or self.peak:
            return None
        return (f"no MFU: {torch.cuda.get_device_name(self.device)} is not in megatron_mini/hardware.py's table; "
                f"give its dense {self.dtype} peak with precision.peak_tflops=N")

    def __call__(self, tokens: int, seconds: float) -> dict:
        tokens_per_s = tokens / max(seconds, 1e-9)
        tflops = self.flops_per_token * tokens_per_s / self.world_size / 1e12
        out = {"tokens_per_s": tokens_per_s, "tflops": tflops, "peak_mem_gib": self.peak_memory_gib()}
        if self.peak:
            out["mfu"] = tflops * self.ranks_per_device / self.peak
        return out

    def text(self, rate: dict, sep: str = " | ") -> str:
        """'tokens/s | TFLOP/s per GPU (or rank) | MFU' of a __call__'s result, for the console."""
        mfu = f"{sep}MFU {100 * rate['mfu']:.1f}%" if "mfu" in rate else ""
        return f"{rate['tokens_per_s']:,.0f} tok/s{sep}{rate['tflops']:.3g} TFLOP/s/{self.per}{mfu}"

    def memory_text(self, rate: dict) -> str:
        """'peak mem X GiB (rank N)': this rank's alone (the console's lines are rank 0's), not the job's largest."""
        return f"peak mem {rate['peak_mem_gib']:.2f} GiB (rank {self.rank})"

    def peak_memory_gib(self) -> float:
        """Peak memory of this rank: CUDA memory allocated by torch, or the process's peak RSS on a CPU."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**30
        return peak_rss_bytes() / 2**30


def peak_rss_bytes() -> int:
    """This process's peak resident set size in bytes: getrusage's ru_maxrss, which Linux gives in KiB and macOS
    in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def step_line(step: int, cfg: TrainConfig, out: dict, rate: dict, throughput: Throughput, elapsed: float,
              eta: float, skipped_steps: int) -> str:
    scale = f" | scale {out['loss_scale']:.0f} | skipped {skipped_steps}" if out["loss_scale"] is not None else ""
    gbs = f" | gbs {out['gbs']}" if cfg.rampup_batch_size else ""
    return (f"step {step:>5}/{cfg.steps} | loss {out['loss']:.4f} | lr {out['lr']:.2e}{gbs} | "
            f"grad norm {out['grad_norm']:.3f} | "
            f"{throughput.text(rate)} | "
            f"{throughput.memory_text(rate)} | elapsed {format_duration(elapsed)} | "
            f"ETA {format_duration(eta)}{scale}")
