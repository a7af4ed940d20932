#!/usr/bin/env bash
# Final validation loss of the char-level GPT (examples/charlm.py) on 2 CPU ranks, uncompressed
# Adam against OneBitAdam variants: scale rule, block size, zero-variance mask. Same data order,
# seed and steps in every run. Usage: benchmarks/accuracy.sh [steps] [freeze_step]
# The seven runs' JSON go into one record appended to benchmarks/results/accuracy.jsonl
# (benchmarks/record.py); OUT_DIR=DIR also keeps each run's JSON in DIR as accuracy_<name>.json.
set -euo pipefail
invocation="$0${*:+ $*}"
cd "$(dirname "$0")/.."
steps=${1:-600}
freeze=${2:-120}
if [ -n "${OUT_DIR:-}" ]; then
  out=$OUT_DIR
  mkdir -p "$out"
else
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
files=()
run() {
  local name=$1; shift
  .venv/bin/torchrun --nproc_per_node 2 --log-dir /tmp/onebit-acc --redirects 3 \
    examples/train_torchrun.py --steps "$steps" --freeze-step "$freeze" \
    --eval-every "$steps" --json "$out/accuracy_$name.json" "$@" >/dev/null
  python3 -c "import json,sys; d=json.load(open('$out/accuracy_$name.json')); \
print(f\"{sys.argv[1]:24s} val {d['final_val_loss']:.4f}  sent {d['bytes_sent']/2**20:7.2f} MiB  \
dense {d['dense_bytes']/2**20:7.2f} MiB\")" "$name"
  files+=("$name=$out/accuracy_$name.json")
}
run adam --baseline
run frozen_exact --exact-momentum
run onebit_rms_2048 --scale rms --max-block 2048
run onebit_mean_2048 --scale mean --max-block 2048
run onebit_rms_256 --scale rms --max-block 256
run onebit_mean_256 --scale mean --max-block 256
run onebit_rms_nomask --scale rms --no-mask
.venv/bin/python benchmarks/record.py accuracy "$invocation" "${files[@]}"
