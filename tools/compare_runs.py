"""Compare training runs (e.g. fp16 vs bf16): loss curves, the fp16 loss scale and the gradient's and weights'
norms in one PNG, plus a table.

    python tools/compare_runs.py runs/tiny-bf16 runs/tiny-fp16 -o compare.png [--smooth 0.9] [--labels bf16,fp16]

A RUN is a run directory (with wandb/ and/or metrics.jsonl), a wandb run directory
(wandb/offline-run-*/ or wandb/run-*/), or `wandb:entity/project/run_id` (online API).
A run directory's metrics.jsonl is preferred; its wandb record files are used when there is no
metrics.jsonl or when they hold every step of it and more. The table's "source" column says which.
The first RUN is the reference for the "gap" columns, taken at the same step: a run directory whose steps train
other tokens than the reference's (its .hydra/config.yaml: gbs, seq_len, rampup_batch_size) gets a line saying so.
The table is also saved as FILE.csv.
The legend shortens a label longer than 48 characters (legend_labels): the table has it whole.
Runs with data.eval sets (eval_loss/<dir>: the same samples whatever a run's data mixture, seed or layout)
get a column each, their final value, and a panel of their curves below the losses.
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import math
import os
import statistics
import struct
import sys
import zlib
from dataclasses import dataclass

from defaults_help import DefaultsHelp
from plotting import CREATED, refuse_unwritable, write_output
from megatron_mini.errors import run_tool

# The .wandb file: a 7-byte header, then LevelDB-log style chunks in 32 KiB blocks.
_FILE_HEADER = struct.Struct("<4sHB")  # b":W&B", magic 0xBEE1, version
_CHUNK_HEADER = struct.Struct("<IHB")  # crc32 of (type byte + payload), payload length, type
_BLOCK = 32 * 1024
_FULL, _FIRST, _LAST = 1, 2, 4


class RunError(Exception):
    """A RUN that cannot be read; the message is one line."""


@dataclass
class Run:
    """The logged history of one run."""

    label: str
    rows: list[dict]  # one dict per step, sorted by step, each with a "step" key
    source: str       # "wandb", "metrics.jsonl" or "wandb api"
    batch: str | None = None   # the tokens of a step, "gbs 32 x seq_len 128" (batch_of; None: not known)

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of the rows that have `key`."""
        pairs = [(row["step"], row[key]) for row in self.rows if row.get(key) is not None]
        return [s for s, _ in pairs], [v for _, v in pairs]


def merge_history(entries) -> list[dict]:
    """Rows by step from (step, metrics) pairs in the order they were logged.

    Entries at the same step are merged; a step lower than one already seen means the run was
    resumed from an earlier checkpoint, so the rows from that step on are replaced; but an evaluation
    (is_evaluation) there is of the checkpoint's own step, which the resumed run evaluates first and
    does not train again: that row keeps its train metrics (as logger.cut_metrics keeps its line).
    """
    rows: dict[int, dict] = {}
    last = None
    for step, metrics in entries:
        if last is not None and step < last:
            kept = {k: v for k, v in rows.get(step, {}).items() if not is_evaluation([k])}
            rows = {s: r for s, r in rows.items() if s < step}
            if is_evaluation(metrics) and kept:
                rows[step] = kept
        rows.setdefault(step, {"step": step}).update(metrics)
        last = step
    return [rows[s] for s in sorted(rows)]


def is_evaluation(keys) -> bool:
    """Whether the logged keys are an evaluation's (val_loss, val_loss/<dir>, eval_loss/<dir>)."""
    return bool(keys) and all(k == "val_loss" or k.startswith(("val_loss/", "eval_loss/")) for k in keys)


