"""A machine with round speeds, for tests of the time forecast: what a calibration would
measure, without the measurement (up to 30 s)."""

from __future__ import annotations

from engine.planning.calibration import Calibration

GFLOP = 1e9


def fixed_calibration(key: str = "fixed", words: str = "a test machine") -> Calibration:
    """10 GFLOP/s fp32 matmuls (40 in bf16/fp16), 1 GB/s for everything that moves bytes,
    100 M AdamW elements per second on the host (400 M on the device), 10 µs per op; new
    host memory 250 MB/s beyond writing it (a fourth of a copy's rate: this machine's is a
    fifth)."""
    return Calibration(
        fingerprint=key, machine=words, device="simulated",
        matmul={"fp32": {768: 10 * GFLOP}, "bf16": {768: 40 * GFLOP},
                "fp16": {768: 40 * GFLOP}},
        elementwise=1e9, h2d=1e9, d2h=1e9, adamw_host=1e8, adamw_device=4e8,
        disk_read=1e9, disk_write=1e9, op_overhead=1e-5, fresh_pages=2.5e8,
        measured_at="2026-01-01T00:00:00+00:00", seconds=1.0,
    )
