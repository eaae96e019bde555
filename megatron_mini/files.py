"""Files that a crash leaves whole: the old content or the new, never part of either; where files can be
written (a directory that exists or can be created, and is writable), and the empty directories a refused
run made taken away again; a directory one process at a time writes into (DirectoryLock), and the temporary
files and staging directories that a process killed outright (SIGKILL, the OOM killer) left in it."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
from pathlib import Path

from .errors import ConfigError


def write_target(path) -> str:
    """The file a write of `path` replaces: where `path` is a symbolic link, the file it leads to, so that a
    write by rename keeps the link (as open() writes through it) rather than putting a file in its place."""
    return os.path.realpath(path) if os.path.islink(path) else os.fspath(path)


def atomic_write(path, data: bytes | str | list) -> None:
    """Write `data` (or each buffer of a list, one after another: no joined copy) to a temporary file beside `path`
    (named by this process: concurrent writers do not collide), flush it to disk, then rename it over `path` (over
    the file a symbolic link leads to: write_target). A write that fails (a full disk) takes its temporary file away
    again."""
    path = write_target(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as f:
            for part in data if isinstance(data, list) else [data]:
                f.write(part.encode() if isinstance(part, str) else part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def sync_dir(path) -> None:
    """The entries of the directory `path` (files made, renamed or removed in it) flushed to disk, as fsync flushes
    a file's data: a rename is durable only then. A file system that does not sync directories (EINVAL, EOPNOTSUPP)
    is let be."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
    finally:
        os.close(fd)


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


def superseded_build(directory, corpus_sha256: str) -> Path:
    """Where prepare() keeps a data directory's valid build when it builds the directory again for its corpus as it
    now reads (data._keep_superseded): `{directory}.superseded-<that build's corpus sha256[:12]>`."""
    directory = Path(os.path.realpath(directory))
    return directory.with_name(f"{directory.name}{_superseded(corpus_sha256)}")


def is_superseded_build(directory, corpus_sha256: str) -> bool:
    """Whether `directory` is where prepare() kept a build of that corpus (superseded_build)."""
    return Path(os.path.realpath(directory)).name.endswith(_superseded(corpus_sha256))


def _superseded(corpus_sha256: str) -> str:
    return f".superseded-{corpus_sha256[:12]}"


def kept_build(directory, corpus_sha256: str) -> Path | None:
    """superseded_build(directory, corpus_sha256) where its meta.json says it holds that corpus, else None."""
    kept = superseded_build(directory, corpus_sha256)
    try:
        return kept if json.loads((kept / "meta.json").read_text())["corpus_sha256"] == corpus_sha256 else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def temporary_name(path) -> str:
    """The temporary file (or staging directory) that this process writes `path` into before it renames it (or
    moves its files) into place."""
    return f"{path}.tmp{os.getpid()}"


def is_temporary(name: str, names) -> bool:
    """Whether `name` is temporary_name's of one of `names` (any process's)."""
    return re.fullmatch("(" + "|".join(map(re.escape, names)) + r")\.tmp[0-9]+", name) is not None


def remove_left_temporaries(directory, names) -> list[tuple[str, int]]:
    """Remove the temporary files and staging directories (temporary_name's, any process's) of `names` in
    `directory` and return [(name, bytes)] of each (a directory's: its files'): what a writer killed outright
    (SIGKILL, the OOM killer) left, which no cleanup of its own could take away. Only while holding the directory's
    DirectoryLock, so that none of them is a live writer's."""
    removed = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if not is_temporary(entry.name, names):
            continue
        if entry.is_dir(follow_symlinks=False):
            size = sum(os.lstat(os.path.join(root, name)).st_size for root, _, files in os.walk(entry.path)
                       for name in files)
            shutil.rmtree(entry.path)
        elif entry.is_file(follow_symlinks=False):
            size = entry.stat(follow_symlinks=False).st_size
            os.unlink(entry.path)
        else:
            continue
        removed.append((entry.name, size))
    return removed