def iter_wandb_records(path: str):
    """Yield the `wandb_internal_pb2.Record`s of a .wandb file, stopping quietly at a torn tail."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    if len(data) < _FILE_HEADER.size:            # (torn in its header: wandb was killed before its first record)
        return
    if _FILE_HEADER.unpack_from(data)[:2] != (b":W&B", 0xBEE1):
        raise RunError(f"{path}: not a wandb record file")
    pos, parts = _FILE_HEADER.size, []
    while True:
        if _BLOCK - pos % _BLOCK < _CHUNK_HEADER.size:  # a block's last bytes are padding
            pos += _BLOCK - pos % _BLOCK
        if pos + _CHUNK_HEADER.size > len(data):
            return
        crc, length, kind = _CHUNK_HEADER.unpack_from(data, pos)
        payload = data[pos + _CHUNK_HEADER.size:pos + _CHUNK_HEADER.size + length]
        if len(payload) < length or zlib.crc32(payload, zlib.crc32(bytes([kind]))) != crc:
            return  # written up to here when the process died
        pos += _CHUNK_HEADER.size + length
        parts = [payload] if kind in (_FULL, _FIRST) else parts + [payload]
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            yield record


def _history_item(item) -> tuple[str, object]:
    key = item.key or ".".join(item.nested_key)
    return key, json.loads(item.value_json) if item.value_json else None


def read_wandb_files(paths: list[str]) -> tuple[str | None, list[dict]]:
    """The run name and history of .wandb files: segments of one (resumed) run, put in order by start time."""
    segments = []
    for path in paths:
        start, name, entries = 0, None, []
        for record in iter_wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                start, name = record.run.start_time.ToNanoseconds(), record.run.display_name or None
            elif kind == "history":
                items = dict(_history_item(item) for item in record.history.item)
                step = items.pop("_step", record.history.step.num)
                entries.append((int(step), {k: v for k, v in items.items() if not k.startswith("_")}))
        segments.append((start, name, entries))
    segments.sort(key=lambda segment: segment[0])
    names = [name for _, name, _ in segments if name]
    return (names[-1] if names else None), merge_history(e for _, _, entries in segments for e in entries)


def read_jsonl(path: str) -> list[dict]:
    """History from metrics.jsonl (a torn last line, from a crash, is ignored; null, a value that was not finite,
    reads as nan); RunError naming the first line that is JSON but no metrics line (an object with an int step)."""
    entries = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            try:
                metrics = json.loads(line)
            except json.JSONDecodeError:
                continue
            step = metrics.pop("step", None) if isinstance(metrics, dict) else None
            if type(step) is not int:
                raise RunError(f"{path}: line {number} is not a metrics line (a JSON object with an int step): "
                               f"{line.strip():.80}")
            entries.append((step, {k: math.nan if v is None else v for k, v in metrics.items()}))
    return merge_history(entries)


def wandb_files(run_dir: str) -> list[str]:
    """The .wandb files of a wandb run directory, or of every wandb run under a run directory."""
    return sorted(glob.glob(os.path.join(run_dir, "*.wandb"))
                  or glob.glob(os.path.join(run_dir, "wandb", "*run-*", "*.wandb")))


def read_run(spec: str) -> Run:
    """Read one RUN (see the module docstring)."""
    if spec.startswith("wandb:"):
        return _read_online(spec[len("wandb:"):])
    if not os.path.isdir(spec):
        raise RunError(f"{spec}: no such run directory")
    dir_name = os.path.basename(os.path.normpath(spec))
    from_wandb = from_jsonl = None
    files = wandb_files(spec)
    if files:
        name, rows = read_wandb_files(files)
        if rows:
            from_wandb = Run(name or dir_name, rows, "wandb")
    jsonl = os.path.join(spec, "metrics.jsonl")
    if os.path.exists(jsonl):
        rows = read_jsonl(jsonl)
        if rows:
            from_jsonl = Run(from_wandb.label if from_wandb else dir_name, rows, "metrics.jsonl")
    run = from_wandb if from_wandb and (not from_jsonl or _earlier_history(from_wandb, from_jsonl)) else from_jsonl
    # (wandb where it holds metrics.jsonl's steps and earlier ones: metrics.jsonl was removed and the run resumed;
    # else metrics.jsonl: a resume may change wandb.*, so wandb may hold only part of the run, and a resume from an
    # older checkpoint cuts metrics.jsonl, while wandb keeps the steps it abandoned wherever the resumed run's first
    # logged step comes after them: log_interval raised)
    if run:
        run.batch = batch_of(spec)
        return run
    raise RunError(f"{spec}: no logged history (neither wandb run data nor a non-empty metrics.jsonl)")


def batch_of(run_dir: str) -> str | None:
    """The tokens a step of the run directory trains, as its .hydra/config.yaml (the latest start's) gives them:
    "gbs 32 x seq_len 128", with its rampup_batch_size if any; None without that file."""
    import yaml
    try:
        with open(os.path.join(run_dir, ".hydra", "config.yaml"), encoding="utf-8") as f:
            cfg = yaml.safe_load(f)
        batch, ramp = f"gbs {cfg['gbs']} x seq_len {cfg['model']['seq_len']}", cfg.get("rampup_batch_size")
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError):
        return None
    return batch + (f" (rampup_batch_size {ramp})" if ramp else "")


def batch_notes(runs: list[Run]) -> list[str]:
    """A line for each run whose steps train other tokens than the reference's (the first run): its gap vs ref, and
    the plot's curves, compare the runs at the same step, not after the same tokens."""
    ref = runs[0].batch
    return [f"{run.label}: {run.batch} a step against the reference's {ref}: the gap vs ref and the curves compare "
            f"them at the same step, not after the same tokens" for run in runs[1:]
            if ref and run.batch and run.batch != ref]


def distinct_labels(runs: list[Run], specs: list[str]) -> list[str]:
    """The runs' labels, where two coincide (runs/a/tiny and runs/b/tiny; one wandb name) each of those the RUN as
    given, and the same RUN given twice numbered: a legend and table whose rows can be told apart."""
    labels = [run.label for run in runs]
    labels = [os.path.normpath(spec) if labels.count(label) > 1 else label for label, spec in zip(labels, specs)]
    return [f"{label} ({labels[:i].count(label) + 1})" if labels.count(label) > 1 else label
            for i, label in enumerate(labels)]


def _earlier_history(wandb: Run, jsonl: Run) -> bool:
    """Whether `wandb` holds every step of `jsonl` and more, all of them before `jsonl`'s first."""
    steps, kept = {row["step"] for row in wandb.rows}, {row["step"] for row in jsonl.rows}
    return steps > kept and max(steps - kept) < min(kept)


def _read_online(path: str) -> Run:
    import wandb

    try:
        run = wandb.Api().run(path)
        entries = [(int(row["_step"]), {k: v for k, v in row.items() if not k.startswith("_")})
                   for row in run.scan_history()]
    except Exception as e:
        raise RunError(f"wandb:{path}: {type(e).__name__}: {e}") from None
    if not entries:
        raise RunError(f"wandb:{path}: the run has no logged history")
    return Run(run.name, merge_history(entries), "wandb api")


def ema(values: list[float], smooth: float, steps: list[int] | None = None) -> list[float]:
    """Debiased exponential moving average (as TensorBoard draws it); non-finite values are skipped. With `steps`
    (each value's step), a value d steps after the last one kept decays the average by smooth**d, as the d steps
    between them would: runs logged at another log_interval draw alike."""
    out, avg, weight, last = [], 0.0, 0.0, None
    for i, v in enumerate(values):
        if math.isfinite(v):
            decay = smooth ** (steps[i] - last if steps and last is not None else 1)
            avg, weight = decay * avg + (1 - decay) * v, decay * weight + (1 - decay)
            last = steps[i] if steps else None
        out.append(avg / weight if weight else math.nan)
    return out


COLUMNS = ["run", "source", "final loss", "min loss", "final val_loss", "gap vs ref", "gap step", "skipped steps",
           "median tokens/s"]


def eval_keys(runs: list[Run]) -> list[str]:
    """The data.eval sets' metrics (eval_loss/<dir>) that any of `runs` logged, in the order first met."""
    keys: dict[str, None] = {}
    for run in runs:
        for row in run.rows:
            keys.update(dict.fromkeys(k for k in row if k.startswith("eval_loss/")))
    return list(keys)


def columns(runs: list[Run]) -> list[str]:
    """The table's columns: COLUMNS, then "final eval_loss/<dir>" for each of eval_keys(runs)."""
    return COLUMNS + [f"final {key}" for key in eval_keys(runs)]


def finite_loss(run: Run) -> dict[int, float]:
    """The train loss at each step that logged a finite one."""
    return {s: v for s, v in zip(*run.series("loss")) if math.isfinite(v)}


def gap(run: Run, ref: Run, smooth: float) -> tuple[float | None, int | None, str | None]:
    """(smoothed loss of `run` minus `ref`'s, the step, why there is none) at the last step both logged a loss,
    each smoothed over the steps both logged (the same run logged at two log_intervals: no gap)."""
    own, theirs = finite_loss(run), finite_loss(ref)
    common = sorted(own.keys() & theirs.keys())
    if common:
        mine, other = (ema([losses[s] for s in common], smooth, common)[-1] for losses in (own, theirs))
        return mine - other, common[-1], None
    if not own:
        return None, None, None
    if not theirs:
        return None, None, f"the reference {ref.label} logged no train loss"
    return None, None, f"no step where both it and the reference {ref.label} logged a train loss"


def table(runs: list[Run], smooth: float) -> list[dict]:
    """One row of columns(runs) per run, plus "note": why a run with a train loss has no "gap vs ref" (else None).

    "gap vs ref" is the smoothed loss minus the first run's at "gap step", the last step both logged.
    """
    rows, evals = [], eval_keys(runs)
    for run in runs:
        _, loss = run.series("loss")
        finite = [v for v in loss if math.isfinite(v)]
        gap_vs_ref, gap_step, note = gap(run, runs[0], smooth)
        _, val = run.series("val_loss")
        _, skipped = run.series("skipped_steps")
        _, speed = run.series("tokens_per_s")
        rows.append({
            "run": run.label,
            "source": run.source,
            "final loss": loss[-1] if loss else None,
            "min loss": min(finite) if finite else None,
            "final val_loss": val[-1] if val else None,
            "gap vs ref": gap_vs_ref,
            "gap step": gap_step,
            "skipped steps": int(max(skipped)) if skipped else None,
            "median tokens/s": statistics.median(speed) if speed else None,
            "note": note,
            **{f"final {key}": (run.series(key)[1] or [None])[-1] for key in evals},
        })
    return rows


def _fmt(column: str, value) -> str:
    if value is None:
        return "-"
    if column in ("run", "source", "gap step", "skipped steps"):
        return str(value)
    return {"gap vs ref": "{:+.4f}", "median tokens/s": "{:.0f}"}.get(column, "{:.4f}").format(value)


def print_table(rows: list[dict], names: list[str]) -> None:
    cells = [names] + [[_fmt(c, row[c]) for c in names] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(names))]
    for line in cells:
        print("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))))
    for row in rows:
        if row["note"]:
            print(f"{row['run']}: no gap vs ref: {row['note']}")


def save_csv(rows: list[dict], names: list[str], path: str) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        writer.writerows({c: "" if row[c] is None else row[c] for c in names} for row in rows)


_MARKERS = "osD^vP*X"


LEGEND_CHARS = 48     # the longest label the runs' legend shows: room for the loss curves beside it (1200 px wide)


def legend_labels(labels: list[str], width: int = LEGEND_CHARS) -> list[str]:
    """The runs' labels as the legend shows them, each at most `width` characters (a wandb directory's path ran
    past the panel): where one is longer, the start and the end that all of them share are left out ("…"), up to a
    separator ("/-_. "), then the middle of any still too long (its start and end kept). Labels that come out alike
    (they differ in the middle only) end in their place in the table, "#2"; the table has them whole."""
    if all(len(label) <= width for label in labels):
        return labels
    shown = labels
    if len(labels) > 1:             # (the start and the end all share, to a separator: "…bf16/wandb/offline-run-…")
        start = _cut(os.path.commonprefix(labels))
        end = _cut(os.path.commonprefix([label[start:][::-1] for label in labels]))
        middles = [label[start:len(label) - end] for label in labels]
        if all(middles):             # (not where one label is all the others' start or end)
            shown = [("…" if start else "") + middle + ("…" if end else "") for middle in middles]
    shown = [label if len(label) <= width else label[:(width - 1) // 2] + "…" + label[len(label) - width // 2:]
             for label in shown]
    return [f"{label[:width - 3 - len(str(i + 1))]}… #{i + 1}" if shown.count(label) > 1 else label
            for i, label in enumerate(shown)]


def _cut(shared: str) -> int:
    """How much of a shared start (or reversed end) to leave out: up to its last separator, or all of it."""
    return max(shared.rfind(sep) for sep in "/-_. ") + 1 or len(shared)


NORMS = ("grad_norm", "param_norm")    # the norms panel's: solid on a log axis, dashed on its right axis


def plot(runs: list[Run], path: str, smooth: float) -> None:
    """Train loss (raw thin, smoothed thick), val loss (dashed, markers), loss scale on a log axis; below, when
    runs logged any, the data.eval sets' losses (a marker each), then the gradient's norm (smoothed, log axis) and
    the weights' (dashed, right axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    evals = eval_keys(runs)
    norms = [key for key in NORMS if any(run.series(key)[0] for run in runs)]
    heights = [2] + [1] * bool(evals) + [1] * bool(norms)
    fig, axes = plt.subplots(len(heights), 1, figsize=(10, 6 + 3 * (len(heights) - 1)), sharex=True,
                             height_ratios=heights, squeeze=False)
    ax, *below = axes[:, 0]
    eval_ax = below.pop(0) if evals else None
    norm_ax = below.pop(0) if norms else None
    weight_ax = norm_ax.twinx() if "param_norm" in norms else None
    scale_ax = None
    for i, (run, label) in enumerate(zip(runs, legend_labels([run.label for run in runs]))):
        color = f"C{i % 10}"
        steps, loss = run.series("loss")
        ax.plot(steps, loss, color=color, lw=0.8, alpha=0.3)
        ax.plot(steps, ema(loss, smooth, steps), color=color, lw=2, label=label)
        steps, val = run.series("val_loss")
        ax.plot(steps, val, color=color, ls="--", marker="o", ms=4)
        steps, scale = run.series("loss_scale")
        if scale:
            scale_ax = scale_ax or ax.twinx()
            scale_ax.plot(steps, scale, color=color, ls=":", lw=1.2)
        for j, key in enumerate(evals):
            eval_ax.plot(*run.series(key), color=color, marker=_MARKERS[j % len(_MARKERS)], ms=5)
        if norm_ax is not None:
            steps, grad = run.series("grad_norm")
            finite = [(s, g) for s, g in zip(steps, grad) if math.isfinite(g)]    # (fp16's skipped steps: inf)
            if finite:
                norm_ax.plot([s for s, _ in finite], ema([g for _, g in finite], smooth, [s for s, _ in finite]),
                             color=color, lw=1.5)
        if weight_ax is not None and run.series("param_norm")[0]:
            weight_ax.plot(*run.series("param_norm"), color=color, ls="--", lw=1.2)
    axes[-1, 0].set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    styles = [Line2D([], [], color="gray", lw=2, label=f"train (EMA {smooth})"),
              Line2D([], [], color="gray", lw=0.8, alpha=0.5, label="train (raw)"),
              Line2D([], [], color="gray", ls="--", marker="o", ms=4, label="validation")]
    if scale_ax is not None:
        scale_ax.set_yscale("log")
        scale_ax.set_ylabel("fp16 loss scale (dotted)")
        styles.append(Line2D([], [], color="gray", ls=":", label="loss scale"))
    runs_legend = ax.legend(loc="upper right", title="run")
    ax.add_artist(runs_legend)
    if evals:
        eval_ax.set_ylabel("eval loss")
        eval_ax.set_title("data.eval sets (the same samples in every run)", fontsize=10)
        eval_ax.grid(alpha=0.3)
        eval_ax.legend(handles=[Line2D([], [], color="gray", marker=_MARKERS[j % len(_MARKERS)], ms=5,
                                       label=key[len("eval_loss/"):]) for j, key in enumerate(evals)],
                       loc="upper right", title="set")
    if norm_ax is not None:
        norm_ax.set_yscale("log")
        norm_ax.set_ylabel(f"grad norm (EMA {smooth})")
        norm_ax.grid(alpha=0.3)
        if weight_ax is not None:
            weight_ax.set_ylabel("param norm (dashed)")
    fig.tight_layout()
    # The line styles' legend under the runs' (side by side, a long label, say a wandb directory, ran one into the
    # other): placed once the layout has fixed the axes, as the runs' legend's height in axes units depends on it.
    fig.canvas.draw()
    below = runs_legend.get_window_extent().transformed(ax.transAxes.inverted())
    ax.legend(handles=styles, loc="upper right", bbox_to_anchor=(below.x1, below.y0))
    write_output(path, lambda path: fig.savefig(path, dpi=120))
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelp)
    parser.add_argument("runs", nargs="+", metavar="RUN",
                        help="run directory, wandb run directory, or wandb:entity/project/run_id")
    parser.add_argument("-o", "--output", required=True, metavar="FILE.png",
                        help=f"plot to write (table: FILE.csv; {CREATED})")
    parser.add_argument("--smooth", type=float, default=0.9, help="EMA weight of the smoothed curves")
    parser.add_argument("--labels", help="comma-separated legend labels, one per RUN")
    args = parser.parse_args(argv)
    labels = args.labels.split(",") if args.labels else None
    if labels is not None and len(labels) != len(args.runs):
        parser.error(f"--labels has {len(labels)} labels for {len(args.runs)} runs")
    if labels is not None and (not all(label.strip() for label in labels) or len(set(labels)) < len(labels)):
        parser.error(f"--labels {args.labels}: each run needs a label of its own (one empty, or one given twice, "
                     f"leaves the legend and table unable to tell them apart)")
    if not 0 <= args.smooth < 1:
        parser.error(f"--smooth {args.smooth} must be in [0, 1)")
    table_path = os.path.splitext(args.output)[0] + ".csv"
    refuse_unwritable(parser, "-o", args.output, image=True)
    refuse_unwritable(parser, "-o", table_path)              # (a directory of that name)
    try:
        runs = [read_run(spec) for spec in args.runs]
    except RunError as e:
        print(f"compare_runs: error: {e}", file=sys.stderr)
        return 2
    for run, label in zip(runs, labels or distinct_labels(runs, args.runs)):
        run.label = label
    rows, names = table(runs, args.smooth), columns(runs)
    print_table(rows, names)
    for note in batch_notes(runs):
        print(note)
    plot(runs, args.output, args.smooth)
    write_output(table_path, lambda path: save_csv(rows, names, path))
    print(f"wrote {args.output} and {table_path}")
    return 0


if __name__ == "__main__":
    run_tool(main)
