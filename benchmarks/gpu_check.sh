#!/usr/bin/env bash
# Everything that needs a GPU, in one run of at most 8 minutes, on a machine that reaches no
# package registry (the results in benchmarks/README.md came from one H200 with its own
# Python 3.12 and torch 2.11.0+cu130, not the torch this project is developed with):
#
#     bash benchmarks/gpu_wheels.sh          # here, where pip works: the wheels, into .whl/
#     bash benchmarks/gpu_check.sh --dry-run # here: the wheels it needs, the size it brings,
#                                            # and every command it would run
#     bash benchmarks/gpu_check.sh --dry-run --start  # also starts each Python piece here
#                                            # (its --dry-run; pytest --collect-only): minutes
#     bash benchmarks/gpu_check.sh           # there, from the repository root, .whl/ beside it
#
# Setup uses the machine's own python3 (GPU_CHECK_PYTHON): the wheels listed in
# benchmarks/gpu_wheels.txt (what the project imports that the machine lacks) are installed
# with `pip install --no-index --target` into a folder (GPU_CHECK_SITE) put first on
# PYTHONPATH, the repository after it. Then, one line each:
#   setup      the wheels installed; torch's version, its CUDA, the device
#   bandwidth  host<->device through the engine's staging ring against a pinned
#              non_blocking copy of the same GiB (benchmarks/bandwidth.py)
#   CUDA tests pytest tests/engine/test_cuda.py
#   budget     the budget held by the allocator's count plus the CUDA context, for policies
#              cuda, auto and cpu, and opt-1.3b bf16 under 2 GiB (benchmarks/budget_check.py)
#   overhead   against plain PyTorch, a synchronize around every system's step, with and
#              without the live-byte counter (benchmarks/engine_overhead.py --uncounted), on
#              opt-125m and on the small OPT
#   evaluation Engine.evaluate against a plain no-grad forward, and the bytes it copies
#              (benchmarks/evaluation.py)
#   opt-1.3b   bf16, 8 x 1024, checkpointing: step time and its split, tokens/s, MFU against
#              the measured bf16 matmul peak, and the time model's forecast for it with this
#              machine's calibration (tuitrain run, then benchmarks/run_summary.py --forecast)
# Every check runs even when an earlier one failed; a failure prints its log's tail; the
# exit status is the number of failed checks (0: all passed). Results go to $OUT (default
# /tmp/gpu-check; GPU_CHECK_OUT also names it), in 8 files: summary.txt (the lines printed)
# and the logs with the raw figures (setup.log holds the bandwidth's too; step.jsonl: the
# run's metrics).
#
# For the script's own tests: GPU_CHECK_NVIDIA_SMI replaces nvidia-smi, GPU_CHECK_WHEELS
# the wheel folder, GPU_CHECK_DRY_RUN=1 is --dry-run.
set -uo pipefail

cd "$(dirname "$0")/.."
repo=$PWD
dry=${GPU_CHECK_DRY_RUN:-0}
start=0
for arg in "$@"; do
    case $arg in
        --dry-run) dry=1 ;;
        --start) start=1 ;;
        *) echo "gpu_check: unknown argument $arg (it takes --dry-run and --start)" >&2
           exit 2 ;;
    esac
done
if [ "$start" = 1 ] && [ "$dry" != 1 ]; then
    echo "gpu_check: --start goes with --dry-run" >&2
    exit 2
fi
out=${OUT:-${GPU_CHECK_OUT:-/tmp/gpu-check}}
py=${GPU_CHECK_PYTHON:-python3}
smi=${GPU_CHECK_NVIDIA_SMI:-nvidia-smi}
whl=${GPU_CHECK_WHEELS:-.whl}
site=${GPU_CHECK_SITE:-/tmp/gpu-check-site}
scratch=${GPU_CHECK_SCRATCH:-/tmp/gpu-check-scratch}  # caches and config, never ~/.cache
limit_mib=64  # what may travel to the GPU machine: the tree and the wheels together
deadline=$((SECONDS + 480))
failed=0

