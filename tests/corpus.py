"""The tests' text corpus: 85 modules of CPython 3.11.7's standard library as <module>.txt (tests/data/README.md),
the same bytes on every Python; the running interpreter's library is not (each version adds, drops and edits
modules), and the bounds the tests measure hold for these texts.

    write_modules(tmp_path / "corpus", FIRST_60)   # tmp_path/corpus/__future__.txt, ... genericpath.txt
"""
import math
import tarfile
from pathlib import Path

ARCHIVE = Path(__file__).parent / "data" / "cpython-3.11.7-lib.tar.xz"
FIRST_60 = slice(0, 60)     # the library's first 60 modules (sorted by name): small_data's corpus
NEXT_25 = slice(60, 85)     # its modules 100-124: a second corpus, of other documents

# extractall's "data" filter refuses links and paths that leave the directory (Python 3.11.4 on; 3.12-3.13 warn
# without a filter, 3.14 takes it by default)
SAFE = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}


def write_modules(out: Path, which: slice, sizes: tuple[float, float] = (0, math.inf)) -> Path:
    """The modules `which` of the archive's modules of sizes[0] < bytes < sizes[1] (sorted by name), written into
    the directory `out` as <module>.txt; returns `out`."""
    with tarfile.open(ARCHIVE) as tar:
        members = [m for m in sorted(tar.getmembers(), key=lambda m: m.name) if sizes[0] < m.size < sizes[1]]
        tar.extractall(out, members[which], **SAFE)
    return out
