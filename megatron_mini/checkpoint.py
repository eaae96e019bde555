"""Layout-free, checksummed checkpoints: every rank writes its own slices, by global name, and any layout
reads them back.

    {run_dir}/checkpoints/step_000100/
        model_pp00_tp00.pt ...       {global name: weight, in the model's dtype} of one (pipeline stage,
                                     TP rank): its TP slices (GradBuffer.saved_weights; written by DP rank 0)
        optim_pp00_tp00_dp00.pt ...  {global name: {exp_avg, exp_avg_sq[, master]}}: the flat slice of each
                                     parameter's TP slice that this rank's optimizer holds (Optimizer.saved_state:
                                     DP rank 0's whole state, or with ZeRO-1 every rank's own shard); the fp32
                                     master only beside 16-bit weights (fp32 weights are their own master)
        tokenizer.model              the run's tokenizer (written by rank 0), which the tools read: a checkpoint
                                     keeps its own, whatever becomes of the data directory
        meta.json                    step, consumed_samples, the step's loss, whether its evaluation is owed (a
                                     stop came first), layout, config, data identity, the optimizer's
                                     counters, the sha256 of every file, and the index: each tensor's full
                                     shape and TP split ("tensors"), what each file holds ("shards")
    {run_dir}/checkpoints/latest   the name of the newest complete checkpoint

As in Megatron, a save moves no tensor between ranks and no process holds more than its own state
(BLOOM-176B's checkpoint is 2.24 TiB, 14 bytes per parameter: gathered onto one writer per pipeline stage,
each of tp=4 pp=12's twelve would hold about 190 GiB of host memory). A value is written once: the weights
by DP rank 0, a TP-replicated parameter by TP rank 0, the tied embedding by the first stage, an fp32 master
as the weight (12 bytes per parameter in fp32).

Saving: every rank writes its files into `step_N.tmp/` (made by rank 0: `step_N.tmp-2/` beside a leftover that could
not be removed), hashing them as it writes; rank 0 writes meta.json with the hashes and the index (gathered onto it
as text), renames the directory to `step_N/`, then rewrites `latest` (tmp + rename) and removes all but the newest
`keep` checkpoints and the milestones. A failure on any rank (a full disk, no permission, whatever it raises) is
agreed on by every rank: the temp directory is removed, `latest` stays on the last good checkpoint and every rank
raises RunError (one after the rename, in `latest` or the pruning, removes nothing: the new checkpoint is whole,
and the RunError says so). A crash never leaves a half-written checkpoint behind `latest`: its step_N.tmp is removed
when the run starts again (remove_interrupted, with a note in the log). With async_save the files are written by a
thread of each rank while training goes on from the host copies (`Save`), and the agreement and publication wait for
the first step at whose end no rank is still writing (a count in the step's loss all-reduce), as Megatron's async
save finalizes.

Loading: `find_resume` picks what a run continues from (resume=auto: the newest checkpoint that
verifies, whatever `latest` says, skipping corrupt ones with a note), `verify` checks every file's
sha256, `check_compatible` refuses another model, tokenizer, corpus or seed. Before the process
group exists a run checks only that the files are there (`present`); then its ranks share the hashing
(`agree_verify`: each file is read by one rank, and every rank learns any failure), so a job does
not read the whole checkpoint once per rank. A `ShardReader` gives each rank the slices its layout
(tp, pp, vpp, dp, ZeRO) needs, from the files that hold them, memory-mapped.
"""
from __future__ import annotations

import glob
import hashlib
import itertools
import json
import math
import numbers
import os
import pickle
import re
import shutil
import threading
from dataclasses import dataclass

import torch

from . import comm
from .checkpoint_dir import CheckpointError, check_dir, checkpoints_of, given, read_step, resume_path
from .config import MAX_LOSS_SCALE, ConfigError, RunError, TrainConfig, integer_keys
from .errors import CommError, first_line
from .files import VANISHED_RETRIES, atomic_write, kept_build, sync_dir
from .optimizer import DynamicLossScaler
from .rank import DTYPES
from .tensor_parallel import ParamSpec, full_shape, shard, unshard

STEP_TMP = re.compile(r"step_\d+\.tmp(-\d+)?$")    # a save's directory until it is published (Save._make_dir)
FORMAT = 2                  # 1: one file of full tensors per pipeline stage (before 2026-11-24)
TOKENIZER = "tokenizer.model"   # the run's tokenizer, in each checkpoint written since 2026-12-06
# keys that define the model; a checkpoint resumes only into the same values (README, "Resuming")
MODEL_KEYS = ("num_layers", "hidden_size", "num_heads", "seq_len", "vocab_size", "vocab_pad_multiple",
              "ffn_mult", "ln_eps")


LAST_FORMAT_1 = "290b29e"   # the last commit that reads (and writes) checkpoints without "format": one file per stage


class OlderFormatError(CheckpointError):
    """A checkpoint of an older format: intact, but not this version's to read (resume=auto does not skip it)."""


@dataclass
class Resume:
    path: str
    meta: dict
    notes: list                 # what was skipped to get here, for the log
    skipped: tuple = ()         # newer checkpoints that failed verification
    superseded: tuple = ()      # newer checkpoints of the run directory that a resume=PATH branches away from


def remove_interrupted(run_dir: str) -> list:
    """Remove the step_N.tmp (and step_N.tmp-K: Save._make_dir) directories of `run_dir`: the files of saves that a
    crash or a kill interrupted, never published (resume=auto passes over them: no meta.json, no step_N name); call
    at a start, when no save is in flight. Returns notes; one that cannot be removed (EBUSY on NFS, while a process
    of the killed job still holds a file) is a note too, not a failed start: it is no part of any checkpoint (nor
    does it stop the save of its step: Save._make_dir)."""
    notes = []
    leftovers = glob.glob(os.path.join(run_dir, "checkpoints", "step_*.tmp*"))
    for path in sorted(p for p in leftovers if STEP_TMP.search(p)):
        what = f"{path}, the partial files of a save that a crash interrupted"
        try:
            shutil.rmtree(path)
            notes.append(f"removed {what}")
        except OSError as e:
            notes.append(f"could not remove {what} ({describe(e)}): remove it by hand")
    return notes


def set_aside(resume: Resume) -> list:
    """Rename the checkpoints that failed verification to step_N.corrupt, and those of a history the run
    branches away from to step_N.superseded (step_N.superseded-2, -3, ... when an earlier one has that name: a
    second branch back past step N), so that no later resume=auto or pruning counts them (call once every rank
    has chosen what to resume from); nothing is deleted. Returns notes."""
    notes = []
    for paths, suffix in ((resume.skipped, ".corrupt"), (resume.superseded, ".superseded")):
        for path in paths:
            aside, k = path + suffix, 1
            while os.path.lexists(aside):
                k += 1
                aside = f"{path}{suffix}-{k}"
            os.replace(path, aside)
            notes.append(f"moved {path} aside to {aside}")
    return notes


