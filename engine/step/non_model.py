"""Non-model bytes on the simulated device and on the meta device: every storage an op
allocates while a step runs, from that op until the storage is freed. On CUDA the caching
allocator says how many there are (engine.devices); the counter's growth only tells when to
read it.

Saved activations alone are not enough: backward allocates activation gradients,
autograd's parameter gradients (before the engine copies them into a chunk) and
temporaries of its own, and a step's peak is usually there (the log-softmax backward of a
large vocabulary). Counting what autograd saves missed a third to a half of the peak.

Why the count is complete:

- Every tensor the model, autograd or the engine creates comes out of an aten op
  (factories too: `torch.tensor` goes through `lift_fresh`), and a TorchDispatchMode sees
  every op below autograd, including the ops autograd runs for backward on the same thread
  and the recomputation of activation checkpointing.
- An output's storage is new unless the op's schema says it aliases an input (views,
  in-place and out= ops). A storage that was there before the step (a chunk payload, the
  batch) is never counted; one that an op resizes is recounted.
- Its bytes leave the count when the storage itself is freed: a weak reference to the
  storage's Python object, which lives exactly as long as the storage (it outlives every
  view and every C++ reference, such as the ones autograd keeps for backward).
- Model data is the chunk manager's to count: `disown` takes a storage out of the count
  when it becomes model data (a resident chunk keeps autograd's gradient), and an
  uninitialised allocation (`empty`) is counted from the next op only, after asking
  whether it is model data (the manager's gradient buffers are allocated with `empty`).

What it cannot see is memory a kernel allocates and frees inside one op; measured against
the CPU allocator's own total (benchmarks/true_peak.py) that is a few per cent of the peak.
The meta device runs the same ops on storages with sizes and no data, which is how the
planner records a step (engine.planning.recording).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# Outputs that are uninitialised memory: counted once the next op has run, unless they have
# become model data by then.
_UNINITIALISED = frozenset({
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
    aten.new_empty.default, aten.new_empty_strided.default})
# Ops whose schema does not tell whether an output aliases an input: lift_fresh's "alias"
# is of a tensor made outside any op a moment before (torch.tensor), so its storage is new;
# _unsafe_view returns a view of its input without saying so.
_ALIASES = {aten.lift_fresh.default: False, aten._unsafe_view.default: True}


def storage_key(t: torch.Tensor) -> int:
    """A name for `t`'s storage, unique among live storages on any device (meta too)."""
    return t.untyped_storage()._cdata


class LiveBytes(TorchDispatchMode):
    """While active (`with counter:`), counts the bytes of every storage an op allocates
    until it is freed. See the module docstring for why that is every byte.

    `on_change(delta)` hears every change of `current`; `is_model(key)` says whether an
    uninitialised allocation has become model data by the next op (then it is not counted).
    """

    def __init__(self, on_change: Callable[[int], None],
                 is_model: Callable[[int], bool] = lambda key: False) -> None:
        super().__init__()
        self.on_change = on_change
        self.is_model = is_model
        self.current = 0  # bytes of counted storages alive now
        self._live: dict[int, tuple[weakref.ref, int]] = {}  # storage key -> (ref, bytes)
        self._pending: list[weakref.ref] = []  # uninitialised storages, not counted yet
        self._ops: dict[object, tuple[tuple[bool, ...], bool]] = {}  # op -> _outputs(op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._pending:
            self._settle()
        out = func(*args, **(kwargs or {}))
        outputs = self._ops.get(func)
        if outputs is None:
            outputs = self._ops[func] = _outputs(func)
        aliasing, uninitialised = outputs
        if isinstance(out, torch.Tensor):  # most ops: one tensor
            grown = self._see(out, aliasing[0], uninitialised)
        else:  # lists of tensors (split), several returns, or none
            values = (out,) if len(aliasing) == 1 else out or ()
            grown = 0
            for value, alias in zip(values, aliasing, strict=False):
                for t in value if isinstance(value, list | tuple) else (value,):
                    if isinstance(t, torch.Tensor):
                        grown += self._see(t, alias, uninitialised)
        if grown:
            self.on_change(grown)
        return out

    def _see(self, t: torch.Tensor, alias: bool, uninitialised: bool) -> int:
        """Count `t`'s storage if it is new; returns the bytes the count grew by."""
        storage = t.untyped_storage()
        key = storage._cdata
        entry = self._live.get(key)
        if entry is not None:
            nbytes = storage.nbytes()
            if nbytes == entry[1]:
                return 0
            self._live[key] = (entry[0], nbytes)  # resized in place (out=, resize_)
            self.current += nbytes - entry[1]
            if nbytes < entry[1]:
                self.on_change(nbytes - entry[1])
            return max(0, nbytes - entry[1])
        if alias:
            return 0  # a view of something that was there before the step
        if uninitialised:
            self._pending.append(weakref.ref(storage))
            return 0
        return self._count(storage, key)

    def _count(self, storage: torch.UntypedStorage, key: int) -> int:
        nbytes = storage.nbytes()
        self._live[key] = (weakref.ref(storage, partial(self._freed, key)), nbytes)
        self.current += nbytes
        return nbytes

    def _settle(self) -> None:
        pending, self._pending = self._pending, []
        grown = 0
        for ref in pending:
            storage = ref()
            if storage is None:
                continue  # freed before any op used it
            key = storage._cdata
            if key not in self._live and not self.is_model(key):
                grown += self._count(storage, key)
        if grown:
            self.on_change(grown)

    def _freed(self, key: int, ref: weakref.ref) -> None:
        entry = self._live.get(key)
        if entry is None or entry[0] is not ref:
            return  # counted by an earlier step, or disowned
        del self._live[key]
        self.current -= entry[1]
        self.on_change(-entry[1])

    def disown(self, keys: set[int]) -> None:
        """Stop counting these storages: they are model data now."""
        for key in keys:
            entry = self._live.pop(key, None)
            if entry is not None:
                self.current -= entry[1]
                self.on_change(-entry[1])

    def reset(self) -> None:
        """Forget every storage: a new step counts from zero."""
        self._live.clear()
        self._pending.clear()
        self.current = 0


def _outputs(func: object) -> tuple[tuple[bool, ...], bool]:
    """For an op: whether each of its returns aliases an input, and whether its outputs
    are uninitialised memory."""
    aliasing = tuple(_ALIASES.get(func, r.alias_info is not None)
                     for r in func._schema.returns)
    return aliasing, func in _UNINITIALISED


class NonModelCounter(LiveBytes):
    """The engine's non-model bytes of one step (LiveBytes): on the simulated device its count
    is the measure, on CUDA its growth says when to read the allocator.

    `is_model_storage(key)` says whether a storage (by `storage_key`) holds model data;
    `on_change()` hears growth past `quiet_below`, which the engine raises to the first
    count that could move one of its peaks or call for room (every growth by default): most
    allocations come with frees of the same size and change nothing it keeps. A drop is
    read at the next sample.
    """

    def __init__(self, is_model_storage: Callable[[int], bool],
                 on_change: Callable[[], None]) -> None:
        super().__init__(self._changed, is_model_storage)
        self.grew = on_change
        self.quiet_below = -1

    def _changed(self, delta: int) -> None:
        if delta > 0 and self.current > self.quiet_below:
            self.grew()

    def reset(self) -> None:
        super().reset()
        self.quiet_below = -1
