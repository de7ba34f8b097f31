"""`tuitrain calibrate`: this machine's measured speeds, which the plan's time forecast uses.

Shows the cached calibration (engine.planning.calibration), measuring it first when this
machine has none, or when it was measured while the cores were busy and they are quiet now;
`--refresh` measures again (at most 30 s, said while it runs), and forgets what tunes taught
it (the correction its forecasts are multiplied by, one for each precision tunes ran in).
"""

from __future__ import annotations

import json
import os
import sys

from engine.config import format_size
from tuitrain.formatting import format_seconds


def calibrate_main(*, refresh: bool, as_json: bool) -> int:
    from engine.devices.device import uses_cuda
    from engine.planning.calibration import DTYPES, calibration_path, load_calibration
    from engine.planning.machine import busy
    from tuitrain.plan_forecast import machine_calibration
    from tuitrain.settings import Settings

    # What a run here computes in unless told: its correction leads the JSON.
    default = Settings().precision_for(simulated=not uses_cuda())
    cal = machine_calibration(refresh=refresh, precision=default,
                              say=lambda line: print(line, file=sys.stderr, flush=True))
    taught = {p: t for p in DTYPES
              if (t := load_calibration(cal.fingerprint, precision=p)) is not None
              and t.measured_at == cal.measured_at and t.learned_from}
    if as_json:
        learned = {"correction": cal.correction, "learned_from": cal.learned_from,
                   "learned": {p: {"correction": t.correction, "learned_from": t.learned_from}
                               for p, t in taught.items()}}
        json.dump({**cal.to_dict(), **learned}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"machine:     {cal.machine}")
    load = cal.extra.get("load")
    under = "" if load is None else f", at a load of {load:.1f} on {os.cpu_count()} cores"
    print(f"fingerprint: {cal.fingerprint}, measured {cal.measured_at} in "
          f"{format_seconds(cal.seconds)}{under}")
    if busy(load):
        print("             (the cores were busy: every figure may be slow; measured again "
              "once the machine is quiet)")
    print(f"device:      {cal.device}")
    for precision, table in cal.matmul.items():
        if precision == "fp16" and cal.device == "simulated":
            # The calibration gives fp16 bf16's figures on a CPU (not measured apart).
            print("matmul fp16: as bf16 (not measured apart on a CPU)")
            continue
        rates = ", ".join(f"{_flops(r)} at width {w}" for w, r in sorted(table.items()))
        print(f"matmul {precision}: {rates}")
    print(f"elementwise: {_bytes(cal.elementwise)} read and written")
    print(f"copies:      host to device {_bytes(cal.h2d)}, device to host {_bytes(cal.d2h)}")
    if cal.random:
        print(f"random:      {cal.random / 1e6:,.0f} M numbers/s drawn, beyond writing them "
              f"(dropout's masks)")
    if cal.fresh_pages:
        print(f"new memory:  {_bytes(cal.fresh_pages)} beyond writing it (each page faulted in, "
              f"zeroed, unmapped)"
              + (f"; a step's activations {_bytes(cal.activation_pages)}"
                 if cal.activation_pages else ""))
    print(f"AdamW:       {cal.adamw_host / 1e6:,.0f} M parameters/s on the host, "
          f"{cal.adamw_device / 1e6:,.0f} M/s on the device")
    disk = (f"read {_bytes(cal.disk_read)}, write {_bytes(cal.disk_write)}" if cal.disk_read
            else "not measured (the scratch folder could not be written)")
    if cal.disk_duplex:
        disk += f", {_bytes(cal.disk_duplex)} reading and writing at once (the update's)"
    print(f"disk:        {disk}")

    def fitted(factor: float, offset: float) -> str:
        if not offset:
            return f"x{factor:.2f}"
        return f"x{factor:.2f} {'+' if offset > 0 else '-'} {format_seconds(abs(offset))}"

    half = (f", {fitted(cal.half_factor, cal.half_offset)} in bf16" if cal.half_factor
            else "")
    print(f"decoder:     {fitted(cal.compute_factor, cal.compute_offset)} the rates' forecast "
          f"for a real decoder's forward and backward in fp32{half} (per micro-batch; "
          f"fitted at two depths)")
    if cal.op_overhead > 0:
        print(f"engine:      {format_seconds(cal.op_overhead)} per op (hooks and byte counting)")
    else:
        print("engine:      nothing per op beyond the decoder's factor (tiny's steps under the "
              "engine took no longer than that forecast)")
    learned = "; ".join(
        f"forecasts in {p} x{t.correction:.2f}, from the steps of {t.learned_from} "
        f"tune{'s' if t.learned_from != 1 else ''}" for p, t in taught.items())
    print(f"learned:     {learned + ' on this machine' if learned else 'nothing yet'} "
          f"(each `tuitrain tune` teaches the forecasts of its precision)")
    print(f"cached in {calibration_path(cal.fingerprint)}; `tuitrain calibrate --refresh` "
          f"measures again")
    return 0


def _flops(per_second: float) -> str:
    return f"{per_second / 1e12:.2f} TFLOPS" if per_second >= 1e12 else \
        f"{per_second / 1e9:.1f} GFLOPS"


def _bytes(per_second: float) -> str:
    return f"{format_size(int(per_second))}/s"
