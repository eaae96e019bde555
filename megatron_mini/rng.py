"""Dropout RNG streams keyed by what a mask covers, so that dropout trains the same model under every
layout but tp (Megatron's CUDA RNG tracker, on any device, with keys in place of per-rank offsets).

Before a layer (the embedding, a block) runs forward on a microbatch in training, `seed(sample, layer)` seeds
* torch's default stream on the device with key(seed, sample, layer), the same on every TP rank: dropout in
  replicated regions;
* the "model-parallel" stream (`fork()`) with key(seed, sample, layer, tp_rank): dropout on local heads and
  sequence shards, when tp > 1 (at tp=1 the default stream serves: ParallelContext.dropout_stream).
`sample` is the global index of the microbatch's first sample. A mask is then a function of (seed, samples,
layer, tp rank) alone: not of dp, pp, vpp, the schedule, recompute or where a run resumed (no RNG state is
checkpointed), and DP replicas, which hold other samples, draw other masks. Activation recompute replays a
region's masks by restoring `get_states()` around the rerun.
"""
from __future__ import annotations

import contextlib
import hashlib

import torch


def key(*parts: int) -> int:
    """A 63-bit seed from integers (distinct tuples give independent seeds)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class RNGTracker:
    """Named RNG streams for dropout (see the module doc); the constructor leaves the default stream alone."""

    def __init__(self, seed: int, tp_rank: int, device: torch.device):
        self.run_seed, self.tp_rank, self.device = seed, tp_rank, device
        self.states = {"model-parallel": self._seeded(key(seed, tp_rank))}

    def seed(self, sample: int, layer: int) -> None:
        """Key both streams to the microbatch whose first sample is `sample` and to layer `layer`."""
        self._generator().manual_seed(key(self.run_seed, sample, layer))
        self.states["model-parallel"] = self._seeded(key(self.run_seed, sample, layer, self.tp_rank))

    def _seeded(self, seed: int) -> torch.Tensor:
        """The state of a stream seeded with `seed`, from a generator of its own: no stream of this
        process (CPU or any GPU's) is touched, so a planner's meta-device model leaves training's alone."""
        return torch.Generator(self.device if self.device.type == "cuda" else "cpu").manual_seed(seed).get_state()

    def _generator(self) -> torch.Generator:
        """torch's default generator of this device (what dropout draws from)."""
        if self.device.type == "cuda":
            return torch.cuda.default_generators[self.device.index if self.device.index is not None
                                                 else torch.cuda.current_device()]
        return torch.default_generator

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel"):
        generator = self._generator()
        outer = generator.get_state()
        generator.set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = generator.get_state()
            generator.set_state(outer)

    def get_states(self) -> dict:
        return {"default": self._generator().get_state(), **{k: v.clone() for k, v in self.states.items()}}

    def set_states(self, states: dict) -> None:
        self._generator().set_state(states["default"])
        self.states = {k: v.clone() for k, v in states.items() if k != "default"}
