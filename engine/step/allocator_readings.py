"""AllocatorReadings: a step's device bytes on CUDA, read from the allocator at each sample.

On CUDA the allocator counts, with no work per op: each sample the step runner takes (every
trace point and every change of model bytes) reads the allocator's peak since the last one
and resets it. The simulated device counts every op instead (engine.step.non_model).
"""

from __future__ import annotations

from engine.devices.device import ComputeDevice

__all__ = ["AllocatorReadings"]


class AllocatorReadings:
    """The model bytes and the allocator's bytes at the latest sample, and the next
    sample's split of the allocator's peak into model and non-model bytes."""

    def __init__(self, device: ComputeDevice) -> None:
        self.device = device
        self._model = self._allocated = 0

    @property
    def allocated(self) -> int:
        """The allocator's bytes at the latest reading (less what is not the engine's)."""
        return self._allocated

    def reset(self, device_bytes: int) -> None:
        """A step begins with `device_bytes` of model data on the device and nothing else."""
        self._model = self._allocated = device_bytes

    def read(self, model: int) -> tuple[int, int]:
        """The model and non-model bytes at the allocator's peak since the last reading, or
        now if nothing rose above where the last reading left it (that moment was the last
        reading's); `model`: the model bytes now.

        Model bytes change right before a sample (an allocation) or right around it (a
        freed tensor may outlive the count by a statement), so at a peak before now they
        were the last sample's, and now the larger of the two counts."""
        before, self._model = self._model, model
        current, peak = self.device.allocator_reading()
        self.device.reset_peak()
        floor, self._allocated = self._allocated, current
        at = max(before, model)
        if peak > current and peak > floor:
            at = before
        elif peak <= floor:
            peak = current
        return at, max(0, peak - at)
