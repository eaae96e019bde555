"""What the tools that write files share: the image formats matplotlib can write, and one rule for every file a
tool is told to write (plan.py --csv/--plot, plot_schedule.py -o, compare_runs.py -o, the benches' --out/--doc):
its missing directories are created; a path that cannot be written (a directory, a file in the way, a directory
not writable) is refused before any work, and a write that fails anyway (a full disk, a directory removed
meanwhile) ends the tool with one line."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile

from megatron_mini.files import unwritable_dir, write_target

CREATED = "missing directories are created"       # the rule, as the tools' --help says it


def image_path_error(path: str) -> str | None:
    """None when matplotlib can write `path` (judged by its suffix; .pgf only with its TeX system installed: it runs
    one), else the one-line reason."""
    import matplotlib
    from matplotlib.backend_bases import FigureCanvasBase

    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    suffix = os.path.splitext(path)[1][1:].lower()
    if suffix not in formats:
        return f"{path}: matplotlib writes only {', '.join('.' + f for f in formats)}"
    tex = matplotlib.rcParams["pgf.texsystem"]
    if suffix == "pgf" and shutil.which(tex) is None:
        return f"{path}: matplotlib writes .pgf with {tex} (rcParams['pgf.texsystem']), which is not installed here"
    return None


def output_path_error(path: str, image: bool = False, directory: bool = False) -> str | None:
    """None when this tool can write the file `path` (an image when `image`; with `directory`, `path` is a
    directory to write files into), creating its missing directories; else the one-line reason, starting
    with `path`."""
    if image and (error := image_path_error(path)) is not None:
        return error
    if directory:
        problem = unwritable_dir(path)
        return f"{path}: {problem}" if problem else None
    if os.path.isdir(path):
        return f"{path} is a directory: name the file to write"
    if os.path.exists(path) and not os.access(path, os.W_OK):
        return f"{path} is not writable"
    problem = unwritable_dir(os.path.dirname(os.path.abspath(path)))
    return f"{path}: {problem}" if problem else None


def refuse_unwritable(parser, option: str, path: str | None, image: bool = False, directory: bool = False) -> None:
    """argparse's one-line refusal (exit 2) of `option` `path` when output_path_error finds a reason; nothing
    when the option was not given."""
    if path and (error := output_path_error(path, image, directory)) is not None:
        parser.error(f"{option} {error}")


def write_output(path: str, write) -> None:
    """Create `path`'s missing directories and call write(tmp), tmp a file of path's own name in a staging
    directory of this process beside `path` (matplotlib reads the format from the suffix, and an EPS or PS figure
    records the file's name as its title), flushed to disk and renamed over `path`: a write that fails leaves the
    file that was there whole (files.atomic_write's rule), and no temporary file. An OSError there, which the check
    before the work could not foresee (a full disk, a directory removed or made read-only since), ends the tool
    with one line, `error: cannot write PATH: reason`, and exit status 2. Where `path` is a symbolic link, the file
    it leads to is replaced, and the link kept (files.write_target)."""
    target = write_target(path)
    directory = os.path.dirname(os.path.abspath(target))
    try:
        os.makedirs(directory, exist_ok=True)
        staging = tempfile.mkdtemp(prefix=".write-", dir=directory)
        try:
            tmp = os.path.join(staging, os.path.basename(path))     # (the name asked for: its suffix is the format)
            write(tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    except OSError as e:       # (a file where a directory should be: say so, not makedirs' "File exists")
        why = unwritable_dir(os.path.dirname(os.path.abspath(path))) or e.strerror or e
        print(f"error: cannot write {path}: {why}", file=sys.stderr)
        raise SystemExit(2) from None
