"""Non-model bytes on the simulated device: what autograd saves for backward, each storage
once, until autograd frees it, plus the latest module output. On CUDA the caching allocator
says instead (engine.devices).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _Saved:
    """Holds one saved activation; its bytes leave the count when autograd drops it."""

    __slots__ = ("tensor", "key", "counter")

    def __init__(self, tensor: torch.Tensor, key: int, counter: SavedBytes) -> None:
        self.tensor, self.key, self.counter = tensor, key, counter

    def __del__(self) -> None:
        self.counter._drop(self.key)


class SavedBytes:
    """Counts the bytes autograd saves for backward, each storage once, while they live.

    `key(tensor)` names the tensor's storage, or is None for a tensor not to count (model
    data); `on_saved(delta)` hears every change of the count: +bytes when a storage is first
    saved, -bytes when autograd has dropped its last reference.
    """

    def __init__(self, key: Callable[[torch.Tensor], int | None],
                 on_saved: Callable[[int], None]) -> None:
        self.key = key
        self.on_saved = on_saved
        self.saved = 0  # bytes of saved activations alive now
        self._live: dict[int, list[int]] = {}  # storage key -> [nbytes, references]

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> object:
        key = self.key(tensor)
        if key is None:
            return tensor
        entry = self._live.get(key)
        if entry is None:
            nbytes = tensor.untyped_storage().nbytes()
            self._live[key] = [nbytes, 1]
            self.saved += nbytes
            self.on_saved(nbytes)
        else:
            entry[1] += 1
        return _Saved(tensor, key, self)

    @staticmethod
    def _unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def _drop(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]
            self.saved -= entry[0]
            self.on_saved(-entry[0])

    def reset(self) -> None:
        self._live.clear()
        self.saved = 0


class NonModelCounter(SavedBytes):
    """The engine's non-model bytes on the simulated device: saved activations plus the
    latest module output. Storages are told apart by data pointer; chunk payloads are model
    data."""

    def __init__(self, is_model_storage: Callable[[int], bool],
                 on_change: Callable[[], None]) -> None:
        super().__init__(self._storage_key, self._grew)
        self.is_model_storage = is_model_storage
        self.on_change = on_change
        self.output = 0  # bytes of the latest module output

    @property
    def current(self) -> int:
        return self.saved + self.output

    def set_output(self, nbytes: int) -> None:
        self.output = nbytes
        self.on_change()

    def _storage_key(self, tensor: torch.Tensor) -> int | None:
        key = tensor.untyped_storage().data_ptr()
        if key == 0 or tensor.device.type == "meta" or self.is_model_storage(key):
            return None
        return key

    def _grew(self, delta: int) -> None:
        # Only growth can overrun the budget; a drop (often from inside autograd's frees)
        # is read at the next sample.
        if delta > 0:
            self.on_change()

    def reset(self) -> None:
        super().reset()
        self.output = 0


def tensor_bytes(obj: object) -> int:
    """Bytes of every tensor in a (nested) module output."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0
