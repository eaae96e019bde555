"""Which layout for this model on this cluster (megatron_mini/planner.py): every valid (tp, pp, vpp, dp,
ZeRO, recompute, sp, embedding_stage), its memory per rank and predicted step time, the best ones.

    python tools/plan.py model=gpt3-175b gbs=2048 mbs=1 precision=bf16 cluster.gpus=384 cluster.gpus_per_node=8 \\
        cluster.gpu=a100-80gb
    python tools/plan.py model=bloom-176b gbs=2048 mbs=1 precision=bf16 cluster=jean-zay-a100 \\
        --layout tp=4,pp=12,zero=1,embedding_stage=layer --csv plan.csv --plot docs/plan_bloom.png

The positional arguments are train.py's keys (model, gbs, mbs, precision, seed, ...) and the cluster's:
cluster=a100-80gb|h100-80gb|jean-zay-a100 (conf/cluster/), or cluster.gpu, cluster.gpus,
cluster.gpus_per_node, cluster.intra_node_gbps, cluster.inter_node_gbps, cluster.efficiency,
cluster.memory_gib, cluster.reserve_gib (3: the GiB of each GPU a layout may not fill). --layout explains one
layout (and where it ranks); --csv writes every layout; --plot draws predicted step time against memory per rank,
one point per layout.
"""
from __future__ import annotations

import time

START = time.time()                               # the imports included in the time it prints

import argparse
import csv
import dataclasses
import os
import sys

# the planner computes on the meta device, where torch's thread pool has nothing to do; without the pool the process
# has one thread, so plan() forks its workers (planner.start_method; a process of several has them forked by a server)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from bench.report import at_least, text_table
from defaults_help import DefaultsHelp
from plotting import CREATED, refuse_unwritable, write_output
from megatron_mini.config import ConfigError, check_given, check_layout_free, split_override, validate
from megatron_mini.hardware import GPUS
from megatron_mini.errors import first_line, run_tool
from megatron_mini.launch import HydraCommandLine
from megatron_mini.planner import (GiB, Estimate, Plan, PlanConfig, estimate, in_node, model_bytes, plan,
                                   register_configs)

CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
TERMS = ("compute", "tp", "pp", "bubble", "dp", "emb")
MEMORY = ("weights", "grads", "optimizer", "activations", "backward")      # RankFacts.memory
LAYOUT_KEYS = ("tp", "pp", "vpp", "sp", "zero", "recompute", "embedding_stage", "schedule", "pipeline_first_blocks",
               "pipeline_last_blocks")


def load_config(overrides: list) -> PlanConfig:
    """conf/plan.yaml with the command line; a key or value Hydra refuses becomes one ConfigError (as train.py
    says it: launch.HydraCommandLine)."""
    register_configs()
    command_line = HydraCommandLine(config_name="plan", argv=overrides, schema=PlanConfig)
    try:
        with initialize_config_dir(config_dir=CONF, version_base=None):
            composed = compose(config_name="plan", overrides=overrides)
    except (HydraException, OmegaConfBaseException) as e:     # (what Hydra prints: the exception and its cause)
        text = " ".join(line.strip() for part in (e, e.__cause__) if part for line in str(part).splitlines()
                        if line.strip())
        raise ConfigError(command_line.explain(text)) from None
    except Exception as e:                                    # noqa: BLE001 - Hydra failed inside itself
        raise ConfigError(command_line.explain(f"{type(e).__name__}: {first_line(e)}", crashed=True)) from None
    check_given(composed, overrides, PlanConfig)
    cfg = OmegaConf.to_object(composed)
    cfg.cluster.check()
    check_layout_free(cfg)             # a value no layout can fix is one error, not a refusal of every layout
    return cfg


