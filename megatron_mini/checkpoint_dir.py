"""Which directory a run's resume=PATH names, and whether it is there, without torch: train.py refuses a PATH that is
no directory before it imports torch (seconds), with the line that checkpoint.verify gives it once torch is loaded
(checkpoint.find_resume and verify use these too)."""
from __future__ import annotations

import os

from .errors import ConfigError


class CheckpointError(ConfigError):
    """A checkpoint that is missing, incomplete, corrupt or not one: a one-line message."""


def resume_path(resume: str) -> str | None:
    """The directory that resume=PATH names (a checkpoint directory, or a run directory: its newest intact
    checkpoint); None for resume=auto and resume=never."""
    return None if resume in ("auto", "never") else resume


def check_dir(path: str) -> None:
    """CheckpointError unless `path` is a directory."""
    if not os.path.isdir(path):
        what = "is a file, not a checkpoint directory" if os.path.exists(path) else "no such checkpoint directory"
        raise CheckpointError(f"{path}: {what}.")


def check_resume_dir(resume: str, world_size: int, local_world_size: int) -> None:
    """check_dir of resume=PATH, on every rank before torch is imported, where all `world_size` ranks run on this
    node (`local_world_size` of them): they see one file system, so each refuses it alike. In a job on several nodes
    rank 0 alone looks (training.prepare_run), and its answer is every rank's: a node whose disk alone lacked PATH
    would end by itself here while the others waited for it in the rendezvous until timeout_s (every rank verifies
    the checkpoint chosen, so the job stops all the same, each rank with one line)."""
    path = resume_path(resume)
    if path is not None and world_size == local_world_size:
        check_dir(path)
