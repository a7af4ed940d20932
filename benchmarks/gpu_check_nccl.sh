#!/usr/bin/env bash
# The 2-GPU NCCL check, for when two GPUs are lent (docs/benchmarks.md, "GPU check"):
# benchmarks/gpu_check_nccl.py spawns two ranks on cuda:0 and cuda:1 with backend nccl: the DDP
# hook path with comm_timeout None and 60 (lockstep, time per step), and a hung rank (does
# rank 0 raise CommunicationError before NCCL's watchdog ends it?). About 2 minutes (an
# estimate). No pip: the package is laid out as installed in a temporary folder, as
# benchmarks/gpu_check.sh does.
#
#   benchmarks/gpu_check_nccl.sh                  # OUT=gpu_check_out PYTHON=python3
#   DEVICE=cpu PYTHON=.venv/bin/python benchmarks/gpu_check_nccl.sh    # the script, on gloo
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
SITE=$(mktemp -d)
trap 'rm -rf "$SITE"' EXIT
mkdir -p "$SITE/onebit_plugin"
cp -r onebit_plugin/. "$SITE/onebit_plugin/"
cp -r kernels "$SITE/onebit_plugin/kernels"
cp -r integrations "$SITE/onebit_plugin/integrations"
export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1
if [ "${DEVICE:-cuda}" = cuda ]; then
    unset TRITON_INTERPRET
    nvidia-smi > "$OUT/machine_nccl.txt" 2>&1
    BACKEND=nccl
else
    BACKEND=gloo
fi
"$PYTHON" benchmarks/gpu_check_nccl.py --device "${DEVICE:-cuda}" --backend "$BACKEND" \
    --out "$OUT/gpu_check_nccl.json" 2>&1 | tee "$OUT/gpu_check_nccl.log"
