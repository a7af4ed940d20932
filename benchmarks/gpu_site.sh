# Sourced by benchmarks/gpu_check.sh and gpu_check_nccl.sh: the repository root as the working
# folder, OUT and PYTHON with their defaults, and the package laid out as installed in a
# temporary folder on PYTHONPATH (kernels/ and integrations/ are its subpackages; no pip on a
# lent machine), removed at exit. $1: the file nvidia-smi's report goes to under $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
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
    nvidia-smi > "$OUT/$1" 2>&1
fi
