#!/usr/bin/env bash
# Device check of the fused statistics on one CUDA GPU, in under 5 minutes (an H200: about 3).
#
#   bash benchmarks/gpu_check.sh [--wheels DIR] [--dry-run]
#
# 1. Installs what is missing, and nothing else: a CUDA build of torch if python3's torch has no CUDA
#    (pip install torch==2.13.0: PyPI's Linux wheel is the CUDA build), then this project
#    (pip install -e ., which brings DeepSpeed 0.19.8 and its requirements), and pytest and triton if
#    missing. --wheels DIR installs from a folder of wheels and sdists instead of an index (machines
#    without a network).
# 2. Runs the kernels' tests on CUDA (tests/test_fused_stats.py): first the Triton kernel compiled for the GPU
#    (10,000 runs and 50M elements included), which must pass with none skipped: otherwise the script ends with
#    exit 1 after the benchmarks; then the host kernel, whose failures are reported and tolerated (it only
#    serves host partitions, CPU offload).
# 3. Runs the statistics alone, 1M to 500M fp32 elements, 12 to 10,000 buckets: one read, DeepSpeed's
#    norm, the stock operators and the fused kernel in one run (benchmarks/fused_alone.py --device cuda).
# 4. Runs the step-time cost on a GPT of about 300M parameters, bf16, ZeRO-1 and ZeRO-2, one rank
#    (benchmarks/gpu_step_time.py).
# 5. Runs the per-step cost ledger: host syncs, allocations and time inside the call sites per family and
#    mode, and the Megatron hook's (benchmarks/ledger.py --device cuda, 5 timed steps a mode).
# Tables go to benchmarks/results/gpu/: tests_triton.txt, tests.txt, fused_statistics.{md,json}, step_time.{md,json},
# ledger.{md,json} (git keeps the .md tables; the .json raw outputs are ignored).
#
# --dry-run checks this script's logic on a machine without a GPU: it installs nothing and runs the same
# steps on the host with small sizes, writing into a temporary folder instead.
set -euo pipefail
cd "$(dirname "$0")/.."

dry_run=0
wheels=""
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --wheels) wheels="$(cd "$2" && pwd)"; shift ;;
        *) echo "usage: $0 [--wheels DIR] [--dry-run]" >&2; exit 2 ;;
    esac
    shift
done
python=python3
pip_from=()
if [ -n "$wheels" ]; then pip_from=(--no-index --find-links "$wheels"); fi
step() { echo "== $(date +%T) $*"; }

if [ "$dry_run" = 1 ]; then
    out="$(mktemp -d)"
    device=cpu
    step "dry run on the host: results into $out"
else
    out=benchmarks/results/gpu
    device=cuda
    if ! "$python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        step "installing a CUDA build of torch"
        "$python" -m pip install -q "${pip_from[@]}" torch==2.13.0
        "$python" -c "import torch; assert torch.cuda.is_available(), 'torch sees no CUDA device'"
    fi
    if ! "$python" -c "import deepspeed_patch, deepspeed" 2>/dev/null; then
        step "installing the project"
        "$python" -m pip install -q "${pip_from[@]}" -e .
    fi
    if ! "$python" -c "import pytest, triton" 2>/dev/null; then  # CUDA builds of torch bring triton
        step "installing pytest and triton"
        "$python" -m pip install -q "${pip_from[@]}" pytest triton
    fi
    mkdir -p "$out"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

step "Triton kernel tests ($device)"
triton_ok=1
"$python" -m pytest -q -p no:cacheprovider -rs -k triton tests/test_fused_stats.py 2>&1 | tee "$out/tests_triton.txt" \
    || triton_ok=0
# on CUDA every Triton case runs compiled for the GPU: a skip (no triton, no device) is a failure here
if [ "$device" = cuda ] && tail -n 1 "$out/tests_triton.txt" | grep -q skipped; then triton_ok=0; fi
if [ "$triton_ok" = 0 ]; then step "the Triton kernel's tests failed or skipped (see $out/tests_triton.txt)"; fi

step "host kernel tests ($device)"
"$python" -m pytest -q -p no:cacheprovider -k "not triton" tests/test_fused_stats.py 2>&1 | tee "$out/tests.txt" \
    || step "some host kernel tests failed (see $out/tests.txt); the benchmarks go on"

step "statistics alone ($device)"
if [ "$device" = cuda ]; then
    "$python" benchmarks/fused_alone.py --device cuda --out "$out"
else
    "$python" benchmarks/fused_alone.py --device cpu --quick --out "$out"
fi

step "step time ($device)"
"$python" benchmarks/gpu_step_time.py --device "$device" --out "$out"

step "cost ledger ($device)"
if [ "$device" = cuda ]; then
    "$python" benchmarks/ledger.py --device cuda --steps 5 --out "$out"
else
    "$python" benchmarks/ledger.py --device cpu --quick --out "$out"
fi

step "done: $out"
ls -l "$out"
if [ "$triton_ok" = 0 ]; then
    step "FAILED: the Triton kernel on $device (see $out/tests_triton.txt)"
    exit 1
fi