def parse_layout(text: str, base: PlanConfig) -> PlanConfig:
    """"tp=4,pp=12,zero=1" -> base with those keys (the others as the enumeration's defaults). Each value
    as its field's type: an integer, true/false, or a choice (validate() names the choices)."""
    changes = dict(vpp=1, sp=False, zero=0, recompute="none", embedding_stage="none", pipeline_first_blocks=0,
                   pipeline_last_blocks=0)
    defaults = {f.name: f.default for f in dataclasses.fields(PlanConfig)}
    for item in filter(None, text.split(",")):
        key, equals, value = item.partition("=")
        if key not in LAYOUT_KEYS or not equals:
            raise ConfigError(f"--layout {text}: {item!r} is not key=value of a layout key ({', '.join(LAYOUT_KEYS)})")
        if isinstance(defaults[key], bool):
            if value.lower() not in ("true", "false"):
                raise ConfigError(f"--layout {text}: {key}={value} must be true or false")
            changes[key] = value.lower() == "true"
        elif isinstance(defaults[key], int):
            try:
                changes[key] = int(value)
            except ValueError:
                raise ConfigError(f"--layout {text}: {key}={value} must be an integer") from None
        else:
            changes[key] = value
    cfg = dataclasses.replace(base, **changes)
    validate(cfg, base.cluster.gpus)
    if not in_node(base.cluster, cfg.tp):
        raise ConfigError(f"--layout {text}: tp={cfg.tp} does not divide the {base.cluster.gpus_per_node} GPUs of a "
                          f"node, so its TP groups would span nodes (the planner enumerates no such layout)")
    return cfg


def fig(x: float, places: int = 2) -> str:
    """x to `places` decimals, or to 2 significant digits where those decimals would show it as 0 (a small model's
    seconds and GiB: 0.0021, not 0.00)."""
    text = f"{x:.{places}f}"
    return f"{x:.2g}" if x and not text.strip("-0.") else text


def size_text(nbytes: float) -> str:
    """nbytes in the largest of TiB, GiB, MiB that it reaches: 2.24 TiB, 328.3 GiB, 10.1 MiB."""
    units = ((2 ** 40, "TiB", 2), (GiB, "GiB", 1))
    unit, name, places = next((u for u in units if nbytes >= u[0]), (2 ** 20, "MiB", 1))
    return f"{nbytes / unit:,.{places}f} {name}"


def gib(nbytes: float) -> str:
    return fig(nbytes / GiB, 1)


def summary_row(i: int, e: Estimate) -> list:
    return [i, e.layout_args(), f"dp={e.dp}", gib(e.memory_gib * GiB), fig(e.step_s), f"{e.tokens_per_s:,.0f}",
            f"{100 * e.mfu:.0f}%"] + [fig(e.times[t]) for t in TERMS]


def explain(e: Estimate, rank: int | None) -> str:
    """One layout: memory of its measured ranks, traffic per step and group, the time terms."""
    m = e.cfg.num_microbatches(e.dp)
    lines = [f"{e.layout_args()}  (dp={e.dp}, {m} microbatch{'es' * (m != 1)} of {e.cfg.mbs})"
             + (f": rank {rank} of the layouts that fit" if rank else ": does not fit" if not e.fits else "")]
    rows = [[f"pp rank {r.pp_rank}", *(gib(r.memory[k]) for k in MEMORY[:4]), r.in_flight, gib(r.memory["backward"]),
             gib(sum(r.memory.values()))] for r in e.ranks]
    lines += ["", text_table(["rank", "weights GiB", "grads GiB", "optimizer GiB", "activations GiB",
                              "in flight", "backward GiB", "total GiB"], rows)]
    worst = e.worst
    traffic = {}
    for (group, op), (calls, nbytes) in sorted(worst.ledger.items()):
        traffic.setdefault(group, []).append(f"{op} {calls} x = {gib(nbytes)} GiB")
    lines += ["", f"communication per step of pp rank {worst.pp_rank} (as comm.py's ledger counts it):"]
    lines += [f"  {group:>5}: " + ", ".join(ops) for group, ops in traffic.items()]
    lines += ["", f"bubble {fig(100 * e.bubble, 1)}% of the busy time of pp rank {e.heaviest}, the heaviest; "
              f"step {fig(e.step_s)} s = " + " + ".join(f"{t} {fig(e.times[t])}" for t in TERMS)]
    return "\n".join(lines)


