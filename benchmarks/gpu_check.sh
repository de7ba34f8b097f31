#!/usr/bin/env bash
# Everything that needs a GPU, in one short run: the CUDA tests, the overhead benchmark on
# the GPU, and the laptop story (opt-1.3b, bf16, a 6 GiB budget) for three steps.
# Run from the repository root with the project installed: bash benchmarks/gpu_check.sh
set -u
out=${OUT:-/tmp/gpu-check}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python -m pytest -q tests/engine/test_cuda.py 2>&1 | tail -25 | tee "$out/cuda-tests.txt"
python benchmarks/engine_overhead.py --rounds 8 2>&1 | tail -8 | tee "$out/overhead.txt"
tuitrain run opt-1.3b --headless --steps 3 --device-mem 6GiB --metrics "$out/opt-1.3b.jsonl" \
    2>&1 | tail -15 | tee "$out/opt-1.3b.txt"
