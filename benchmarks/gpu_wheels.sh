#!/usr/bin/env bash
# Downloads, into .whl/ (or $1), the wheels benchmarks/gpu_check.sh installs on a GPU
# machine with no package registry: those listed in benchmarks/gpu_wheels.txt, built for
# that machine's CPython 3.12 on manylinux x86-64, and nothing else (--no-deps: the list
# names every one). Run it here, where pip reaches PyPI, before carrying .whl/ there.
#
#     bash benchmarks/gpu_wheels.sh [DIR]
set -euo pipefail

cd "$(dirname "$0")/.."
dir=${1:-.whl}
py=${GPU_WHEELS_PYTHON:-python3}
mapfile -t wanted < <(grep -v '^\s*\(#\|$\)' benchmarks/gpu_wheels.txt)
mkdir -p "$dir"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d "$dir" "${wanted[@]}"
echo "$(ls "$dir"/*.whl | wc -l) wheels in $dir, $(du -sh "$dir" | cut -f1)"
