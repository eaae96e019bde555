"""The activation meter: bytes of the tensors autograd saves for backward, alive at once.

    meter = SavedTensorMeter(exclude=model.parameters())
    with meter.hooks():
        loss = model(x); ...
    meter.live, meter.peak        # bytes saved now, and at most so far

`torch.autograd.graph.saved_tensors_hooks` counts a saved tensor's storage when autograd packs it
(each storage once, however many tensors view it; parameters excluded) and releases it when
autograd drops the packed object (a weakref finalizer). It counts storages by identity, so it works
on the meta device too (shapes and dtypes, no data): the layout planner measures a model that does
not fit anywhere, and the training benchmarks a real step, with the same meter.
"""
from __future__ import annotations

import weakref

import torch


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata          # the StorageImpl: shared by views, unique per storage, also on meta


class _Packed:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t):
        self.t = t


class SavedTensorMeter:
    def __init__(self, exclude=()):
        self.exclude = {_storage_id(p) for p in exclude}
        self.live, self.peak, self.held = 0, 0, {}

    def _pack(self, t):
        key, nbytes = _storage_id(t), t.untyped_storage().nbytes()
        if key in self.exclude or nbytes == 0:
            return t
        entry = self.held.get(key)
        if entry is None:
            entry = self.held[key] = [0, nbytes]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        box = _Packed(t)
        weakref.finalize(box, self._release, key)
        return box

    @staticmethod
    def _unpack(box):
        return box.t if isinstance(box, _Packed) else box

    def _release(self, key):
        entry = self.held[key]
        entry[0] -= 1
        if entry[0] == 0:
            del self.held[key]
            self.live -= entry[1]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
