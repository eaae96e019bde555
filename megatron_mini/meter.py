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

import functools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


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


class AllocationMeter(TorchDispatchMode):
    """Bytes of the storages that ops allocate while it is on (an op's results that alias no input: not views,
    not in-place), alive at once: `live` now, `peak` at most so far; a storage counts until it is freed (a weakref
    on it; meta storages too). Around a layer's forward and backward its peak is what autograd saves plus the
    backward's temporaries (the gradients it computes and frees, the recomputed forward of a checkpoint).
    A result is new only if its storage is no input's: some ops return an input's storage without an alias
    annotation, _unsafe_view (a matmul of [s, b, h] reshapes its product so: every such product, the logits among
    them, was counted twice) and c10d's in-place collectives (ZeRO-1's reduce-scatters counted the whole gradient
    buffer again)."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self._refs = 0, 0, {}       # id -> weakref (a set would compare storages)

    def _freed(self, nbytes: int, ref) -> None:
        self.live -= nbytes
        self._refs.pop(id(ref), None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        if not returns:
            return out
        results = out if isinstance(out, (tuple, list)) else (out,)
        inputs = {_storage_id(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        aliases = [r.alias_info for r in returns] if len(returns) == len(results) else \
            [returns[0].alias_info] * len(results)               # one list result (split, unbind, ...)
        for t, alias in zip(results, aliases):
            if isinstance(t, torch.Tensor) and alias is None and _storage_id(t) not in inputs:
                storage = t.untyped_storage()
                nbytes = storage.nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                ref = weakref.ref(storage, functools.partial(self._freed, nbytes))
                self._refs[id(ref)] = ref
        return out