# --- the wheels ----------------------------------------------------------------------------
mapfile -t wanted < <(grep -v '^\s*\(#\|$\)' benchmarks/gpu_wheels.txt)
wheels=()
missing=()
for spec in "${wanted[@]}"; do
    name=${spec%%==*} version=${spec#*==}
    file=$(ls "$whl/${name//-/_}-$version-"*.whl 2>/dev/null | head -n 1)
    if [ -n "$file" ]; then wheels+=("$file"); else missing+=("$spec"); fi
done

if [ "$dry" = 1 ]; then
    echo "dry run: nothing is installed or run"
    echo "wheels: ${#wanted[@]} from benchmarks/gpu_wheels.txt, for CPython 3.12 manylinux x86-64, in $whl"
    for spec in "${wanted[@]}"; do
        if [[ " ${missing[*]} " == *" $spec "* ]]; then
            echo "  $spec MISSING (bash benchmarks/gpu_wheels.sh)"
        else
            echo "  $spec"
        fi
    done
    tree=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null \
        | awk '{ s += $1 } END { print s + 0 }')
    brought=$( ((${#wheels[@]})) && stat -c %s "${wheels[@]}" | awk '{ s += $1 } END { print s + 0 }' || echo 0)
    total=$((tree + brought))
    awk -v t="$tree" -v w="$brought" -v l="$limit_mib" 'BEGIN { m = 1048576
        printf "size: tree %.1f MiB + wheels %.1f MiB = %.1f MiB (limit %d MiB)\n", t / m, w / m, (t + w) / m, l }'
    if ((total > limit_mib * 1048576)); then
        echo "gpu_check: the tree and the wheels are over $limit_mib MiB" >&2
        failed=$((failed + 1))
    fi
    if ((${#missing[@]})); then
        echo "gpu_check: ${#missing[@]} wheels missing from $whl: run bash benchmarks/gpu_wheels.sh" >&2
        failed=$((failed + 1))
    fi
else
    if ! gpu=$("$smi" --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null) \
            || [ -z "$gpu" ]; then
        echo "gpu_check: no NVIDIA GPU on this machine ($smi is missing or failed); nothing was checked" >&2
        exit 1
    fi
    mkdir -p "$out" "$scratch"
    : >"$out/summary.txt"
    for log in setup.log cuda-tests.log budget.log overhead.log evaluation.log step.log; do
        : >"$out/$log"
    done
    rm -f "$out/step.jsonl"
    echo "gpu: ${gpu%%$'\n'*}" | tee -a "$out/summary.txt"
fi

unset TUITRAIN_SIMULATE  # the whole point is the real GPU
export PYTHONPATH="$site:$repo" PYTHONUNBUFFERED=1
export TUITRAIN_CACHE="$scratch/cache" TUITRAIN_CONFIG="$scratch/config"

say() { echo "$*" | tee -a "$out/summary.txt"; }

# run NAME LIMIT LOG COMMAND...: COMMAND's output is appended to $out/LOG; it gets at most
# LIMIT seconds, and never runs past the 8 minutes. Returns its status; on failure says so,
# with the log's tail. In a dry run it only says what it would run.
run() {
    local name=$1 limit=$2 log=$3
    shift 3
    if [ "$dry" = 1 ]; then
        echo "would run $name (at most $limit s, log $log): $*"
        dry_start "$@"
        return
    fi
    local left=$((deadline - SECONDS))
    if ((left < limit)); then limit=$left; fi
    if ((limit <= 0)); then
        say "FAIL $name: not run, the 8 minutes were spent"
        return 1
    fi
    local start=$SECONDS
    echo "\$ $*" >>"$out/$log"
    if ! timeout "$limit" "$@" >>"$out/$log" 2>&1; then
        say "FAIL $name after $((SECONDS - start)) s: $*"
        tail -n 25 "$out/$log" | sed 's/^/    /' | tee -a "$out/summary.txt"
        return 1
    fi
}

# dry_start COMMAND...: with --start, whether COMMAND's Python piece starts here (a script
# with its --dry-run, pytest collecting); other commands are only shown.
dry_start() {
    [ "$start" = 1 ] || return 0
    local try
    case "${2:-} ${3:-}" in
        *.py*) try=("$@" --dry-run) ;;
        "-m pytest") try=("$@" --collect-only -q) ;;
        *) return 0 ;;
    esac
    local log
    log=$(mktemp)
    if timeout 600 "${try[@]}" >"$log" 2>&1; then
        echo "    starts: $(grep -v "^\s*$" "$log" | tail -n 1)"
    else
        echo "    FAIL to start: ${try[*]}"
        tail -n 15 "$log" | sed 's/^/    /'
        rm -f "$log"
        return 1
    fi
    rm -f "$log"
}

# check NAME LIMIT LOG COMMAND...: run, then one line: ok NAME: the log's last line.
check() {
    local name=$1 log=$3
    if run "$@"; then
        [ "$dry" = 1 ] || say "ok $name: $(tail -n 1 "$out/$log")"
    else
        failed=$((failed + 1))
    fi
}

if ((${#wheels[@]})) || [ "$dry" = 1 ]; then
    setup=(run wheels 60 setup.log "$py" -m pip install -q --no-index --no-deps --no-compile
           --no-cache-dir --upgrade --target "$site" "${wheels[@]:-$whl/*.whl}")
    "${setup[@]}" || failed=$((failed + 1))
fi
check setup 60 setup.log "$py" benchmarks/gpu_env.py
check bandwidth 40 setup.log "$py" benchmarks/bandwidth.py --gib 1
check "CUDA tests" 150 cuda-tests.log "$py" -m pytest -q -p no:cacheprovider tests/engine/test_cuda.py
check budget 120 budget.log "$py" benchmarks/budget_check.py
check overhead 60 overhead.log "$py" benchmarks/engine_overhead.py --rounds 6 --uncounted
check "overhead, small OPT" 45 overhead.log "$py" benchmarks/engine_overhead.py --model small-opt \
    --rounds 6 --uncounted
check evaluation 45 evaluation.log "$py" benchmarks/evaluation.py --rounds 3 --batches 3 --threads 4
if run "opt-1.3b run" 110 step.log "$py" -m tuitrain run opt-1.3b --headless --steps 8 \
        --batch-size 8 --seq-len 1024 --precision bf16 --checkpointing \
        --metrics "$out/step.jsonl"; then
    check "opt-1.3b bf16 8x1024" 90 step.log "$py" benchmarks/run_summary.py "$out/step.jsonl" \
        --forecast
else
    failed=$((failed + 1))
fi

if [ "$dry" = 1 ]; then
    echo "dry run: $failed problems"
else
    say "$failed checks failed, $SECONDS s (results in $out)"
fi
exit "$failed"
