#!/usr/bin/env bash
# Everything that needs a GPU, in one run of at most 8 minutes, from a clone of the repository:
#
#     bash benchmarks/gpu_check.sh
#
# 1. No NVIDIA GPU (nvidia-smi missing or failing): one line saying so, exit 1.
# 2. Setup: a venv ($GPU_CHECK_VENV, default $out/venv) with torch==2.13.0 (PyPI's Linux
#    wheel is the CUDA build) and this project (pip install -e '.[dev]'); torch must see CUDA.
# 3. The CUDA tests: pytest tests/engine/test_cuda.py.
# 4. The budget as the allocator sees it: benchmarks/budget_check.py (opt-350m, bf16, auto
#    with a margin of 0.9 under a 6 GiB cap: max_memory_reserved <= budget).
# 5. Overhead against plain PyTorch on the GPU, policies cuda/auto/cpu:
#    benchmarks/engine_overhead.py.
# 6. The laptop story: tuitrain run opt-1.3b --headless --steps 3 --precision bf16
#    --device-mem 6GiB, summarised by benchmarks/run_summary.py (step time, MFU, bytes moved).
#
# One line per check. The first failure prints the end of its log and exits 1; every log is
# kept in $out (GPU_CHECK_OUT, default /tmp/gpu-check).
#
# For the script's own tests: GPU_CHECK_NVIDIA_SMI replaces the nvidia-smi command, and
# GPU_CHECK_PYTHON names a Python that already has a CUDA torch and the project (no venv).
set -euo pipefail

cd "$(dirname "$0")/.."
out=${GPU_CHECK_OUT:-/tmp/gpu-check}
smi=${GPU_CHECK_NVIDIA_SMI:-nvidia-smi}
deadline=$((SECONDS + 480))
mkdir -p "$out"
unset TUITRAIN_SIMULATE  # the whole point is the real GPU

if ! gpu=$("$smi" --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null) \
        || [ -z "$gpu" ]; then
    echo "gpu_check: no NVIDIA GPU on this machine ($smi is missing or failed); nothing was checked" >&2
    exit 1
fi
echo "gpu: ${gpu%%$'\n'*}"

# check NAME LIMIT LOG COMMAND...: run COMMAND (at most LIMIT seconds, and never past the
# deadline) with its output in $out/LOG; stop everything, loudly, if it fails.
check() {
    local name=$1 limit=$2 log=$out/$3
    shift 3
    local left=$((deadline - SECONDS))
    if ((left < limit)); then limit=$left; fi
    if ((limit <= 0)); then
        echo "FAIL $name: out of time (the whole check has 8 minutes)"
        exit 1
    fi
    local start=$SECONDS
    if ! timeout "$limit" "$@" >"$log" 2>&1; then
        echo "FAIL $name after $((SECONDS - start)) s: $*"
        tail -n 25 "$log" | sed 's/^/    /'
        echo "    (full log: $log)"
        exit 1
    fi
}

if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
    py=$GPU_CHECK_PYTHON
else
    venv=${GPU_CHECK_VENV:-$out/venv}
    check "setup: venv" 60 setup.log python3 -m venv "$venv"
    check "setup: torch==2.13.0" 300 setup-torch.log "$venv/bin/pip" install torch==2.13.0
    check "setup: the project" 180 setup-project.log "$venv/bin/pip" install -e '.[dev]'
    py=$venv/bin/python
fi
check "setup: torch sees CUDA" 60 setup-cuda.log "$py" -c \
    'import torch, sys; ok = torch.cuda.is_available(); print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name() if ok else "no CUDA device"); sys.exit(0 if ok else 1)'
echo "ok setup: $(tail -n 1 "$out/setup-cuda.log")"

check "CUDA tests" 150 cuda-tests.txt "$py" -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py
echo "ok CUDA tests: $(tail -n 1 "$out/cuda-tests.txt")"

check "budget held" 120 budget.txt "$py" benchmarks/budget_check.py --budget 6GiB
echo "ok budget held: $(tail -n 1 "$out/budget.txt")"

check "overhead" 120 overhead.txt "$py" benchmarks/engine_overhead.py --rounds 8
echo "ok overhead vs plain PyTorch on the GPU: $(awk '
    $1 == "plain" { printf "plain %s s/step", $3 }
    $1 == "cuda" || $1 == "auto" || $1 == "cpu" { printf ", %s %sx", $1, $(NF-2) }
' "$out/overhead.txt")"

rm -f "$out/opt-1.3b.jsonl"
check "opt-1.3b bf16 under 6 GiB" 240 opt-1.3b.txt "$py" -m tuitrain run opt-1.3b --headless \
    --steps 3 --precision bf16 --device-mem 6GiB --metrics "$out/opt-1.3b.jsonl"
check "opt-1.3b summary" 60 opt-1.3b-summary.txt "$py" benchmarks/run_summary.py \
    "$out/opt-1.3b.jsonl"
echo "ok $(tail -n 1 "$out/opt-1.3b-summary.txt")"
echo "all checks passed in $SECONDS s (logs in $out)"
