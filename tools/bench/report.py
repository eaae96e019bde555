"""Output of the benchmark tools: Markdown and console tables, the device and command lines, the
sections of docs/benchmarks.md between `<!-- tag begin -->` and `<!-- tag end -->`, and bench_train's
section reports with their goals."""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import os
import re
import shlex
import statistics
import sys
import time

from megatron_mini.profiling import markdown_table  # noqa: F401  (the benches' Markdown tables)
from plotting import CREATED, refuse_unwritable, write_output

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                   "docs", "benchmarks.md")
MIB = 2 ** 20


# ============================================================================ doc sections
def _markers(tag: str) -> tuple:
    return f"<!-- {tag} begin -->", f"<!-- {tag} end -->"


def add_output_args(ap, tag: str) -> None:
    """The --out / --doc options every GPU bench takes (`tag`: its section in the markdown file)."""
    ap.add_argument("--out", default=None, help=f"directory for {tag}.md and {tag}.json ({CREATED})")
    ap.add_argument("--doc", nargs="?", const="", default=None,
                    help=f"update the {tag} section of this markdown file (docs/benchmarks.md where --doc names "
                         f"none; {CREATED}); a smoke run writes only to an explicitly named file")


def check_output_args(ap, args) -> None:
    """Refuse, before the bench runs, an --out directory or a named --doc file that cannot be written."""
    refuse_unwritable(ap, "--out", args.out, directory=True)
    refuse_unwritable(ap, "--doc", args.doc)


def at_least(low: int):
    """An argparse type: an integer >= low (a count of steps or milliseconds), else argparse's one-line error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def positive_ints(text: str, count: int) -> tuple | None:
    """`text` as `count` comma-separated positive integers, or None when it is not that (for argparse types)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        return None
    return values if len(values) == count and min(values) >= 1 else None


def write_doc_section(path: str, tag: str, body: str) -> None:
    """Replace the text between `<!-- {tag} begin -->` and `<!-- {tag} end -->` in `path` with `body`
    (the markers are appended at the end of the file when absent)."""
    begin, end = _markers(tag)
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    if begin not in text and end not in text:
        text = text.rstrip("\n") + ("\n\n" if text else "") + f"{begin}\n{end}\n"
    elif begin not in text or end not in text or text.index(end) < text.index(begin):
        # (a marker lost in a hand edit: the section's bounds are unknown, and a guess would overwrite the text
        # between the orphan and the end of the file)
        print(f"error: {path}: the markers {begin} ... {end} are not a pair in this order; mend them by hand",
              file=sys.stderr)
        sys.exit(2)
    i, j = text.index(begin) + len(begin), text.index(end)
    text = text[:i] + "\n" + body.strip("\n") + "\n" + text[j:]
    write_text(path, text)


def write_text(path: str, text: str) -> None:
    """`text` into `path` whole, its missing directories created; a write that fails (a full disk mid-run) is one
    line and exit 2, not a traceback after the rows were measured (both plotting.write_output's)."""
    def write(tmp):
        with open(tmp, "w") as f:
            f.write(text)
    write_output(path, write)


