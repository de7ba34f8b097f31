"""What a calibration holds: a machine's speeds (`Calibration`), and the arithmetic the time
model (engine.planning.time_model) asks of them.

    cal.matmul_rate("bf16", hidden=768)    # FLOPs per second of bf16 matmuls at that width
    cal.compute_seconds("fp32", cal.kernel_seconds("fp32", 768, flops, nbytes))

Each figure is a rate per second, measured on this machine (engine.planning.measurement) or,
for a GPU planned from its specs, published (engine.planning.hardware). The rates are each
kernel at its best; the factor and offset a real decoder measured against them
(engine.planning.reference_decoder) turn what they forecast for a micro-batch's kernels into
what its forward and backward take. What runs taught the figures (the correction) is kept
in a file of its own beside them (engine.planning.calibration), so `to_dict` leaves it out.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch

__all__ = ["DTYPES", "FORMAT", "Calibration"]

FORMAT = 15  # bump when what is measured changes: older files are measured again
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Calibration:
    """A machine's speeds. Rates are per second: FLOPs, bytes or AdamW elements."""

    fingerprint: str
    machine: str  # the fingerprint in words
    device: str  # "simulated" or the GPU's name
    matmul: dict[str, dict[int, float]]  # dtype -> width -> FLOPs per second on the device
    elementwise: float  # bytes per second that non-matmul ops read and write on the device
    h2d: float  # copy bandwidth host -> device
    d2h: float  # device -> host
    adamw_host: float  # elements per second of the fused AdamW update on the host
    adamw_device: float  # ... on the device
    disk_read: float  # the scratch folder's sequential bandwidth (0: not measured)
    disk_write: float
    op_overhead: float  # the engine's seconds per op beyond the op itself (hooks, counting)
    # Bytes per second of new host memory beyond writing it: mapped, each page faulted in
    # and zeroed at its first write, unmapped when freed (0: not measured, costs nothing).
    fresh_pages: float = 0.0
    # Bytes per second of the new memory a forward and backward take for their activations,
    # gradients and logits, beyond writing it: the reference decoder in the process's heap
    # against the same decoder in a kept heap, which maps nothing afresh (REFERENCE). A
    # step's own new pages went 1.3-1.8x as fast as the probe's above on one boot of this
    # project's machine (opt-125m: 1.0 GiB faulted a step, 0.18-0.21 s, against 0.29-0.33
    # s at the probe's rate) and 0.8-0.95x on the next (4.1-4.85 GiB/s against 4.9-5.4);
    # the probe still prices the copies' new buffers: written by one copy each, as its own
    # are. 0: not measured (no kept heap to compare with): the probe's rate.
    activation_pages: float = 0.0
    # Random numbers per second drawn on the device (dropout's mask: `bernoulli_` over fp32
    # elements) beyond the bytes that writes, which `elementwise` prices (0: not measured,
    # or a device that draws them as fast as it writes them).
    random: float = 0.0
    # Bytes per second read and written together in the scratch folder, one thread reading
    # while another writes, as the update reads each piece ahead and writes the last behind
    # (engine.chunks.update_walk) (0: not measured; one after the other at the rates above).
    disk_duplex: float = 0.0
    # A real decoder's forward and backward measured over what the FLOPs and bytes above
    # forecast for it, per second of that forecast (the slope between two depths, see
    # REFERENCE): the small matmuls, the barriers between a parallel kernel's threads,
    # and the dispatch of each op, which kernels measured alone at their best do not show.
    # In fp32; `half_factor` the same in the half precision runs here default to (bf16, or
    # fp16 on a GPU without bf16; the other half precision takes it too), where the
    # matmuls' speed-up is not the ops' around them: on a CPU with AMX, bf16 matmuls ran
    # 4-6x fp32's and opt-125m's step 1.5x. 0: not measured (a CPU without bf16 units,
    # which runs in fp32 and would take seconds a run in bf16): fp32's stands for it.
    compute_factor: float = 1.0
    half_factor: float = 0.0
    # Seconds every micro-batch's forward and backward take beyond factor x their kernels'
    # forecast (`compute_seconds`), fitted with the factor on the decoder at two depths; in
    # fp32 and in that half precision. Negative where the shallow decoder ran faster than
    # the deep one's slope.
    compute_offset: float = 0.0
    half_offset: float = 0.0
    measured_at: str = ""  # ISO time
    seconds: float = 0.0  # how long the measurement took
    # Where the device's figures come from: "this machine's calibration", or a hardware profile's
    # published specs (engine.planning.hardware) beside this host's measured figures.
    source: str = "this machine's calibration"
    extra: dict = field(default_factory=dict)
    # What runs in `taught_for` (a precision) on this machine taught (`learn`), kept in a
    # file of its own beside this one: the correction, how many runs taught it, and the
    # uncorrected measured / forecast ratios of the last LEARNED_RUNS of them, oldest first.
    correction: float = 1.0
    learned_from: int = 0
    learned: list[float] = field(default_factory=list)
    taught_for: str = "fp32"

    def matmul_rate(self, precision: str, hidden: int) -> float:
        """FLOPs per second of this precision's matmuls at a model width of `hidden`,
        interpolated (in log width) between the measured widths, flat beyond them."""
        table = self.matmul.get(precision) or self.matmul["fp32"]
        widths = sorted(table)
        if hidden <= widths[0]:
            return table[widths[0]]
        if hidden >= widths[-1]:
            return table[widths[-1]]
        for lo, hi in zip(widths, widths[1:], strict=False):
            if lo <= hidden <= hi:
                t = (math.log(hidden) - math.log(lo)) / (math.log(hi) - math.log(lo))
                return table[lo] * (table[hi] / table[lo]) ** t
        return table[widths[-1]]

    def kernel_seconds(self, precision: str, hidden: int, flops: float, nbytes: float,
                       random: float = 0.0) -> float:
        """Seconds of kernels at the rates alone (no factor, no new memory): `flops` of
        matmuls at a model width of `hidden`, `nbytes` that other ops read and write, and
        `random` numbers drawn."""
        seconds = flops / self.matmul_rate(precision, hidden) + nbytes / self.elementwise
        return seconds + (random / self.random if self.random > 0 else 0.0)

    def factor(self, precision: str) -> float:
        """The compute factor of a step computed in `precision`."""
        if precision != "fp32" and self.half_factor > 0:
            return self.half_factor
        return self.compute_factor

    def compute_seconds(self, precision: str, kernels: float) -> float:
        """Seconds of a micro-batch's forward and backward whose kernels the rates forecast
        at `kernels` seconds: the factor times them, plus the offset; at least half the
        factor's alone (a model far smaller than the decoder the offset was fitted on)."""
        half = precision != "fp32" and self.half_factor > 0
        offset = self.half_offset if half else self.compute_offset
        scaled = self.factor(precision) * kernels
        return max(scaled + offset, scaled / 2)

    def fresh_seconds(self, nbytes: float) -> float:
        """Seconds that `nbytes` of new host memory cost beyond the writes into it: a copy's
        new buffer."""
        return nbytes / self.fresh_pages if self.fresh_pages > 0 else 0.0

    def activation_seconds(self, nbytes: float) -> float:
        """Seconds that `nbytes` of a forward's or backward's new host memory cost beyond
        the writes into it."""
        rate = self.activation_pages or self.fresh_pages
        return nbytes / rate if rate > 0 else 0.0

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["matmul"] = {k: {str(w): r for w, r in v.items()} for k, v in self.matmul.items()}
        out["format"] = FORMAT
        for learned in ("correction", "learned_from", "learned", "taught_for"):  # beside
            out.pop(learned)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        data = dict(data)
        data.pop("format", None)
        data["matmul"] = {k: {int(w): float(r) for w, r in v.items()}
                          for k, v in data["matmul"].items()}
        return cls(**data)