def why_others_lost(p: Plan) -> str:
    """The layouts that fit but are slower than the best, by the term that costs them most over it."""
    best, lost = p.fitting[0], {}
    for e in p.fitting[1:]:
        term = max(TERMS, key=lambda t: e.times[t] - best.times[t])
        label = {"compute": "compute (recomputation, an unbalanced stage)", "tp": "TP/SP communication",
                 "pp": "pipeline sends", "bubble": "the pipeline bubble", "dp": "DP/ZeRO communication",
                 "emb": "the embedding-group sum"}[term]
        lost.setdefault(label, []).append(e)
    lines = [f"  {len(p.estimates) - len(p.fitting)} do not fit in {p.base.cluster.capacity_gib:.0f} GiB"]
    for label, es in sorted(lost.items(), key=lambda kv: -len(kv[1])):
        extra = es[0].step_s - best.step_s
        lines.append(f"  {len(es)} lose most to {label}, e.g. {es[0].layout_args()} (+{extra:.2f} s)")
    return "\n".join(lines)


def why_none_fits(p: Plan) -> str | None:
    """Why no layout can be launched (None when one can): none is valid, or the smallest fits no GPU."""
    c = p.base.cluster
    if not p.estimates:
        return (f"no layout of {p.base.model.name} on {c.gpus} GPUs ({c.gpus_per_node} per node) that the planner "
                f"enumerates (the blocks spread evenly) is valid; refused: "
                + "; ".join(f"{n} x {why}" for why, n in p.refused.most_common()))
    if not p.fitting:
        small = min(p.estimates, key=lambda e: e.memory_gib)
        return (f"none of the {len(p.estimates)} valid layouts fits in {c.capacity_gib:g} GiB per GPU: the smallest, "
                f"{small.layout_args()} (dp={small.dp}), needs {small.memory_gib:.3g} GiB on its largest rank")
    return None


def torchrun(e: Estimate, overrides: list) -> str:
    """The command that runs e's layout: the command line's train.py keys but the layout's (and the layout
    group's), then every layout key of e, so that no default of train.py's config decides one."""
    c = e.cfg.cluster
    nodes = max(1, c.gpus // c.gpus_per_node)
    name = lambda o: o.split("=")[0].lstrip("+~")                                       # noqa: E731
    keys = [o for o in overrides if name(o) not in LAYOUT_KEYS + ("layout",) and not name(o).startswith("cluster")]
    layout = [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k in LAYOUT_KEYS for v in [getattr(e.cfg, k)]]
    per_node = f"--nproc_per_node={min(c.gpus, c.gpus_per_node)}"
    # (one node: no address; the ranks meet at 127.0.0.1, not at the machine's name, which may not resolve: Makefile)
    launch = f"--standalone --local-addr=127.0.0.1 {per_node}" if nodes == 1 else \
        f"--nnodes={nodes} {per_node} --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:29500"
    return f"torchrun {launch} train.py {' '.join(keys + layout)}"


def write_csv(path: str, p: Plan) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["layout", "dp", "fits", "memory_gib", "step_s", "tokens_per_s", "bubble_fraction",
                    *(f"{t}_s" for t in TERMS),
                    *(f"{k}_gib" for k in MEMORY)])
        for e in p.estimates:
            worst = e.worst
            w.writerow([e.layout_args(), e.dp, e.fits, f"{e.memory_gib:.6g}", f"{e.step_s:.6g}",   # (any model's scale)
                        f"{e.tokens_per_s:.1f}", f"{e.bubble:.6g}", *(f"{e.times[t]:.6g}" for t in TERMS),
                        *(f"{worst.memory[k] / GiB:.6g}" for k in MEMORY)])