# ----------------------------------------------------------------------------- files
def _read_latest(root: str) -> str | None:
    """The checkpoint name in `root`/latest, or None when there is no such file or it cannot be read (it is advice
    only: resume=auto takes the newest checkpoint that verifies; bytes that are not UTF-8 are read as U+FFFD)."""
    try:
        with open(os.path.join(root, "latest"), errors="replace") as f:
            return f.read().strip()
    except OSError:                 # (missing; a directory; a permission)
        return None


def sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


class _Writer:
    """A file for torch.save that hashes what it writes (a save does not read its files back to hash them) and
    keeps the OSError of a failed write (a full disk, a file size limit): torch reports only its own
    RuntimeError ("unexpected pos ...") for it."""

    def __init__(self, f):
        self.f, self.error, self.digest = f, None, hashlib.sha256()

    def write(self, data):
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.digest.update(data)
        return n

    def flush(self):
        self.f.flush()


def _save_file(obj, path: str) -> str:
    """torch.save to `path` (bytes: written as they are, the tokenizer's file), flushed to disk; returns its
    sha256."""
    with open(path, "wb") as f:
        writer = _Writer(f)
        try:
            writer.write(obj) if isinstance(obj, bytes) else torch.save(obj, writer)
        except RuntimeError:
            if writer.error:
                raise writer.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
    return writer.digest.hexdigest()


def read_meta(path: str) -> dict:
    with open(os.path.join(path, "meta.json")) as f:
        return json.load(f)


def _is_milestone(path: str) -> bool:
    """Whether the checkpoint `path` was saved as a milestone (keep_checkpoint_interval), never to be pruned."""
    try:
        return read_meta(path).get("milestone") is True
    except (OSError, ValueError, AttributeError):
        return False


def verify(path: str, share: tuple = (0, 1), key: str | None = None) -> dict:
    """meta.json of the checkpoint `path` (of config `key`, if any: resume, init_from; its messages name it, given),
    once every file it lists exists and, of those, files share[0], share[0] + share[1], ... (sorted by name) have their
    recorded sha256: rank r of a job of n hashes its 1/n of the bytes (agree_verify); share=(0, 0) hashes none, (0, 1)
    all."""
    check_dir(path, key)
    if not os.path.isfile(os.path.join(path, "meta.json")):
        raise CheckpointError(f"{given(path, key)} is not a checkpoint (no meta.json); a checkpoint directory looks "
                              f"like runs/NAME/checkpoints/step_000100.")
    try:
        meta = read_meta(path)
        files = meta["files"]
        assert isinstance(files, dict) and files
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise CheckpointError(f"{path}/meta.json is unreadable or has no file checksums.") from None
    if "format" not in meta and "model_pp00.pt" in files:
        raise OlderFormatError(f"{path} was written by an older megatron_mini (one file of full tensors per pipeline "
                              f"stage), which this version does not read; the last version that reads it is commit "
                              f"{LAST_FORMAT_1} (2026-11-24): continue, sample or export it there.")
    lacks = _meta_lacks(meta)
    if lacks:
        raise CheckpointError(f"{path}/meta.json has no {lacks} (not a megatron_mini checkpoint, or a damaged one).")
    ShardReader(path, meta)             # (its index: JSON only, no file is opened)
    for name in files:
        if not os.path.isfile(os.path.join(path, name)):
            raise CheckpointError(f"{os.path.join(path, name)} is missing (an incomplete checkpoint).")
    rank, ranks = share
    for name, digest in sorted(files.items())[rank::ranks] if ranks else ():
        try:
            actual = sha256_file(os.path.join(path, name))
        except OSError as e:             # (a CheckpointError, so that every rank of agree_verify hears of it)
            raise CheckpointError(f"{os.path.join(path, name)} cannot be read ({e.strerror or e}).") from None
        if actual != digest:
            raise CheckpointError(f"{os.path.join(path, name)} does not match its sha256 in meta.json (a corrupt "
                                  f"checkpoint).")
    return meta


def _meta_lacks(meta: dict) -> str | None:
    """What of the keys training and inference read a meta.json lacks (or holds with the wrong type: JSON's true is
    no count, nor 2.0 a number of layers)."""
    config = meta.get("config")
    model = config.get("model") if isinstance(config, dict) else None
    data = config.get("data") if isinstance(config, dict) else None
    saved = meta.get("data", {})
    optimizer = meta.get("optimizer") if isinstance(meta.get("optimizer"), dict) else {}
    for what, ok in (("step (a count)", _count(meta.get("step"))),
                     ("consumed_samples (a count)", _count(meta.get("consumed_samples"))),
                     ("config", isinstance(config, dict)), ("config.model", isinstance(model, dict)),
                     ("config.seed", isinstance(config, dict) and "seed" in config),
                     ("config.precision.dtype (fp32, bf16 or fp16)", isinstance(config, dict)
                      and isinstance(config.get("precision"), dict) and config["precision"].get("dtype") in DTYPES),
                     ("config.data.val_fraction", isinstance(data, dict) and "val_fraction" in data),
                     ("data (a mapping)", isinstance(saved, dict)),
                     (f"format {FORMAT}", meta.get("format") == FORMAT),
                     ("optimizer.step_count (a count)", _count(optimizer.get("step_count"))),
                     ("optimizer.scaler (null, or the fp16 loss scaler's state)",
                      "scaler" in optimizer and isinstance(optimizer["scaler"], (dict, type(None)))),
                     ("data.tokenizer_sha256 (a string)", not isinstance(saved, dict)
                      or isinstance(saved.get("tokenizer_sha256"), (str, type(None))))):
        if not ok:
            return what
    lacks = _scaler_lacks(optimizer["scaler"]) if optimizer["scaler"] is not None else None
    if lacks:
        return lacks
    integers = integer_keys()           # (init_from compares seq_len: 16 < "32" raised)
    missing = [f"config.model.{k}" + ((" (an integer)" if f"model.{k}" in integers else " (a number)") * (k in model))
               for k in MODEL_KEYS if not _number(model.get(k), f"model.{k}" in integers)]
    return ", ".join(missing) or None