# where another process removes what this one reads (DirectoryLock's directory as it is made; a live run's
# checkpoints as a tool or another run reads them: checkpoint.newest, inference.read_with_tokenizer): tries as often
VANISHED_RETRIES = 20


class DirectoryLock:
    """An exclusive flock on `{directory}/.lock`, whose file names its holder (host, pid), held until release() (or
    the with block's end), which removes the file, or until the process ends: the kernel drops the lock of a
    process that dies, so a crash leaves no stale lock (only the file, which the next holder takes over).
    Where another process holds it: with `waiting`, waiting(its holder) is called and the lock waited for, else
    ConfigError ("{directory} is in use by {user} (host, pid). {advice}"); ConfigError where the directory's file
    system takes no locks."""

    FILE = ".lock"

    def __init__(self, directory, user: str, advice: str = "", waiting=None):
        self.path = os.path.join(directory, self.FILE)
        vanished = 0
        while True:
            try:        # (the holder waited for may be removing the directory it made, and its empty parents)
                os.makedirs(directory, exist_ok=True)
                self._file, created = _open_creating(self.path)
            except FileNotFoundError:
                vanished += 1
                if vanished > VANISHED_RETRIES:   # (not a race: a path that cannot be made, a dangling link in it)
                    raise
                continue
            try:
                self._lock(f"{directory} is in use by {user}", advice, waiting)
                same = _same_file(self._file, self.path)
            except OSError as e:
                self._file.close()
                if e.errno == errno.ESTALE:
                    continue                          # (NFS: the file was removed meanwhile: lock anew)
                if created:                           # (nobody can hold a lock here: leave no file behind)
                    _unlink(self.path)
                raise ConfigError(f"{self.path} cannot be locked ({e.strerror or e}): its file system takes no "
                                  f"locks, so nothing would keep {user} out of {directory}; use a directory on "
                                  f"another file system.") from None
            except BaseException:
                self._file.close()
                raise
            if same:
                break
            self._file.close()          # (the holder it waited for released it and removed the file: lock anew)
        try:
            self._file.seek(0)
            self._file.truncate()
            self._file.write(f"host {socket.gethostname()}, pid {os.getpid()}\n")
            self._file.flush()
            os.fsync(self._file.fileno())     # (other nodes read it: NFS shows them a file's data once it is synced)
        except BaseException:
            self.release()
            raise

    def _lock(self, in_use: str, advice: str, waiting) -> None:
        """flock the open file at once; where another process holds it, waiting(its holder) and wait for it, or
        without `waiting` a ConfigError ("{in_use} (its holder). {advice}")."""
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "another process"
            if waiting is None:
                raise ConfigError(f"{in_use} ({holder}). {advice}") from None
            waiting(holder)
            fcntl.flock(self._file, fcntl.LOCK_EX)

    @staticmethod
    def holder(directory) -> str | None:
        """What `{directory}/.lock` says of its holder ("host H, pid P": the last process that held it, if it is
        no longer held); None where there is no such file."""
        try:
            with open(os.path.join(directory, DirectoryLock.FILE)) as f:
                return f.read().strip()
        except FileNotFoundError:
            return None

    def release(self) -> None:
        """Remove the lock's file, then unlock it (one that opened the file meanwhile finds it gone: _same_file)."""
        if not self._file.closed:
            _unlink(self.path)
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()

    def __enter__(self) -> "DirectoryLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _open_creating(path):
    """(`path` opened for reading and writing, whether this call created it)."""
    try:
        return os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644), "r+"), True
    except FileExistsError:
        return os.fdopen(os.open(path, os.O_RDWR | os.O_CREAT, 0o644), "r+"), False


def _same_file(file, path) -> bool:
    """Whether the open `file` is still the file at `path`."""
    try:
        here, there = os.fstat(file.fileno()), os.stat(path)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ESTALE):
            return False
        raise
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