def draw(path: str, p: Plan, chosen: Estimate | None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for fits, color, label in ((True, "tab:blue", "fits"), (False, "tab:gray", "does not fit")):
        es = [e for e in p.estimates if e.fits == fits]
        ax.scatter([e.memory_gib for e in es], [e.step_s for e in es], s=12, c=color, alpha=0.6, label=label)
    best = p.fitting[0] if p.fitting else None
    for e, style, text in ((best, dict(marker="*", s=260, c="gold", edgecolors="k"), "best"),
                           (chosen, dict(marker="D", s=90, facecolors="none", edgecolors="tab:red", linewidths=2),
                            "--layout")):
        if e is not None:
            ax.scatter([e.memory_gib], [e.step_s], zorder=3, label=f"{text}: {e.layout_args()}", **style)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.axvline(p.base.cluster.capacity_gib, color="k", ls="--", lw=1, label="GPU memory")
    ax.set_xlabel("memory of the largest rank (GiB)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(f"{p.base.model.name} on {p.base.cluster.gpus} x {p.base.cluster.gpu}: every valid layout")
    ax.legend(fontsize=8)
    fig.tight_layout()
    write_output(path, lambda path: fig.savefig(path, dpi=120))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelp)
    ap.add_argument("overrides", nargs="*", help="train.py keys and cluster keys, key=value")
    ap.add_argument("--layout", help="explain one layout, e.g. tp=4,pp=12,zero=1,embedding_stage=layer")
    ap.add_argument("--top", type=at_least(1), default=10, help="how many of the layouts that fit to list")
    ap.add_argument("--csv", help=f"write every layout to this CSV file ({CREATED})")
    ap.add_argument("--plot", help=f"draw step time against memory per rank into this PNG ({CREATED})")
    args = ap.parse_args(argv)
    refuse_unwritable(ap, "--csv", args.csv)
    refuse_unwritable(ap, "--plot", args.plot, image=True)
    try:
        base = load_config(args.overrides)
        chosen = parse_layout(args.layout, base) if args.layout else None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    given = ["".join(split_override(arg)) for arg in args.overrides if split_override(arg)[0] in LAYOUT_KEYS]
    if given:                          # (every layout is ranked: a layout key of the command line chooses none)
        print(f"note: {' '.join(given)}: plan.py ranks every layout, whatever the command line gives its layout keys; "
              f"--layout {','.join(given)} explains that one")
    p = plan(base)
    c = base.cluster
    found = None
    if chosen:            # (valid, but maybe not enumerated: blocks placed unevenly, a schedule, ZeRO at dp=1)
        found = next((e for e in p.estimates if e.cfg == chosen), None) or estimate(p.planner, chosen, c)
    if p.estimates:       # (written before anything is printed: a reader that stops early, | head, leaves them whole)
        if args.csv:
            write_output(args.csv, lambda path: write_csv(path, p))
        if args.plot:
            draw(args.plot, p, found)
    sizes = model_bytes(base, p.planner)
    n = base.model.num_params()
    print(f"{base.model.name}: {f'{n / 1e9:.2f}B' if n >= 1e9 else f'{n / 1e6:.2f}M'} parameters; gbs {base.gbs} x "
          f"{base.model.seq_len} "
          f"tokens, mbs {base.mbs}, {base.precision.dtype}; {c.gpus} x {GPUS[c.gpu].name} ({c.gpus_per_node} per node, "
          f"{c.intra_node_gbps:g} / {c.inter_node_gbps:g} GB/s inside / between nodes, efficiency {c.efficiency:g})")
    print(f"checkpoint: {size_text(sizes['weights'])} of {base.precision.dtype} weights; with the fp32 master weights "
          f"and Adam state {size_text(sizes['weights'] + sizes['optimizer'])}")
    print(f"{len(p.estimates)} valid layouts, {len(p.fitting)} fit in {p.base.cluster.capacity_gib:.0f} GiB; "
          f"{sum(p.refused.values())} refused: " + "; ".join(f"{n} x {why}" for why, n in p.refused.most_common()))
    if p.fitting:
        head = ["#", "layout", "dp", "memory GiB", "step s", "tokens/s", "MFU", *(f"{t} s" for t in TERMS)]
        print("\n" + text_table(head, [summary_row(i + 1, e) for i, e in enumerate(p.fitting[:args.top])]))
        for i, e in enumerate(p.fitting[:min(3, args.top)]):      # the top ones listed, at most 3
            print("\n" + explain(e, i + 1))
        print("\nwhy the others lost (against the best):\n" + why_others_lost(p))
        print("\nthe best, launched on every node:\n  " + torchrun(p.fitting[0], args.overrides))
    problem = why_none_fits(p)
    if found is not None:
        rank = 1 + sum(e.step_s < found.step_s for e in p.fitting) if found.fits else None
        print("\n--layout " + args.layout + ":\n" + explain(found, rank))
    if not p.estimates:                                   # nothing to write or draw
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if args.csv:
        print(f"\nwrote {args.csv}")
    if args.plot:
        print(f"wrote {args.plot}")
    print(f"({time.time() - START:.1f} s)")
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    run_tool(main)
