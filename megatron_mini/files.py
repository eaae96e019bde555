"""Files that a crash leaves whole: the old content or the new, never part of either."""
from __future__ import annotations

import os


def atomic_write(path, data: bytes | str) -> None:
    """Write `data` to a temporary file beside `path` (named by this process: concurrent writers do not
    collide), flush it to disk, then rename it over `path`."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
