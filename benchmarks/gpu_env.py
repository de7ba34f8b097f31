"""What a GPU run's results come from: Python, torch and its CUDA, the device, textual.

    python benchmarks/gpu_env.py [--dry-run]

One line; exits 1 when torch sees no CUDA device (or the project does not import), so that
benchmarks/gpu_check.sh says at once that the rest cannot mean anything. `--dry-run`
imports everything and prints the line without asking for a device.
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="import only; no device needed")
    args = ap.parse_args(argv)
    import pydantic
    import textual
    import torch

    import engine  # noqa: F401 - the project must import with the machine's packages
    import tuitrain.cli  # noqa: F401

    ok = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if ok else "no CUDA device"
    print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA "
          f"{torch.version.cuda}), {device}, textual {textual.__version__}, pydantic "
          f"{pydantic.VERSION}")
    return 0 if ok or args.dry_run else 1


if __name__ == "__main__":
    sys.exit(main())
