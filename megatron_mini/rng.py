"""Dropout RNG streams that stay correct under tensor, sequence and pipeline parallelism.

Two streams (Megatron's CUDA RNG tracker, on any device):
* the default torch stream, seeded equally on every TP and DP rank of a pipeline stage
  (`seed_default_stream`, called by the training set-up): dropout in replicated regions;
* "model-parallel" (`RNGTracker.fork()`), seeded per TP rank (differs across TP, equal across DP):
  dropout on local heads and sequence shards, when tp > 1 (at tp=1 the default stream serves:
  ParallelContext.dropout_stream).
Activation recompute replays a region's dropout by restoring `get_states()` around the rerun.
"""
from __future__ import annotations

import contextlib

import torch


def seed_default_stream(seed: int, pp_rank: int) -> None:
    """Seed torch's default stream (every device) for this pipeline stage: equal across TP and DP."""
    torch.manual_seed(seed + 100 * pp_rank)


class RNGTracker:
    """Named RNG streams for dropout (see the module doc); the constructor leaves the default stream alone."""

    def __init__(self, seed: int, tp_rank: int, pp_rank: int, device: torch.device):
        self.device = device
        self.states = {"model-parallel": self._seeded(seed + 2718 + 100 * pp_rank + tp_rank)}

    def _seeded(self, seed: int) -> torch.Tensor:
        """The state of a stream seeded with `seed`, from a generator of its own: no stream of this
        process (CPU or any GPU's) is touched, so a planner's meta-device model leaves training's alone."""
        return torch.Generator(self.device if self.device.type == "cuda" else "cpu").manual_seed(seed).get_state()

    def _get(self):
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state):
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel"):
        outer = self._get()
        self._set(self.states[name])
        try:
            yield
        finally:
            self.states[name] = self._get()
            self._set(outer)

    def get_states(self) -> dict:
        return {"default": self._get(), **{k: v.clone() for k, v in self.states.items()}}

    def compatible(self, states: dict) -> bool:
        """Whether `states` (get_states of some run) fit this tracker's device: a CUDA generator's state
        is 16 bytes, a CPU one's 5056, so a checkpoint saved on one kind of device cannot seed the other."""
        return all(v.shape == self.states["model-parallel"].shape for v in states.values())

    def set_states(self, states: dict) -> None:
        self._set(states["default"])
        self.states = {k: v.clone() for k, v in states.items() if k != "default"}