def _count(value) -> bool:
    """An int >= 0, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value, integer: bool) -> bool:
    """A finite number (an int where `integer`), not a bool."""
    return not isinstance(value, bool) and isinstance(value, int if integer else numbers.Real) and (
        isinstance(value, int) or math.isfinite(value))        # (an int of any size is finite)


def _scaler_lacks(scaler: dict) -> str | None:
    """What of the fp16 loss scaler's state (optimizer.DynamicLossScaler.state_dict) `scaler` lacks or holds with the
    wrong type: resumed, a scale of "65536" was a TypeError at the first step, and one of NaN skipped every step
    without end (NaN is never at the minimum scale: max_skips_at_min_scale never stopped it). skips_at_min and
    skipped_steps may be absent (checkpoints written before they were kept)."""
    scale = scaler.get("scale")
    for key, what, ok in (("scale", "a number in (0, 2**64]", _number(scale, False) and 0 < scale <= MAX_LOSS_SCALE),
                          ("clean_steps", "a count", _count(scaler.get("clean_steps"))),
                          ("hysteresis_left", "an integer", _number(scaler.get("hysteresis_left"), True)),
                          ("skips_at_min", "a count", _count(scaler.get("skips_at_min", 0))),
                          ("skipped_steps", "a count", _count(scaler.get("skipped_steps", 0)))):
        if not ok:
            return f"optimizer.scaler.{key} ({what})"
    return None


def present(path: str, key: str | None = None) -> dict:
    """verify() without the sha256: meta.json, once every file it lists exists."""
    return verify(path, share=(0, 0), key=key)


class agree_verify:
    """verify() for a job: each rank hashes its share of the files, and every rank raises the first
    failure any rank found (one file read once in the job, not once per rank). Its `listing` of a run directory
    is rank 0's on every rank: a directory that a live job writes (init_from, resume=PATH of another run's) may
    list otherwise on each rank, and ranks walking different lists would make different collectives (one
    check each) and choose different checkpoints; walking one, they agree on each check, so on the choice."""

    def __init__(self, mesh, device):
        self.mesh, self.device = mesh, device

    def __call__(self, path: str, key: str | None = None) -> dict:
        failure = None
        try:
            meta = verify(path, share=(self.mesh.rank, self.mesh.world_size), key=key)
        except CheckpointError as e:
            failure = str(e)
        found = first_failure(failure, self.mesh, self.device)
        if found:
            raise CheckpointError(found[1])
        return meta

    def listing(self, run_dir: str) -> tuple[list, str | None]:
        group = self.mesh.world_group
        return tuple(json.loads(first_text(json.dumps(listing(run_dir)) if group.rank == 0 else "", group,
                                           self.device)))

    def is_run_dir(self, path: str) -> bool:
        """is_run_dir(path) as rank 0 sees it: a checkpoint that a live run is pruning (or each node's own copy) may
        look like a run directory to one rank alone, which would walk a listing while the others verify."""
        group = self.mesh.world_group
        return first_text(str(is_run_dir(path)) if group.rank == 0 else "", group, self.device) == "True"


def listing(run_dir: str) -> tuple[list, str | None]:
    """(checkpoints_of(run_dir), the name its checkpoints/latest gives, or None)."""
    return checkpoints_of(run_dir), _read_latest(os.path.join(run_dir, "checkpoints"))


def newest(run_dir: str, check=verify, advice: str = "Resume from one by hand (resume=PATH), or start a new run under "
                                                     "another run_name.", key: str | None = None) -> Resume | None:
    """The newest checkpoint of `run_dir` that passes `check` (verify, present or agree_verify: the job's ranks walk
    its listing, rank 0's), whatever `latest` says, with notes on what was skipped; None when the run has no
    checkpoint; CheckpointError when it has some but none is good, OlderFormatError at the first of an older format
    (not skipped: the run is intact, for the version that wrote it). Where none verified and the listing has
    changed meanwhile (a live run published a newer one and pruned those listed: keep_checkpoints), it is listed
    again, up to VANISHED_RETRIES times. `key`: the config key `run_dir` was given to (resume), which errors name."""
    see = getattr(check, "listing", listing)
    for attempt in range(VANISHED_RETRIES):
        candidates, named = see(run_dir)
        found, notes = _first_good(candidates, named, check)
        if found is not None or attempt == VANISHED_RETRIES - 1 or see(run_dir)[0] == candidates:
            break
    if found is None and candidates:
        raise CheckpointError(f"{given(run_dir, key)} has checkpoints but none is complete and intact "
                              f"({'; '.join(notes)}). {advice}")
    return found


def _first_good(candidates: list, named: str | None, check) -> tuple[Resume | None, list]:
    """newest()'s pass over `candidates`, newest first: (the first that passes `check`, or None; notes)."""
    notes, skipped = [], []
    for path in candidates:
        try:
            meta = check(path)
        except OlderFormatError:
            raise
        except CheckpointError as e:
            notes.append(f"skipped {path}: {str(e).rstrip('.')}")
            skipped.append(path)
            continue
        if named != os.path.basename(path):
            notes.append(f"checkpoints/latest {'names ' + repr(named) if named else 'is missing or unreadable'}; "
                         f"took the newest complete checkpoint, {path}")
        return Resume(path, meta, notes, tuple(skipped)), notes
    return None, notes


def removed(e: BaseException) -> bool:
    """Whether `e` says a file is gone: FileNotFoundError, or the RuntimeError of torch.load's mmap ("unable to open
    file <...>: No such file or directory"). After a verification, a checkpoint that its live run pruned."""
    return isinstance(e, FileNotFoundError) or (isinstance(e, RuntimeError) and "No such file" in str(e))


def unreadable(e: BaseException) -> bool:
    """Whether `e` is the machine failing to read a checkpoint's file, not what the file holds: an OSError (EIO,
    EACCES, ...), a MemoryError, or torch's RuntimeError for either (its memory map: "unable to open file <...>",
    "unable to mmap ..."; its CPU allocator: "DefaultCPUAllocator: can't allocate memory")."""
    return isinstance(e, (OSError, MemoryError)) or isinstance(e, RuntimeError) and (
        str(e).startswith(("unable to open file", "unable to mmap")) or "can't allocate memory" in str(e))


class NotTheTensors(Exception):
    """A checkpoint file that verifies but does not hold what its meta.json lists (other code's, or one put together
    by hand), or a checkpoint whose tensors are not this run's model's (another model's, older code's): raised where
    ShardReader finds it, saying what it found; load and inference.read_checkpoint say it in one line. Any other
    exception while reading is the machine's (unreadable, removed) or a bug."""


# what torch.load raises for a file that is not one torch.save wrote, or one damaged after (a sha256 put beside it by
# hand): a byte flipped anywhere raised each of these (besides the failures of the machine: unreadable, removed)
NOT_A_TORCH_FILE = (RuntimeError, pickle.UnpicklingError, EOFError, LookupError, ValueError)


def is_run_dir(path: str) -> bool:
    """A directory without meta.json: a run directory (chosen() reads its newest intact checkpoint)."""
    return os.path.isdir(path) and not os.path.isfile(os.path.join(path, "meta.json"))


def chosen(path: str, check=verify, key: str | None = None) -> Resume:
    """The checkpoint directory `path` (its meta passing `check`), or a run directory's newest intact checkpoint
    (newest: its notes say what it passed over); CheckpointError for neither, naming config `key` where `path` is its
    value (resume, init_from; none: a tool's argument). Which of the two `path` is, is rank 0's answer where `check`
    is a job's (agree_verify)."""
    if getattr(check, "is_run_dir", is_run_dir)(path):
        found = newest(path, check, "Give another checkpoint, or run directory.", key)  # (a tool's, another run's)
        if found is None:
            raise CheckpointError(f"{given(path, key)} is not a checkpoint (no meta.json) nor a run directory with "
                                  f"checkpoints; give a checkpoint directory such as "
                                  f"runs/NAME/checkpoints/step_000100, or a run directory (its newest intact "
                                  f"checkpoint)")
        return found
    return Resume(path, check(path, key=key), [])


# ----------------------------------------------------------------------------- resuming
def find_resume(cfg: TrainConfig, check=verify) -> Resume | None:
    """What this run continues from, by cfg.resume: auto (the run's newest checkpoint that passes `check`,
    or none), never (a fresh run, in a run directory without checkpoints), or a PATH (checkpoint.chosen: a
    checkpoint directory, or a run directory's newest intact checkpoint). The run directory's own checkpoints
    newer than it are superseded (a rollback); the corrupt ones passed over are set aside only there (another
    run's directory is read, never changed)."""
    if cfg.resume == "never":
        existing = checkpoints_of(cfg.run_dir)
        if existing:
            raise ConfigError(f"resume=never, but {cfg.run_dir} already holds checkpoints (newest: {existing[0]}), "
                              f"which a new run would overwrite. Continue that run with resume=auto, or start the new "
                              f"one under another run_name.")
        return None
    if cfg.resume == "auto":
        return newest(cfg.run_dir, check)
    found = chosen(resume_path(cfg.resume), check, "resume")
    own = {os.path.realpath(p): p for p in checkpoints_of(cfg.run_dir)}
    skipped = tuple(own[os.path.realpath(p)] for p in found.skipped if os.path.realpath(p) in own)
    later = tuple(p for p in own.values() if read_step(p) > found.meta["step"] and p not in skipped)
    return Resume(found.path, found.meta, found.notes, skipped, superseded=later)


def model_changes(meta: dict, cfg: TrainConfig) -> list:
    """'model.KEY: old -> new' for each of MODEL_KEYS in which cfg's model differs from the checkpoint's."""
    old = meta["config"]["model"]
    return [f"model.{key}: {old[key]} -> {getattr(cfg.model, key)}" for key in MODEL_KEYS
            if old[key] != getattr(cfg.model, key)]


POSITIONS = "embedding.position_embeddings"     # [seq_len, h]: init_from's shorter seq_len reads its first rows


def init_changes(meta: dict, cfg: TrainConfig) -> tuple[list, list]:
    """(the model_changes that init_from cannot start from, notes on those it can): a shorter model.seq_len is this
    model, the first rows of its learned position embeddings (nanoGPT's crop_block_size); a longer one is not
    (positions past the checkpoint's have no trained embedding)."""
    was, now = meta["config"]["model"]["seq_len"], cfg.model.seq_len
    changes = []
    for change in model_changes(meta, cfg):
        if change.startswith("model.seq_len:"):
            if now < was:
                continue
            change += f" (its learned position embeddings end at {was}: a seq_len up to {was} starts from their " \
                      f"first rows)"
        changes.append(change)
    return changes, [f"model.seq_len {was} -> {now}: the first {now} rows of its position embeddings"] * (now < was)


def check_init(cfg: TrainConfig, tokenizer_sha256: str, check=verify) -> Resume:
    """cfg.init_from as a checkpoint (passing `check`; a run directory's newest: chosen), checked by init_of."""
    return init_of(cfg, chosen(cfg.init_from, check, "init_from"), tokenizer_sha256)


def init_of(cfg: TrainConfig, found: Resume, tokenizer_sha256: str) -> Resume:
    """`found` as cfg.init_from's checkpoint: of this run's model (init_changes: its notes are the Resume's), trained
    with this run's tokenizer (`tokenizer_sha256`: a token id must mean the same text); one ConfigError naming what
    differs."""
    meta = found.meta
    diffs, notes = init_changes(meta, cfg)
    if diffs:
        raise ConfigError(f"init_from={cfg.init_from} holds another model than this run asks for: {'; '.join(diffs)}. "
                          f"Set these back (init_from starts from its weights).")
    saved = meta.get("data", {}).get("tokenizer_sha256")
    if saved and saved != tokenizer_sha256:
        its = os.path.join(found.path, TOKENIZER) if TOKENIZER in meta["files"] else \
            "<its run's data.dir>/tokenizer.model"                  # (its own copy, or an older checkpoint's source)
        raise ConfigError(f"init_from={cfg.init_from} was trained with another tokenizer (sha256 {saved[:12]}; this "
                          f"run's {'data.blend' if cfg.data.blend else 'data.dir'}={cfg.data.parts()[0][1]} has "
                          f"{tokenizer_sha256[:12]}), so its token ids mean other "
                          f"text: prepare this run's corpus with data.tokenizer={its}, or start from the seed's "
                          f"weights.")
    return Resume(found.path, meta, found.notes + notes)


def check_compatible(resume: Resume, cfg: TrainConfig, data: dict) -> None:
    """Refuse a checkpoint of another model, tokenizer, corpus, seed or validation split, listing
    every differing key as old -> new. The layout, batch, schedule, optimizer, precision and
    bookkeeping may change (README, "Resuming")."""
    old, diffs = resume.meta["config"], model_changes(resume.meta, cfg)
    for key, new in (("seed", cfg.seed), ("data.val_fraction", cfg.data.val_fraction)):
        was = old["seed"] if key == "seed" else old["data"]["val_fraction"]
        if was != new:
            diffs.append(f"{key}: {was} -> {new} (it draws the train/validation split)")
    saved = resume.meta.get("data", {})
    startable = not init_changes(resume.meta, cfg)[0] and saved.get("tokenizer_sha256") in (
        None, data.get("tokenizer_sha256"))                              # (check_init: another seed and data may be)
    blends = (saved.get("blend"), data.get("blend"))      # (how a blend's shares and directories read; none: data.dir)
    mixture = ("corpus_sha256", "num_tokens", "tokens_fingerprint") if any(blends) and saved.get("corpus_sha256") != \
        data.get("corpus_sha256") else ()           # (its shares and corpora: a directory's spelling may change)
    if mixture:
        diffs.append("data.blend: " + " -> ".join(str(b or "data.dir") for b in blends))
    for key, new in data.items():          # (a key the checkpoint lacks, or this version does not know: not compared)
        if key in saved and saved[key] != new and key not in ("blend", "eval", *mixture):
            diffs.append(f"data {key}: {str(saved[key])[:16]} -> {str(new)[:16]}")
    if diffs:
        weights = f" (init_from={resume.path} starts it from these weights)" if startable else ""
        kept = kept_build(cfg.data.dir, saved["corpus_sha256"]) if not any(blends) and \
            saved.get("corpus_sha256") not in (None, data.get("corpus_sha256")) else None
        kept = f" (data.dir={kept} holds the build it was trained on)" if kept else ""
        raise ConfigError(f"{resume.path} was trained with another model or data than this run asks for: "
                          f"{'; '.join(diffs)}{kept}. Set these back, or start a new run under another "
                          f"run_name{weights}.")


def evaluation_changes(meta: dict, data: dict, cfg: TrainConfig) -> list:
    """Notes on what a resume evaluates otherwise than the checkpoint's run, whose losses then change meaning at
    the resume: another number of samples (eval_iters x gbs: each evaluation reads the first that many of each set),
    and data.eval sets (dataset.data_identity's "eval") that hold another corpus."""
    saved, now = (meta.get("data") or {}).get("eval") or {}, data.get("eval") or {}
    was = meta["config"].get("eval_iters", cfg.eval_iters) * meta["config"].get("gbs", cfg.gbs)
    read = cfg.eval_iters * cfg.gbs
    samples = [f"evaluation: eval_iters x gbs = {cfg.eval_iters} x {cfg.gbs} = {read} samples of each set, "
               f"{was} up to step {meta['step']}: its val_loss (and eval_loss) from here on is the mean of another "
               f"sample, not comparable with before"] if cfg.eval_interval and was != read else []
    return samples + [f"data.eval: {d} holds another corpus (sha256 {str(sha)[:12]}) than the one evaluated up to "
                      f"step {meta['step']} ({str(saved[d])[:12]}): its eval_loss/{d} from here on is not comparable "
                      f"with before" for d, sha in now.items() if d in saved and saved[d] != sha]


SCALER_KEYS = ("initial_loss_scale", "loss_scale_growth_factor", "loss_scale_growth_interval",
               "loss_scale_backoff_factor", "loss_scale_hysteresis", "min_loss_scale")


def _exact(value) -> str:
    """A number exactly, as a command line gives it: 65536 for 65536.0 or 2**16 (:g's 6 digits wrote 2**20 as
    1.04858e+06), else its shortest repr (0.5)."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def loss_scaler_changes(meta: dict, cfg: TrainConfig) -> list:
    """A note where a resume that continues the checkpoint's fp16 loss scaler (optimizer.DynamicLossScaler: its
    scale and counters, as Megatron's does) is given other precision.* scaler settings than the run that saved it:
    initial_loss_scale is not applied (the scale is the checkpoint's); the others act from here on, on its scale
    and counters (a min_loss_scale above its scale: the scale starts below it, and a back-off raises it to it)."""
    state, saved = (meta.get("optimizer") or {}).get("scaler"), meta["config"].get("precision") or {}
    if cfg.precision.dtype != "fp16" or not state or saved.get("dtype") != "fp16":
        return []
    changed = {k: (saved[k], getattr(cfg.precision, k)) for k in SCALER_KEYS
               if _number(saved.get(k), False) and saved[k] != getattr(cfg.precision, k)}
    if not changed:
        return []
    initial = changed.pop("initial_loss_scale", None)
    parts = [f"precision.initial_loss_scale={_exact(initial[1])} is not applied ({_exact(initial[0])} when "
             f"saved)"] if initial else []
    resumed = DynamicLossScaler(cfg.precision)        # (as the resume loads it: a lower hysteresis caps its count)
    resumed.load_state_dict(state)
    if changed:
        below = "; the scale starts below the new min_loss_scale (a back-off raises it to it)" \
            if resumed.scale < resumed.min_scale else ""
        parts.append(", ".join(f"precision.{k}: {_exact(old)} -> {_exact(new)}"
                               for k, (old, new) in changed.items()) +
                     f" act{'s' * (len(changed) == 1)} from here on, on its counters (clean_steps "
                     f"{resumed.clean_steps}, hysteresis_left {resumed.hysteresis_left}){below}")
    return [f"the fp16 loss scale continues from the checkpoint's {_exact(resumed.scale)} (its scaler's state is "
            f"resumed, as Megatron's is): {'; '.join(parts)}"]


# ----------------------------------------------------------------------------- saving
def gather_text(text: str, group, device, to_first: bool = False) -> list | None:
    """Every rank's `text` (UTF-8, no trailing NUL) of `group` (a comm.Group), in group order, on every rank; with
    `to_first` on the group's first rank only (None on the others): an all-reduce of the longest length, then a
    gather of the rows padded to it with NULs."""
    data = text.encode()
    width = torch.tensor([len(data)], device=device)
    comm.all_reduce(width, group, op=torch.distributed.ReduceOp.MAX)
    row = torch.zeros(max(int(width), 1), dtype=torch.uint8)
    row[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else 0
    rows = comm.gather(row.to(device), group) if to_first else comm.all_gather(row.to(device)[None], group)
    if rows is None:
        return None
    return [r.tobytes().rstrip(b"\0").decode(errors="replace") for r in rows.cpu().numpy()]


def first_text(text: str, group, device) -> str:
    """The `text` of `group`'s first rank, on every rank: a broadcast of its UTF-8 length, then of its bytes."""
    data = text.encode() if group.rank == 0 else b""
    width = torch.tensor([len(data)], device=device)
    comm.broadcast(width, group)
    row = torch.zeros(max(int(width), 1), dtype=torch.uint8)
    row[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else 0
    row = row.to(device)
    comm.broadcast(row, group)
    return row.cpu().numpy()[:int(width)].tobytes().decode()


def agree_on_files(path: str, mesh, device) -> None:
    """CheckpointError on every rank where the ranks read different files at the checkpoint `path` that they chose
    together (its meta.json, which holds the sha256 of every other file, differs): each node's own copy, on a disk
    of its own; each rank verifies its share against its own meta.json, so copies that differ pass."""
    differ = unlike_rank_0(gather_text(_meta_sha256(path), mesh.world_group, device))
    if differ:
        raise CheckpointError(f"{ranks_text(differ)} read another checkpoint at {path} than rank 0 (its meta.json "
                              f"differs): the nodes see different files at that path (each its own copy, on a "
                              f"node-local disk); start from a path that every node shares.")


def unlike_rank_0(values: list) -> list:
    """The ranks whose value (of `values`, one per rank) is not rank 0's."""
    return [r for r, value in enumerate(values) if value != values[0]]


def ranks_text(ranks: list) -> str:
    """'rank 3' or 'ranks 3, 5' (the first 8 of `ranks`)."""
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks[:8]))}"


def _meta_sha256(path: str) -> str:
    """The sha256 of the checkpoint `path`'s meta.json ("-" where there is none to read)."""
    try:
        return sha256_file(os.path.join(path, "meta.json"))
    except OSError:
        return "-"


def first_failure(failure: str | None, mesh, device) -> tuple[int, str] | None:
    """(rank, message) of the first rank whose `failure` is not None, the same on every rank; None when
    no rank failed."""
    return next(((r, text) for r, text in enumerate(gather_text(failure or "", mesh.world_group, device)) if text),
                None)


def failure_of(fn, *args) -> str | None:
    """None, or how `fn` failed: a full disk, a permission, torch's stream writer, or anything else one rank
    meets that the others, waiting in the next collective, must hear of."""
    try:
        fn(*args)
        return None
    except Exception as e:      # noqa: BLE001 - reported to every rank (save's check), not swallowed
        return describe(e)


def describe(e: Exception) -> str:
    """`Type: message` of an exception, on one line, at most 300 characters of the message (`Type` without one: a
    MemoryError)."""
    text = " ".join(str(e).split())[:300]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


PUBLISHED = "published, then "   # (a failure of rank 0's once the rename has published the checkpoint whole)


class Save:
    """One checkpoint `path` (step_N) of every rank's state being written; see the module doc. The constructor
    copies this rank's slices to the host (the snapshot: training may go on at once) and writes its files,
    in a thread when `background`; `finish` (every rank, once `writing` is false everywhere or to wait for it)
    agrees on the outcome, and rank 0 publishes it."""

    def __init__(self, path: str, progress: dict, buffers: list, optimizer, mesh, config: dict, data: dict,
                 keep: int, background: bool = False, milestones: int = 0, tokenizer: bytes | None = None):
        """`progress`: the run's counters, into meta.json ({step, consumed_samples, loss, evaluation_owed}); the
        newest `keep` checkpoints are kept, and milestones: this one is when its step is a multiple of `milestones`
        (> 0), which meta.json records, so that a run resumed with another keep_checkpoint_interval keeps it too.
        `tokenizer`: the run's tokenizer.model (its bytes), which rank 0 writes beside the weights (TOKENIZER): the
        checkpoint's tools read it whatever became of the data directory, and a copied checkpoint carries it."""
        self.path, self.mesh, self.device = path, mesh, buffers[0].grads_flat.device
        self.last_good = _read_latest(os.path.dirname(path)) or "none"
        self.meta = {"format": FORMAT, **progress,
                     "world_size": mesh.world_size, "layout": {"tp": mesh.tp, "pp": mesh.pp, "dp": mesh.dp},
                     "config": config, "data": data, "optimizer": optimizer.counters()}
        if milestones and progress["step"] % milestones == 0:
            self.meta["milestone"] = True
        self.keep, self.index, self.tensors, self.digests, self.files = keep, {}, {}, {}, {}
        self.tokenizer = tokenizer
        self.tmp = None         # rank 0 makes it and names it to the others (once it exists: a broadcast it joins then)
        made = json.loads(first_text(json.dumps(self._made()) if mesh.rank == 0 else "", mesh.world_group,
                                     self.device))
        self.tmp = made["tmp"]
        self._fail((0, made["failure"]) if made["failure"] else None, "creating its directory")
        self.failure = failure_of(self._copy, buffers, optimizer)   # (host copies: an OOM is a failure as a full disk)
        self.thread = None
        if background and self.failure is None:
            self.thread = threading.Thread(target=self._write, name=f"save {os.path.basename(path)}", daemon=True)
            self.thread.start()
        elif self.failure is None:
            self._write()

    def _made(self) -> dict:
        """(rank 0) {"tmp": the new directory for this save's files (None when it could not be made), "failure": why
        not, or None}."""
        failure = failure_of(self._make_dir)
        return {"tmp": self.tmp if failure is None else None, "failure": failure}

    def _make_dir(self) -> None:
        """Make a new, empty self.tmp: step_N.tmp; where what an interrupted save of step N left there cannot be
        removed (remove_interrupted only noted it: EBUSY on NFS while a process of the killed job still holds a
        file), step_N.tmp-2, -3, ... (it is no part of any checkpoint: the save goes on beside it, published as
        step_N by a rename all the same)."""
        for k in itertools.count(1):
            self.tmp = self.path + ".tmp" + (f"-{k}" if k > 1 else "")
            shutil.rmtree(self.tmp, ignore_errors=True)
            try:
                os.makedirs(self.tmp)
                return
            except FileExistsError:
                continue

    def _copy(self, buffers: list, optimizer) -> None:
        """This rank's weights and optimizer state, copied to the host, and its part of meta.json's index."""
        mesh = self.mesh
        where = f"pp{mesh.pp_rank:02d}_tp{mesh.tp_rank:02d}"
        weights = {name: t for buf in buffers for name, t in buf.saved_weights().items()}
        state = optimizer.saved_state()
        if weights:
            self.files[f"model_{where}.pt"] = weights
            self.index[f"model_{where}.pt"] = {"pp": mesh.pp_rank, "tp": mesh.tp_rank, "weights": sorted(weights)}
        if state:
            name = f"optim_{where}_dp{mesh.dp_rank:02d}.pt"
            self.files[name] = {n: saved for n, (_, saved) in state.items()}
            self.index[name] = {"pp": mesh.pp_rank, "tp": mesh.tp_rank,
                                "ranges": {n: r for n, (r, _) in state.items()}}
        self.tensors = {name: [list(full_shape(p, mesh.tp)), p.spec.tp_dim, p.spec.tp_groups]
                        for buf in buffers for p, name in buf.names.items() if name in weights}
        if mesh.rank == 0 and self.tokenizer is not None:
            self.files[TOKENIZER] = self.tokenizer

    def _write(self) -> None:
        """The files, hashed as they are written (no collective: it may run in a thread); the host copies are
        freed as each file is done (the rest when one fails)."""
        self.failure = failure_of(self._write_files)
        self.files = {}

    def _write_files(self) -> None:
        while self.files:
            name = next(iter(self.files))
            self.digests[name] = _save_file(self.files.pop(name), os.path.join(self.tmp, name))

    @property
    def writing(self) -> bool:
        """Whether this rank's files are still being written (by its thread)."""
        return self.thread is not None and self.thread.is_alive()

    def _check(self, failure: str | None, what: str) -> None:
        """Every rank raises RunError when any rank's `failure` is not None."""
        self._fail(first_failure(failure, self.mesh, self.device), what)

    def _fail(self, found: tuple[int, str] | None, what: str) -> None:
        """RunError for `found` (the first failed rank and its failure, the same on every rank), if any; rank 0
        removes the save's directory."""
        if found is None:
            return
        first, why = found
        if self.mesh.rank == 0 and self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        latest = "Its partial files were removed; checkpoints/latest" if self.tmp is not None else \
            "Checkpoints/latest"                # (its directory was not made: no file of it was written)
        raise RunError(f"Saving checkpoint {self.path} failed on rank {first} while {what}: {why}. {latest} still "
                       f"names the last good checkpoint ({self.last_good}).", reporter=first)

    def finish(self) -> str:
        """Wait for this rank's files, agree on every rank's, gather the index onto rank 0, which writes
        meta.json, renames step_N.tmp to step_N, names it in `latest` and prunes; returns the path."""
        if self.thread is not None:
            self.thread.join()
        self._check(self.failure, "writing its files")
        gathered = gather_text(json.dumps({"files": self.digests, "shards": self.index, "tensors": self.tensors}),
                               self.mesh.world_group, self.device, to_first=True)    # (O(ranks) bytes, not ^2)
        found = first_failure(self._publish_all(gathered) if self.mesh.rank == 0 else None, self.mesh, self.device)
        if found is not None and found[1].startswith(PUBLISHED):      # (whole, and a resume takes it: nothing removed)
            raise RunError(f"Checkpoint {self.path} was saved whole (resume=auto takes it: the newest that verifies, "
                           f"whatever checkpoints/latest says), but rank 0 then failed while naming it in "
                           f"checkpoints/latest and removing older checkpoints: {found[1][len(PUBLISHED):]}.",
                           reporter=0)
        self._fail(found, "publishing it")
        return self.path

    def _publish_all(self, gathered: list) -> str | None:
        """(rank 0) _publish, then _name_latest: None, or how it failed (PUBLISHED + how, once _publish was done)."""
        failure = failure_of(self._publish, gathered)
        if failure is None and (failure := failure_of(self._name_latest)) is not None:
            failure = PUBLISHED + failure
        return failure

    def _publish(self, gathered: list) -> None:
        """(rank 0) meta.json, then the rename of step_N.tmp to step_N, which publishes the checkpoint whole; each
        directory synced (the files' names in step_N.tmp before the rename, the rename itself after it), so that
        a power cut cannot leave older checkpoints pruned and this one's rename or files lost."""
        parts = [json.loads(text) for text in gathered]
        meta = {**self.meta, **{key: dict(sorted(kv for part in parts for kv in part[key].items()))
                                for key in ("files", "shards", "tensors")}}
        atomic_write(os.path.join(self.tmp, "meta.json"), json.dumps(meta, indent=1))
        sync_dir(self.tmp)
        shutil.rmtree(self.path, ignore_errors=True)
        os.replace(self.tmp, self.path)
        sync_dir(os.path.dirname(self.path))

    def _name_latest(self) -> None:
        """(rank 0) `latest` names the published checkpoint; all but the newest `keep` (and milestones) removed."""
        root = os.path.dirname(self.path)
        atomic_write(os.path.join(root, "latest"), os.path.basename(self.path))
        for old in checkpoints_of(os.path.dirname(root))[self.keep:]:
            if not _is_milestone(old):
                shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------- loading
def _load_mapped(f: str) -> dict:
    """A checkpoint file's tensors, memory-mapped: a rank reads the pages of the slices it copies out, and
    the ranks of a node share one page cache."""
    return torch.load(f, weights_only=True, map_location="cpu", mmap=True)


class ShardReader:
    """The tensors of a checkpoint by global name, in any layout, from its files (opened as they are needed,
    memory-mapped). `key`: "weight", or one of the optimizer's "master", "exp_avg", "exp_avg_sq"."""

    def __init__(self, path: str, meta: dict, rows: dict | None = None):
        """CheckpointError if meta.json's index is malformed or leaves any value in no file. `rows` {name: n}: read
        only the first n rows of those replicated tensors (init_from's shorter seq_len: POSITIONS)."""
        self.path, self._files, self.rows = path, {}, rows or {}
        self.weights, self.pieces = {}, {}      # {name: {tp rank: file}}, {name: {tp rank: [(lo, hi, file)]}}
        try:
            self.tp = meta["layout"]["tp"]
            if not _count(self.tp) or self.tp < 1:       # (0: no slice of a split tensor would be checked, nor read)
                raise ValueError(f"layout.tp={self.tp!r} is not a positive integer")
            self.dtype = DTYPES[meta["config"]["precision"]["dtype"]]    # the weights' (the optimizer's: fp32)
            self.specs = {name: (tuple(shape), ParamSpec(tp_dim=dim, tp_groups=groups))
                          for name, (shape, dim, groups) in meta["tensors"].items()}
            for file, shard_ in meta["shards"].items():         # (each tensor is saved by one stage)
                if file not in meta["files"]:
                    raise ValueError(f"{file} has no checksum")
                for name in shard_.get("weights", ()):
                    self.weights.setdefault(name, {})[shard_["tp"]] = file
                for name, (lo, hi) in shard_.get("ranges", {}).items():
                    self.pieces.setdefault(name, {}).setdefault(shard_["tp"], []).append((lo, hi, file))
            for ranks in self.pieces.values():
                for pieces in ranks.values():
                    pieces.sort()
            for name in self.specs:
                for rank in range(self.tp if self.specs[name][1].tp_dim is not None else 1):
                    self._check_whole(name, rank)
            unknown = sorted((set(self.weights) | set(self.pieces)) - set(self.specs))
            if unknown:
                raise ValueError(f"{unknown[0]} has no shape")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{path}/meta.json: its index of the tensors is damaged ({first_line(e)}).") from None

    def _local_shape(self, name: str) -> tuple:
        """`name`'s shape on one TP rank of the saving layout."""
        shape, spec = self.specs[name]
        return tuple(n // self.tp if d == spec.tp_dim else n for d, n in enumerate(shape))

    def _check_whole(self, name: str, rank: int) -> None:
        """TP rank `rank`'s slice of `name` has a weight file, and optimizer pieces that tile it exactly."""
        if rank not in self.weights.get(name, {}):
            raise ValueError(f"no file holds TP rank {rank}'s weight of {name}")
        at = 0
        for lo, hi, _ in self.pieces.get(name, {}).get(rank, []):
            if lo != at or hi <= lo:
                break
            at = hi
        if at != math.prod(self._local_shape(name)):
            raise ValueError(f"the optimizer state of {name} (TP rank {rank}) is not whole")

    def names(self) -> list:
        return sorted(self.weights)

    def _held(self, file: str, name: str, key: str | None = None):
        """What `file` holds under `name` (under `name` then `key`: an optimizer state); NotTheTensors where torch.load
        cannot read it, or it holds no such entry."""
        if file not in self._files:
            try:
                self._files[file] = _load_mapped(os.path.join(self.path, file))
            except NOT_A_TORCH_FILE as e:
                if removed(e) or unreadable(e):
                    raise
                raise NotTheTensors(f"{file}: {first_line(e)}") from e
        held = self._files[file]
        if not isinstance(held, dict):
            raise NotTheTensors(f"{file} holds a {type(held).__name__}, not a mapping of names to tensors")
        if name not in held:
            raise NotTheTensors(f"{file} holds no {name}")
        if key is None:
            return held[name]
        if not isinstance(held[name], dict):
            raise NotTheTensors(f"{file} holds {name}'s optimizer state as a {type(held[name]).__name__}, not a "
                                "mapping")
        if key not in held[name]:
            raise NotTheTensors(f"{file} holds no {key} of {name}")
        return held[name][key]

    def saved(self, name: str, key: str, tp_rank: int) -> torch.Tensor:
        """`name`'s `key` as TP rank `tp_rank` of the saving layout held it (rank 0 for a replicated one), its
        first `rows` rows where they are asked for."""
        shape = self._local_shape(name)
        if key == "weight":
            file = self.weights[name][tp_rank]
            t = self._tensor(file, name, self._held(file, name), self.dtype, shape)
        elif key == "master" and self.dtype == torch.float32:     # fp32 weights are their own master (not saved; a
            return self.saved(name, "weight", tp_rank)              # 16-bit checkpoint without one: NotTheTensors)
        else:
            pieces = self.pieces[name][tp_rank]
            flats = [self._tensor(file, f"{name}'s {key}", self._held(file, name, key), torch.float32, (hi - lo,))
                     for lo, hi, file in pieces]
            t = (torch.cat(flats) if len(flats) > 1 else flats[0]).view(shape)
        return t[:self.rows[name]] if name in self.rows else t

    def _tensor(self, file: str, what: str, t, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        """`t`, the value `what` of `file`, once it is a tensor of `dtype` and `shape`, as a save writes it; a
        CheckpointError otherwise: copied into the model, int64 or complex values would become weights silently (a
        cast), a tensor of another shape but as many values scrambled (a view)."""
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
            found = f"{_dtype_name(t.dtype)} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise CheckpointError(f"{self.path}: its files do not hold the tensors its meta.json lists ({file}: "
                                  f"{what} is {found}, not {_dtype_name(dtype)} {list(shape)}): a damaged checkpoint, "
                                  f"or one of other code")
        return t

    def full(self, name: str, key: str = "weight") -> torch.Tensor:
        """The full (tp=1) value."""
        spec = self.specs[name][1]
        tp = 1 if spec.tp_dim is None else self.tp
        return unshard([self.saved(name, key, r) for r in range(tp)], spec)

    def local(self, name: str, key: str, param, tp: int, tp_rank: int) -> torch.Tensor:
        """The slice of it that TP rank `tp_rank` of `tp` holds in this run's `param`: the saved slice itself where
        the TP degree is the same. NotTheTensors where the checkpoint has no `name`, or one of another shape or TP
        split than `param`'s (another model's, older code's: a copy would broadcast it, or scramble it silently)."""
        if name not in self.specs:
            raise NotTheTensors(f"it has no {name}")
        shape, spec = self.specs[name]
        split, ours = (spec.tp_dim, spec.tp_groups), (param.spec.tp_dim, param.spec.tp_groups)
        if split == ours:
            t = self.saved(name, key, 0 if spec.tp_dim is None else tp_rank) if spec.tp_dim is None or tp == self.tp \
                else shard(self.full(name, key), spec, tp, tp_rank)
            if t.shape == param.shape:
                return t
        raise NotTheTensors(f"its {name} is {list(shape)} split over TP as (dim, blocks) {split}, this run's model's "
                            f"{list(full_shape(param, tp))} split as {ours}")


def _dtype_name(dtype: torch.dtype) -> str:
    """'int64' for torch.int64."""
    return str(dtype).removeprefix("torch.")


def load_model_tensors(path: str) -> dict:
    """{global name: full fp32 weight} of a checkpoint."""
    reader = ShardReader(path, read_meta(path))
    return {name: reader.full(name).float() for name in reader.names()}


BUG = "(a bug in megatron_mini, not the checkpoint's doing: that rank shows its traceback)"


def load(path: str, buffers: list, optimizer, mesh, device, weights_only: bool = False,
         seq_len: int | None = None) -> dict:
    """Restore weights and optimizer state (any layout); returns meta. (The dropout streams are keyed by
    sample and layer, rng.py: there is no RNG state to restore.) `weights_only` (init_from): the weights and
    their fp32 masters, the optimizer otherwise as new; with `seq_len`, the first seq_len rows of the position
    embeddings (check_init: no more than the checkpoint's). Tensors that do not fit this model (a name missing,
    another shape: a checkpoint of another model or of older code: NotTheTensors), and files that cannot be read
    (unreadable, removed), are one CheckpointError on every rank, whichever ranks found it. Any other exception (a
    bug) is raised as it is on its rank, with its traceback, and the others raise a RunError naming it (none waits in
    a collective until timeout_s)."""
    failure = meta = bug = None
    try:
        meta = read_meta(path)
        reader = ShardReader(path, meta, {POSITIONS: seq_len} if weights_only and seq_len else None)
        for buf in buffers:
            buf.load_weights(reader)
        optimizer.load_state_dict(reader, None if weights_only else meta["optimizer"])
    except CommError:
        raise
    except CheckpointError as e:
        failure = str(e)
    except NotTheTensors as e:
        failure = (f"{path} does not fit this run's model ({e}): a checkpoint of another model or of older code; "
                   f"resume from another checkpoint, or start a new run under another run_name.")
    except Exception as e:     # noqa: BLE001 - the machine's, or a bug: told to every rank, a bug then raised (below)
        if removed(e):              # (verified, then gone: a checkpoint its keep_checkpoints pruned)
            failure = (f"{path} could not be read after it was verified ({first_line(e)}); a checkpoint of a job "
                       f"still running may have been pruned since: start again to take what is there now.")
        elif unreadable(e):         # (the disk or the memory: not another model's checkpoint)
            failure = f"{path} could not be read ({describe(e)})."
        else:
            bug, failure = e, f"could not load {path}: {describe(e)} {BUG}"
    found = first_failure(failure, mesh, device)
    if bug is not None:
        raise bug
    if found and found[1].endswith(BUG):
        raise RunError(f"rank {found[0]} {found[1]}", reporter=found[0])
    if found:
        raise CheckpointError(found[1])
    for buf in buffers:     # ZeRO-1: each rank set its own shard from the fp32 master; the others come from theirs
        buf.start_param_gather()
        buf.finish_param_gather()
    return meta
