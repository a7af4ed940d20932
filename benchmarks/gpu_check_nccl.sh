#!/usr/bin/env bash
# The 2-GPU NCCL check, for when two GPUs are lent (docs/benchmarks.md, "GPU check"):
# benchmarks/gpu_check_nccl.py spawns two ranks on cuda:0 and cuda:1 with backend nccl: the DDP
# hook path with comm_timeout None and 60 (lockstep, time per step), the two-level topology's
# exchanges with both GPUs as one host (exact mean, identical ranks), and a hung rank (does
# rank 0 raise CommunicationError before NCCL's watchdog ends it?). About 2 minutes (an
# estimate). No pip: the package is laid out as installed in a temporary folder, as
# benchmarks/gpu_check.sh does.
#
#   benchmarks/gpu_check_nccl.sh                  # OUT=gpu_check_out PYTHON=python3
#   DEVICE=cpu PYTHON=.venv/bin/python benchmarks/gpu_check_nccl.sh    # the script, on gloo
source "$(dirname "$0")/gpu_site.sh" machine_nccl.txt
BACKEND=$([ "${DEVICE:-cuda}" = cuda ] && echo nccl || echo gloo)
"$PYTHON" -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, \
triton.__version__)" >> "$OUT/machine_nccl.txt" 2>&1
# Further arguments go to gpu_check_nccl.py (--parts, --steps, --hang-timeout, ...).
"$PYTHON" benchmarks/gpu_check_nccl.py --device "${DEVICE:-cuda}" --backend "$BACKEND" \
    --out "$OUT/gpu_check_nccl.json" "$@" 2>&1 | tee "$OUT/gpu_check_nccl.log"
