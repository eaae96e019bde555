"""Which directories a run starts from (resume=PATH, init_from) and a run directory's checkpoints, without torch:
train.py refuses a PATH that is no directory before it imports torch (seconds), with the line that checkpoint.verify
gives it once torch is loaded (checkpoint.find_resume, check_init and verify use these too)."""
from __future__ import annotations

import os
import re

from .errors import ConfigError

STEP_DIR = re.compile(r"step_(\d+)$")


class CheckpointError(ConfigError):
    """A checkpoint that is missing, incomplete, corrupt or not one: a one-line message."""


def resume_path(resume: str) -> str | None:
    """The directory that resume=PATH names (a checkpoint directory, or a run directory: its newest intact
    checkpoint); None for resume=auto and resume=never."""
    return None if resume in ("auto", "never") else resume


def given(path: str, key: str | None = None) -> str:
    """`path` as the user gave it: `key`=PATH for a config key (resume=PATH, init_from=PATH), else PATH (a tool's
    argument)."""
    return f"{key}={path}" if key else path


def check_dir(path: str, key: str | None = None) -> None:
    """CheckpointError unless `path` (of config `key`, if any: given) is a directory."""
    if not os.path.isdir(path):
        what = "is a file, not a checkpoint directory" if os.path.exists(path) else "no such checkpoint directory"
        raise CheckpointError(f"{given(path, key)}: {what}.")


def checkpoints_of(run_dir: str) -> list:
    """The complete-looking checkpoint directories of a run, newest first (by step)."""
    root = os.path.join(run_dir, "checkpoints")
    found = [os.path.join(root, d) for d in (os.listdir(root) if os.path.isdir(root) else [])
             if STEP_DIR.match(d) and os.path.isdir(os.path.join(root, d))]
    return sorted(found, key=read_step, reverse=True)


def read_step(path: str) -> int:
    """N of a checkpoint directory step_N."""
    return int(STEP_DIR.search(path).group(1))


def check_start_dirs(cfg, world_size: int, local_world_size: int) -> None:
    """check_dir of what the run (a TrainConfig) starts from, on every rank before torch is imported: resume=PATH,
    or init_from where the run reads it, its run directory holding no checkpoint (resume=auto: none to continue;
    resume=never: none to overwrite). A run that resumes its own checkpoints ignores init_from, so a missing one does
    not stop it (as Megatron's --pretrained-checkpoint and torchtitan's initial_load_path: a restarted fine-tuning job
    whose source was moved goes on). Only where all `world_size` ranks run on this node (`local_world_size` of them):
    they see one file system, so each refuses it alike. In a job on several nodes rank 0 alone looks
    (training.prepare_run), and its answer is every rank's: a node whose disk alone lacked PATH would end by itself here
    while the others waited for it in the rendezvous until timeout_s (every rank verifies the checkpoint chosen, so
    the job stops all the same, each rank with one line)."""
    if world_size != local_world_size:
        return
    if resume_path(cfg.resume) is not None:
        check_dir(cfg.resume, "resume")
    elif cfg.init_from and not checkpoints_of(cfg.run_dir):
        check_dir(cfg.init_from, "init_from")
