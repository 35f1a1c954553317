#!/usr/bin/env bash
# The one script a GPU session runs on the lent device (see benchmarks/RESULTS.md):
#   run(command="bash benchmarks/device_check.sh", timeout_s=540)
# It uses the device image's python3 (jax with CUDA; no kiln install: PYTHONPATH=src/python),
# checks the Pallas kernel against the fp32 reference on fresh random inputs before timing each
# configuration (attention.py prints the error column), times attention (ours, XLA, cuDNN) and
# the 1.4B train step (xla vs pallas vs cudnn attention), prints the tables last and leaves JSON
# and logs under $OUT. Each part is bounded so a slow one cannot eat the whole lease.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src/python
OUT="${OUT:-/tmp/kiln-device}"
mkdir -p "${OUT}"

nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv >"${OUT}/gpu.txt" 2>&1
python3 -c 'import jax; print(jax.__version__, jax.devices())' >"${OUT}/jax.txt" 2>&1

# Causal and not, head dims 64/128, seq 1k-16k, bf16: the issue's table (and its 0.9x-cuDNN goal).
timeout 300 python3 benchmarks/attention.py --iters 10 --json "${OUT}/attention.json" \
  >"${OUT}/attention.txt" 2>&1
echo "attention.py exit $?" >>"${OUT}/attention.txt"

timeout 200 python3 benchmarks/train_step.py --model 1.4b --attention xla,pallas,cudnn \
  >"${OUT}/train_step.txt" 2>&1
echo "train_step.py exit $?" >>"${OUT}/train_step.txt"

cat "${OUT}/gpu.txt" "${OUT}/jax.txt"
tail -n 40 "${OUT}/attention.txt"
tail -n 12 "${OUT}/train_step.txt"
