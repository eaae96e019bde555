"""Memory per rank, as the layout planner predicts it (plan_meta.py, on the meta device) next to what
this run holds, so that a run that departs from its plan shows it at once:

- at start-up: weights, fp32 main grads and optimizer state (Optimizer.memory_bytes of every rank);
- after the first step: the activations autograd saved at the step's peak (meter.SavedTensorMeter
  around it; not when the model is compiled, whose graphs keep their own), and on a GPU the allocator's peak.

Every rank measures; rank 0, which alone runs the planner, prints. The figures go into history.json. The report
never stops training: a planner that fails (rank 0's alone, while the others wait for it in the report's first
collective) leaves a warning and a report without the plan."""
from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch

from . import comm
from .errors import first_line
from .meter import SavedTensorMeter
from .model import compiles

MiB = 2 ** 20
STATE = ("weights", "grads", "optimizer")


class MemoryReport:
    def __init__(self, trainer, log: logging.Logger, plan: bool):
        self.trainer, self.log, self.mesh = trainer, log, trainer.mesh
        self.planned = None
        self.first_gbs = trainer.cfg.global_batch_size(trainer.consumed_samples)   # (of the step measured)
        if plan and self.mesh.rank == 0:
            try:
                from .plan_meta import planned_memory       # (the first meta-device op imports torch's compiler)
                # planned for the device the run chose (device=auto on a CPU machine plans the CPU's attention),
                # and the global batch of the step it measures (a rampup_batch_size's first may be smaller)
                first = dataclasses.replace(trainer.cfg, device=trainer.device.type, rampup_batch_size=None,
                                            gbs=self.first_gbs)
                self.planned = planned_memory(first, self.mesh.dp)
            except Exception as e:      # noqa: BLE001 - a report's failure, told in the log, must not stop training
                log.info(f"warning: no memory plan, the planner failed ({first_line(e)}); "
                         f"memory_plan=false leaves it out")
        self.measuring = plan     # until the first step is measured
        self.meter = SavedTensorMeter(exclude=[p for c in trainer.chunks for p in c.parameters()]) \
            if plan and not compiles(trainer.cfg, trainer.device) else None
        self.ranks = []           # per rank: {"rank", "measured": {...}, "planned": {...}}

    def _gather(self, values: list) -> list:
        """Every rank's `values` (floats), in rank order."""
        mine = torch.tensor([values], dtype=torch.float64, device=self.trainer.device)
        return comm.all_gather(mine, self.mesh.world_group).tolist()

    def _pp_rank(self, r: int) -> int:
        return self.mesh.coords(r)[2]

    def _label(self, r: int) -> str:
        return "rank {:>4} (tp {}, dp {}, pp {})".format(r, *self.mesh.coords(r))

    def _planned(self, r: int, key: str) -> str:
        return f"{self.planned[self._pp_rank(r)][key] / MiB:.2f}" if self.planned else "-"

    def start(self) -> None:
        """Weights, main grads and optimizer state of every rank: planned | held."""
        rows = self._gather([self.trainer.optimizer.memory_bytes()[k] for k in STATE])
        self.ranks = [{"rank": r, "measured": dict(zip(STATE, row))} for r, row in enumerate(rows)]
        head = "memory per rank, MiB" + (" (planned | held)" if self.planned else "")
        self.log.info(head + ":\n" + "\n".join(
            f"  {self._label(r)}: " + ", ".join(f"{k} {self._planned(r, k) + ' | ' if self.planned else ''}"
                                                 f"{v / MiB:.2f}" for k, v in zip(STATE, row))
            for r, row in enumerate(rows)))

    @contextlib.contextmanager
    def first_step(self):
        """Around the first training step (a no-op around the others): the activations saved at its peak
        (not when the model is compiled), planned | measured, and on a GPU the allocator's peak."""
        if not self.measuring:
            yield
            return
        with self.meter.hooks() if self.meter else contextlib.nullcontext():
            yield
        self.measuring = False
        cuda = self.trainer.device.type == "cuda"
        if self.meter is None and not cuda:
            return                                    # nothing was measured
        peak = torch.cuda.max_memory_allocated(self.trainer.device) if cuda else 0
        rows = self._gather([self.meter.peak if self.meter else -1, peak])
        lines = []
        for r, (saved, allocated) in enumerate(rows):
            measured = "- (compiled)"
            if saved >= 0:
                self.ranks[r]["measured"]["activations"] = saved
                measured = f"{saved / MiB:.2f}"
            gpu = ""
            if cuda:
                self.ranks[r]["measured"]["allocated_peak"] = allocated
                total = (f"{sum(self.planned[self._pp_rank(r)].values()) / MiB:.0f} | "
                         if self.planned else "")
                gpu = f"; all memory {total}{allocated / MiB:.0f} (the allocator's peak)"
            lines.append(f"  {self._label(r)}: activations {self._planned(r, 'activations')} | {measured}{gpu}")
        gbs = self.trainer.cfg.gbs
        ramp = (f" (a rampup_batch_size step of {self.first_gbs} samples: the activations of gbs {gbs} may be more; "
                f"tools/plan.py plans them)") if self.first_gbs < gbs else ""
        self.log.info(f"memory at the first step's peak, MiB (planned | measured){ramp}:\n" + "\n".join(lines))

    def history(self) -> list:
        """Per rank: what was measured and (from rank 0's planner) planned, for history.json."""
        for row in self.ranks:
            if self.planned:
                row["planned"] = self.planned[self._pp_rank(row["rank"])]
        return self.ranks
