"""Files that a crash leaves whole: the old content or the new, never part of either; where files can be
written (a directory that exists or can be created, and is writable), and the empty directories a refused
run made taken away again."""
from __future__ import annotations

import os


def write_target(path) -> str:
    """The file a write of `path` replaces: where `path` is a symbolic link, the file it leads to, so that a
    write by rename keeps the link (as open() writes through it) rather than putting a file in its place."""
    return os.path.realpath(path) if os.path.islink(path) else os.fspath(path)


def atomic_write(path, data: bytes | str) -> None:
    """Write `data` to a temporary file beside `path` (named by this process: concurrent writers do not
    collide), flush it to disk, then rename it over `path` (over the file a symbolic link leads to:
    write_target). A write that fails (a full disk) takes its temporary file away again."""
    path = write_target(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def existing_part(path) -> str:
    """The nearest part of `path` (made absolute) that exists: path itself, or the directory os.makedirs(path)
    would create it in (a dangling symbolic link counts as existing: makedirs cannot create over it)."""
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    return existing


def unwritable_dir(path) -> str | None:
    """Why files cannot be written into the directory `path`, creating it (and its parents) where it is missing;
    None when they can. Judged before anything is created, on the nearest part of `path` that exists: it must be
    a directory this process may write into (os.access, which also says no on a read-only file system)."""
    existing = existing_part(path)
    if not os.path.isdir(existing):
        return f"{existing} is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"the directory {existing} is not writable"
    return None


def remove_empty_dirs(path, keep) -> None:
    """Remove `path` and its parents below `keep` (a parent of path's) while they are empty directories: what
    os.makedirs(path) created from `keep` when nothing was written into it after all."""
    path, keep = os.path.abspath(path), os.path.abspath(keep)
    while path != keep and path.startswith(keep.rstrip(os.sep) + os.sep):
        try:
            os.rmdir(path)
        except OSError:                                # not empty (or gone): keep it and what is above
            return
        path = os.path.dirname(path)