def read_doc_section(path: str, tag: str) -> str | None:
    """The text between the markers of `tag` in `path`, or None."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        text = f.read()
    begin, end = _markers(tag)
    if begin not in text or end not in text:
        return None
    return text[text.index(begin) + len(begin):text.index(end)].strip("\n")


# ============================================================================ lines and tables
def now() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M")


def require_triton(tool: str) -> None:
    """Exit 2 with one line where the triton package is not installed: `tool` runs Triton's kernels or compiler
    (pyproject installs triton on Linux only; an import deep in a kernel module was a traceback)."""
    if importlib.util.find_spec("triton") is None:
        print(f"error: {tool} needs the triton package, which this Python does not have: pip install 'triton>=3.0' "
              f"(Linux; there are no wheels for macOS or Windows)", file=sys.stderr)
        sys.exit(2)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def device_line(with_date: bool = True) -> str:
    """The GPU (name, SMs, L2, memory) or else the CPU (model, cores); torch, triton (and CUDA)
    versions; the date."""
    import torch
    try:
        import triton
        versions = f"torch {torch.__version__}, triton {triton.__version__}"
    except ImportError:
        versions = f"torch {torch.__version__}, triton absent"
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        l2 = getattr(p, "L2_cache_size", 0)
        text = (f"{torch.cuda.get_device_name()} ({p.multi_processor_count} SMs, {l2 / 1e6:.0f} MB L2, "
                f"{p.total_memory / 2**30:.0f} GiB), {versions}, CUDA {torch.version.cuda}")
    else:
        text = f"CPU: {cpu_name()}, {os.cpu_count()} cores, {versions}"
    return text + (f", {now()}" if with_date else "")


def command_arguments() -> str:
    return " ".join(shlex.quote(a) for a in sys.argv[1:])


def command_line(script: str, python: str = "python") -> str:
    """How this run was started: `python tools/<script>` and its arguments."""
    args = command_arguments()
    return f"{python} tools/{script}" + (f" {args}" if args else "")


def text_table(headers, rows, indent: str = "") -> str:
    """The table with aligned columns, as console text."""
    rows = [[str(c) for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in rows)) if rows else len(str(h)) for i, h in enumerate(headers)]
    line = lambda cells: indent + "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))   # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def print_table(headers, rows) -> None:
    print(text_table(headers, rows, indent="  "))


def fmt(v, spec=".4g") -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def mb(nbytes: float) -> str:
    return f"{nbytes / MIB:.1f}"


def ratio(a, b) -> float:
    return a / b if b else float("nan")


def short_error(err: BaseException, limit: int = 140) -> str:
    """`Type: message` on one line, cut at `limit` characters."""
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:limit]}" + ("..." if len(text) > limit else "")


# ============================================================================ bench_train
ROW_HEADERS = ["configuration", "processes", "median s/step", "fastest s/step", "tokens/s (median)",
               "model TFLOP/s", "vs ref (medians)", "vs ref (paired)", "vs ref (fastest)"]
RATIO_NOTE = ("Ratios are throughput relative to the reference row: of the medians (the goal figure), "
              "paired (median over rounds of the ratio of the two steps of the same round), and of the fastest "
              "steps (the least disturbed by other load).")
GOAL_HEADERS = ["section", "goal", "measured", "target", "result (medians)", "result (fastest steps)"]


def ratios_text(row, ref) -> str:
    return f"{row.speedup(ref):.3f} (paired {row.paired(ref):.3f}, fastest steps {row.fastest(ref):.3f})"


def row_line(row, ref=None) -> list:
    """A ROW_HEADERS line of a measured harness.Row, its ratios to `ref` if given."""
    return [row.name, row.ex.desc, f"{row.median_wall:.2f}", f"{row.min_wall:.2f}", f"{row.tokens_per_s:,.0f}",
            f"{row.tflops:.4f}"] + ([f"{row.speedup(ref):.3f}", f"{row.paired(ref):.3f}", f"{row.fastest(ref):.3f}"]
                                    if ref else ["-"] * 3)


class Report:
    """One bench_train section of `bench` (harness.Bench): its text and tables (printed as they come), its
    goals (no verdict on a smoke run's tiny model), its duration and the load averages sampled during it."""

    def __init__(self, section: int, title: str, bench):
        self.section, self.title, self.parts, self.goals, self.smoke = section, title, [], [], bench.smoke
        self.date, self.t0, self.loads, self.first_load = now(), time.time(), bench.loads, len(bench.loads)

    def finish(self) -> None:
        loads = self.loads[self.first_load:] or [os.getloadavg()[0]]
        self.duration = time.time() - self.t0
        self.load = f"{min(loads):.1f} to {max(loads):.1f} (median {statistics.median(loads):.1f})"

    def text(self, s: str) -> None:
        print(s)
        self.parts.append(s)

    def table(self, headers, rows) -> None:
        print_table(headers, rows)
        self.parts.append(markdown_table(headers, rows))

    def goal(self, name: str, measured: str, target: str, ok: bool, ok_fastest: bool | None = None) -> None:
        """ok: the goal's verdict (medians); ok_fastest: the same on the fastest steps (timing goals)."""
        verdict = lambda v: "n/a (smoke run)" if self.smoke else "PASS" if v else "MISS"  # noqa: E731
        self.goals.append((self.section, name, measured, target, verdict(ok),
                           verdict(ok) if ok_fastest is None else verdict(ok_fastest)))

    def throughput_goal(self, name: str, row, ref, target: float) -> None:
        """Goal: row's tokens/s >= target x ref's, judged on the medians (and shown on the fastest steps)."""
        self.goal(name, ratios_text(row, ref), f">= {target}", row.speedup(ref) >= target, row.fastest(ref) >= target)

    def markdown(self, command: str, device: str) -> str:
        args = command_arguments()
        body = (f"## {self.title}\n\n- command: `{command}` (`make bench" + (f" ARGS=\"{args}\"" if args else "")
                + f"`)\n- date: {self.date}; this section took {self.duration:.0f} s\n- device: {device}\n"
                f"- 1-minute load average during the section (sampled every round; 2 cores shared with other "
                f"developers' tests): {self.load}\n\n" + "\n\n".join(p.strip("\n") for p in self.parts))
        return re.sub(r"\n{3,}", "\n\n", body)


TRAIN_DOC_HEADER = """# Training benchmarks

<!-- bench_train header -->
Written by `tools/bench_train.py` (`make bench`); each section below is replaced when that section is
rerun (`make bench ARGS="--section N"`). Shape **S2**: 4 layers, 8 heads, hidden 256, sequence 256,
micro-batch 8, global batch 32 (4 microbatches at dp=1, 8192 tokens per step), vocabulary 1024, fp32
unless stated, synthetic tokens, CPU, gloo.

**Method.** All rows of a section are built once and kept alive (single-process rows in the bench
process with `torch.set_num_threads(2)`, multi-rank rows in persistent spawned gloo pools with one
thread per rank; every process's malloc keeps freed memory, as train.py's CPU ranks', `hardware.configure_device`),
warmed up with one step, then measured in interleaved rounds (one step per row,
order reversed every round) so that the load of a shared machine falls on every row alike. A row's
figure is the median of its steps; a multi-rank step is the slowest rank's wall time. The machine is
shared with other developers' test runs: compare rows within a section (ratios), not across runs.

**Model FLOPs per step** = `ModelConfig.flops_per_token()` x T = 6·N·T + 12·L·h·s·T, with
N = 12·L·h² + V·h at MLP width 4h (matmul weights: QKV, attention output, MLP in and out, and the tied output
projection; V the padded vocabulary) and T the tokens per step. For S2: N = 3,407,872, T = 8192:
167.5 + 25.8 = 193.3 GFLOP per step.

**Activation memory** = peak bytes of tensors saved for backward alive at once during a step:
`torch.autograd.graph.saved_tensors_hooks` counts each saved tensor's storage once on pack
(parameters excluded) and releases it when autograd drops the packed object (weakref finalizer).
Checkpointed regions count the inputs they save (non-reentrant checkpoint saves them under the outer
hooks); the transient recomputed activations of the region being back-propagated are not counted.
"""


def write_train_doc(path: str, reports: list, command: str, device: str) -> None:
    """Replace the sections of `reports` in `path` (the header and empty sections are put at the top
    when absent) and their rows of the goals table, keeping the rows of the sections not rerun."""
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    if "<!-- bench_train header -->" not in text:
        tags = [f"bench_train section {i}" for i in range(1, 5)] + ["bench_train goals"]
        skeleton = TRAIN_DOC_HEADER + "\n" + "\n\n".join("\n".join(_markers(t)) for t in tags) + "\n"
        write_text(path, skeleton + ("\n" + text if text else ""))
    for rep in reports:
        write_doc_section(path, f"bench_train section {rep.section}", rep.markdown(command, device))
    kept = {}
    for line in (read_doc_section(path, "bench_train goals") or "").splitlines():
        m = re.match(r"\| (\d) \| (.*)", line)
        if m:
            kept.setdefault(int(m.group(1)), []).append(line)
    for rep in reports:
        kept[rep.section] = ["| " + " | ".join(map(str, g)) + " |" for g in rep.goals]
    rows = [line for s in sorted(kept) for line in kept[s]]
    write_doc_section(path, "bench_train goals", "## Goals\n\nThe verdict is on the medians (the goal's figure); "
                      "the last column applies the same target to the fastest steps, the figure least disturbed "
                      "by other load on the shared machine.\n\n" + markdown_table(GOAL_HEADERS, []) + "\n"
                      + "\n".join(rows))
