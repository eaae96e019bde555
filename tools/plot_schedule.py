"""Draw a pipeline schedule as a Gantt chart: one row per pipeline rank, time left to right.

    python tools/plot_schedule.py --pp 4 --vpp 2 --microbatches 8 --schedule 1f1b -o schedule.png
    python tools/plot_schedule.py --pp 4 --vpp 2 --microbatches 8 --compare -o docs/schedule_pp4_vpp2_m8.png

The schedule is run by the simulator (megatron_mini.schedules) with a forward of one full stage
costing 1 and a backward 2. Blocks are coloured by microbatch (the number inside); backwards are
lighter and hatched; with vpp > 1 a grey strip under each block gives its model chunk. Blank
space is the pipeline bubble. --compare stacks GPipe, 1F1B and interleaved 1F1B for one layout.
"""
from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import to_rgb  # noqa: E402
from matplotlib.patches import Patch, Rectangle  # noqa: E402

from megatron_mini.config import ConfigError  # noqa: E402
from megatron_mini.schedules import KINDS, SimResult, check_schedule, simulate  # noqa: E402
from bench.report import at_least  # noqa: E402
from defaults_help import DefaultsHelp  # noqa: E402
from plotting import CREATED, refuse_unwritable, write_output  # noqa: E402
from megatron_mini.errors import run_tool  # noqa: E402

CHUNK_GREYS = ["#202020", "#707070", "#a8a8a8", "#d8d8d8"]


def chunk_grey(chunk: int, vpp: int):
    """The strip colour of model chunk `chunk` of `vpp`: CHUNK_GREYS up to 4 chunks, else vpp evenly spaced greys
    (a grey per chunk: CHUNK_GREYS repeated drew chunk 4 as chunk 0)."""
    if vpp <= len(CHUNK_GREYS):
        return CHUNK_GREYS[chunk]
    return str(round(0.125 + 0.75 * chunk / (vpp - 1), 4))         # (matplotlib's grey level)


def schedule_name(kind: str, vpp: int) -> str:
    if kind == "1f1b":
        return "interleaved 1F1B" if vpp > 1 else "1F1B"
    return "GPipe" if kind == "gpipe" else kind


def bubble_formula(pp: int, vpp: int, m: int, bubble: float) -> str:
    """The textbook bubble fraction, as text, and why the schedule's `bubble` is above it where it is (every
    schedule reaches it when m >= pp; GPipe with vpp > 1 and fewer microbatches does not)."""
    text = f"(p-1)/(v·m) = {pp - 1}/{vpp * m}" if vpp > 1 else f"(p-1)/m = {pp - 1}/{m}"
    if bubble > (pp - 1) / (vpp * m) + 1e-9:
        text += (f"; above it: with m={m} < pp={pp} rank 0 runs out of chunk-0 microbatches before the last rank "
                 f"hands it the first one for chunk 1")
    return text


def _lighter(colour, amount: float = 0.55):
    return tuple(c + (1 - c) * amount for c in to_rgb(colour))


