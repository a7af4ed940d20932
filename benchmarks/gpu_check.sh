#!/usr/bin/env bash
# The GPU check, ready for the day a GPU is lent (docs/benchmarks.md, "GPU check"): on one GPU,
# in about 5 minutes (an estimate: no GPU has run it; the budget per part is in gpu_check.py's
# main), benchmarks/gpu_check.py runs the compiled Triton kernels against the torch reference
# (the CUDA counterpart of tests/test_kernels.py, which runs them in the interpreter), measures
# their GB/s against the device's copy bandwidth, runs OneBitAdam end to end with a host-sync
# count, device="cuda", and two gloo ranks sharing the GPU (the host syncs of a compression-stage
# step on each path); then benchmarks/memory.py gives the peak GPU memory per stage against
# Adam's. With two GPUs, benchmarks/gpu_check_nccl.sh is the NCCL check. No pip: the package is
# laid out as installed in a temporary folder (kernels/ and integrations/ are subpackages).
#
#   benchmarks/gpu_check.sh                       # OUT=gpu_check_out PYTHON=python3
#   DEVICE=cpu QUICK=1 TRITON_INTERPRET=1 PYTHON=.venv/bin/python benchmarks/gpu_check.sh
source "$(dirname "$0")/gpu_site.sh" machine.txt
"$PYTHON" -c "import sys, torch, triton; print(sys.version.split()[0], torch.__version__, \
triton.__version__)" >> "$OUT/machine.txt" 2>&1
"$PYTHON" benchmarks/gpu_check.py --device "${DEVICE:-cuda}" ${QUICK:+--quick} --out "$OUT" \
    2>&1 | tee "$OUT/gpu_check.log"
rc=$?
# Peak GPU memory per parameter of Adam and the 1-bit family, two gloo ranks sharing the GPU
# (issue 30; its record goes to $OUT/memory.jsonl).
ONEBIT_RESULTS_DIR="$OUT" "$PYTHON" benchmarks/memory.py --device "${DEVICE:-cuda}" \
    ${QUICK:+--dim 256 --layers 2} 2>&1 | tee "$OUT/memory.log"
rc=$(( rc || $? ))
echo "gpu_check.sh: ${SECONDS} s in all" | tee "$OUT/seconds.txt"
exit $rc
