#!/usr/bin/env bash
# The lab's device run (under 10 min): the tuner on a GPU, each Hopper (Mosaic GPU) kernel against
# the Triton kernel it would replace.
#   bash lab/device_check.sh
# It uses the machine's python3 with jax for CUDA (no kiln install: PYTHONPATH set below).
# kiln_lab.attention_tune at causal, seq 4096, d=128: the Triton kernels at the table's settings
# only (--triton-candidates 1, the baselines), the Triton fused-dQ backward, the Hopper fused
# backward, each Hopper kernel against its Triton one, and the faster fused backward against
# dK/dV + dQ; every candidate checked against the fp32 reference before it is timed. Each Hopper
# stage runs in its own process, stopped after --stage-timeout (45 s), so one that hangs or
# breaks its CUDA context costs its own stage. Then its context rows (cuDNN, jax's kernels).
# Everything goes under $OUT (default /tmp/kiln-lab-device); tuned.json is the winning layout.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src/python:benchmarks:lab PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/kiln-lab-device}"
mkdir -p "${OUT}"

{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv
  python3 -c 'import jax; print("jax", jax.__version__, jax.devices())'
  # Which ptxas compiles the kernels here (hopper_compile.py's numbers are from 13.5.37).
  python3 -c 'from jax._src import lib; print("jax cuda_path", lib.cuda_path)'
  for ptxas in "$(command -v ptxas)" /usr/local/cuda/bin/ptxas; do
    [[ -x "${ptxas}" ]] && echo "${ptxas}: $("${ptxas}" --version | grep release)"
  done
} >"${OUT}/env.txt" 2>&1

timeout 480 python3 -m kiln_lab.attention_tune --head-dims 128 --triton-candidates 1 \
  --json "${OUT}/tuned.json" >"${OUT}/tune.txt" 2>&1
echo "attention_tune exit $?" >>"${OUT}/tune.txt"
# A Hopper stage's process outlives the tuner only if the tuner died first: none may hold the GPU.
pkill -KILL -f "kiln_lab.attention_tune --stage" && echo "killed a leftover Hopper stage" >>"${OUT}/tune.txt"

cat "${OUT}/env.txt"
grep -E "tuned d=|forward:|backward:|fused:|hopper|jax |cudnn|ours \(tuned\)|exit" "${OUT}/tune.txt"