def draw(ax, result: SimResult, kind: str, pp: int, vpp: int, m: int) -> None:
    """Draw one schedule's timelines on `ax`, rank 0 on top."""
    palette = plt.get_cmap("tab10" if m <= 10 else "tab20")
    strip = 0.16 if vpp > 1 else 0.0
    for rank, timeline in enumerate(result.timelines):
        for slot in timeline:
            colour = palette(slot.microbatch % palette.N)
            forward = slot.op == "forward"
            width = slot.end - slot.start
            ax.add_patch(Rectangle((slot.start, rank - 0.4 + strip), width, 0.8 - strip,
                                   facecolor=colour if forward else _lighter(colour),
                                   hatch=None if forward else "///", edgecolor="white", linewidth=0.8))
            if strip:
                ax.add_patch(Rectangle((slot.start, rank - 0.4), width, strip,
                                       facecolor=chunk_grey(slot.chunk, vpp),
                                       edgecolor="white", linewidth=0.8))
            ax.text(slot.start + width / 2, rank + strip / 2, str(slot.microbatch), ha="center",
                    va="center", fontsize=7, color="white" if forward else "black")
    ax.set_ylim(pp - 0.5, -0.5)
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.set_xlim(0, result.makespan)
    ax.set_title(f"{schedule_name(kind, vpp)}: pp={pp}, vpp={vpp}, m={m}; bubble {result.bubble:.4f} "
                 f"(textbook {bubble_formula(pp, vpp, m, result.bubble)}); peak in-flight (chunk, microbatch) per rank "
                 f"{result.peak_in_flight}", fontsize=10, loc="left")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def plot(panels: list[tuple[str, int, int, int]], output: str) -> list[SimResult]:
    """Simulate and draw each (kind, pp, vpp, m) panel, one above the other, into `output`."""
    results = [simulate(*panel) for panel in panels]
    height = sum(1.0 + 0.42 * panel[1] for panel in panels) + 0.6
    fig, axes = plt.subplots(len(panels), 1, figsize=(14, height), sharex=True, squeeze=False,
                             gridspec_kw={"height_ratios": [panel[1] for panel in panels]})
    for ax, panel, result in zip(axes[:, 0], panels, results):
        draw(ax, result, *panel)
    axes[-1, 0].set_xlim(0, max(r.makespan for r in results))
    axes[-1, 0].set_xlabel("time (forward of one whole pipeline stage = 1, backward = 2; p2p free)")
    legend = [Patch(facecolor="#4a78b5", label="forward (colour = microbatch)"),
              Patch(facecolor=_lighter("#4a78b5"), hatch="///", edgecolor="white", label="backward")]
    max_vpp = max(panel[2] for panel in panels)
    legend += [Patch(facecolor=chunk_grey(c, max_vpp), label=f"chunk {c}") for c in range(max_vpp) if max_vpp > 1]
    fig.legend(handles=legend, loc="upper right", ncol=len(legend), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / height))
    write_output(output, lambda path: fig.savefig(path, dpi=130))
    plt.close(fig)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=DefaultsHelp)
    p.add_argument("--pp", type=at_least(1), required=True, help="pipeline ranks")
    p.add_argument("--vpp", type=at_least(1), default=1,
                   help="model chunks per rank; 1f1b with vpp > 1 is interleaved")
    p.add_argument("--microbatches", "-m", type=at_least(1), required=True, help="microbatches per step")
    p.add_argument("--schedule", choices=KINDS, default="1f1b", help="the pipeline schedule")
    p.add_argument("--compare", action="store_true", help="draw GPipe, 1F1B and interleaved 1F1B one above the other")
    p.add_argument("-o", "--output", default="schedule.png",
                   help=f"image to write (.png, .svg, .pdf, ...; {CREATED})")
    args = p.parse_args(argv)
    refuse_unwritable(p, "-o", args.output, image=True)
    if args.compare:
        args.panels = [("gpipe", args.pp, 1, args.microbatches), ("1f1b", args.pp, 1, args.microbatches),
                       ("1f1b", args.pp, max(args.vpp, 2), args.microbatches)]
    else:
        args.panels = [(args.schedule, args.pp, args.vpp, args.microbatches)]
    for panel in args.panels:
        try:
            check_schedule(*panel)
        except ConfigError as e:
            p.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.compare and args.vpp == 1:
        print("note: --vpp 1, so the interleaved 1F1B panel uses vpp=2")
    results = plot(args.panels, args.output)
    for (kind, pp, vpp, m), result in zip(args.panels, results):
        print(f"{schedule_name(kind, vpp)} pp={pp} vpp={vpp} m={m}: bubble fraction {result.bubble:.6f} "
              f"(textbook {bubble_formula(pp, vpp, m, result.bubble)}); peak in-flight microbatches per rank "
              f"{result.peak_in_flight}" + (" (counted per model chunk)" if vpp > 1 else ""))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    run_tool(main)
