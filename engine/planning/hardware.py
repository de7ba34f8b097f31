"""Machines that are not this one: GPUs described by their published specs.

    profile = HARDWARE["a100-80gb"]
    cal = profile.calibration(host=calibration())   # its GPU, this host's CPU and disk

A profile gives the plan the device's memory and the time model the device's speeds:
peak matmul throughput per dtype, memory bandwidth and the PCIe link, each derated to what
training reaches in practice (the factors below, applied to every profile alike). The host
side (AdamW on the host, the disk, the engine's own cost per op) is this machine's,
measured, unless the profile is used on its own host. Time from a profile is an estimate
from specs, and says so (Calibration.source).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # no torch here: the application's settings check profile names
    from engine.planning.calibration import Calibration

__all__ = ["DERATING", "HARDWARE", "HardwareProfile", "UnknownHardware", "hardware_profile"]

# Shares of the published peaks that training reaches, applied to every profile:
# matmuls of a transformer's shapes reach about 60% of the dense tensor peak; elementwise
# kernels and AdamW about 80% of the memory bandwidth; a pageable copy through pinned
# staging about 80% of the PCIe link's per-direction rate.
DERATING = {"matmul": 0.6, "memory": 0.8, "pcie": 0.8}
# GB/s per lane and direction after line coding, per PCIe generation.
PCIE_LANE = {3: 0.985e9, 4: 1.969e9, 5: 3.938e9}
# Bytes AdamW moves per element: reads parameter, gradient and both moments, writes back
# the parameter and both moments, all fp32.
ADAMW_BYTES = 28


class UnknownHardware(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown hardware {name!r}; known: {', '.join(HARDWARE)}")


@dataclass(frozen=True)
class HardwareProfile:
    """A GPU as published: dense peaks (no sparsity), matmuls accumulating in fp32."""

    name: str
    description: str
    memory: int  # bytes
    tflops: dict[str, float]  # precision -> dense peak TFLOPS
    memory_bandwidth: float  # bytes per second
    pcie_generation: int
    pcie_lanes: int

    @property
    def pcie(self) -> float:
        """Bytes per second each way over the link, derated."""
        return PCIE_LANE[self.pcie_generation] * self.pcie_lanes * DERATING["pcie"]

    def calibration(self, host: Calibration) -> Calibration:
        """A calibration with this GPU's derated specs and `host`'s measured CPU side."""
        memory = self.memory_bandwidth * DERATING["memory"]
        rates = {p: t * 1e12 * DERATING["matmul"] for p, t in self.tflops.items()}
        return dataclasses.replace(
            host,
            device=self.description,
            matmul={p: {768: r} for p, r in rates.items()},
            elementwise=memory,  # what other ops read and write
            random=0.0,  # a GPU draws random numbers about as fast as it writes them
            h2d=self.pcie,
            d2h=self.pcie,
            adamw_device=memory / ADAMW_BYTES,
            compute_factor=1.0,  # the derating stands for it
            half_factor=1.0,
            compute_offset=0.0,
            half_offset=0.0,
            correction=1.0,  # what runs on this host taught is no property of that GPU
            learned_from=0,
            learned=[],
            source=(f"the published specs of {self.description}, an estimate "
                    f"(derated: matmul x{DERATING['matmul']}, memory x{DERATING['memory']}, "
                    f"PCIe x{DERATING['pcie']}) with this host's measured CPU and disk"),
        )


def _gib(n: float) -> int:
    return int(n * 2**30)


# fmt: off
_PROFILES = (
    HardwareProfile("laptop-6gb", "a 6 GB laptop GPU (RTX 3060 Laptop)", _gib(6),
                    {"fp32": 10.9, "bf16": 21.8, "fp16": 21.8}, 336e9, 4, 16),
    HardwareProfile("laptop-8gb", "an 8 GB laptop GPU (RTX 4060 Laptop)", _gib(8),
                    {"fp32": 11.6, "bf16": 23.2, "fp16": 23.2}, 256e9, 4, 8),
    HardwareProfile("desktop-12gb", "a 12 GB desktop card (RTX 3060 12 GB)", _gib(12),
                    {"fp32": 12.7, "bf16": 25.4, "fp16": 25.4}, 360e9, 4, 16),
    HardwareProfile("desktop-24gb", "a 24 GB desktop card (RTX 4090)", _gib(24),
                    {"fp32": 82.6, "bf16": 165.2, "fp16": 165.2}, 1008e9, 4, 16),
    HardwareProfile("a100-40gb", "A100 40 GB (SXM)", _gib(40),
                    {"fp32": 19.5, "bf16": 312.0, "fp16": 312.0}, 1555e9, 4, 16),
    HardwareProfile("a100-80gb", "A100 80 GB (SXM)", _gib(80),
                    {"fp32": 19.5, "bf16": 312.0, "fp16": 312.0}, 2039e9, 4, 16),
    HardwareProfile("h100-80gb", "H100 80 GB (SXM)", _gib(80),
                    {"fp32": 67.0, "bf16": 989.0, "fp16": 989.0}, 3350e9, 5, 16),
)
# fmt: on
HARDWARE: dict[str, HardwareProfile] = {p.name: p for p in _PROFILES}


def hardware_profile(name: str) -> HardwareProfile:
    """The shipped profile called `name`; UnknownHardware (a ValueError) lists the known."""
    try:
        return HARDWARE[name]
    except KeyError:
        raise UnknownHardware(name) from None
