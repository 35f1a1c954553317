#!/usr/bin/env bash
# The product's attention and train-step measurements on a GPU, in one command (under 10 min):
#   bash benchmarks/device_check.sh [SETTINGS.json]
# It uses the machine's python3 with jax for CUDA (no kiln install: PYTHONPATH=src/python).
# SETTINGS.json: a settings file ({head_dim: BlockSizes and LaunchParams fields}, a tuner's
# --json) used instead of the device's table entry.
#  1. attention.py: error against the fp32 reference, TF/s for ours / XLA / cuDNN, seq 2k-16k,
#     d 128, causal, no segment ids and the quickstart corpus's documents packed (docs layout),
#     forward and forward+backward.
#  2. ncu (hardware counters, clocks left alone) on one forward+backward of ours: speed of light,
#     occupancy, launch stats (registers, shared memory) and warp state per kernel.
#  3. train_step.py: the 1.4B train step with pallas, then cudnn attention (each in its own
#     process), one document per row and the docs layout, first step cold and warm from the
#     compilation cache, MFU in both conventions. The pallas run also profiles 2 steps per layout
#     (traces under $OUT/profile) and prints where the step goes, by category; --profile turns
#     XLA's command buffers off for that process (the cudnn run keeps them).
# Each part has its own time limit (together 395 s) and writes as it goes; everything goes under
# $OUT (default /tmp/kiln-device), and the tables are printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src/python:benchmarks PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/kiln-device}"
mkdir -p "${OUT}"
settings=()
[[ $# -gt 0 ]] && settings=(--block-sizes "$1")

{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv
  python3 -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices())'
} >"${OUT}/env.txt" 2>&1

timeout 125 python3 benchmarks/attention.py ${settings[@]+"${settings[@]}"} \
  --seqs 2048 4096 8192 16384 --head-dims 128 --causal true --layouts none docs \
  --json "${OUT}/attention.json" >"${OUT}/attention.txt" 2>&1
echo "attention.py exit $?" >>"${OUT}/attention.txt"

ncu_sections=(--section SpeedOfLight --section Occupancy --section LaunchStats
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats)
timeout 40 ncu --clock-control none --kernel-name regex:kiln_flash --launch-count 3 \
  "${ncu_sections[@]}" python3 benchmarks/attention_once.py ${settings[@]+"${settings[@]}"} \
  >"${OUT}/ncu.txt" 2>&1
echo "ncu exit $?" >>"${OUT}/ncu.txt"

for attention in pallas cudnn; do
  limit=110 profile=()
  if [[ ${attention} == pallas ]]; then  # 2 more steps per layout, traced, then read
    limit=120 profile=(--profile "${OUT}/profile" --profile-steps 2)
  fi
  timeout "${limit}" python3 benchmarks/train_step.py --model 1.4b --attention "${attention}" \
    --layouts ones docs --steps 5 --compile-cache "${OUT}/jax-cache-${attention}" \
    ${profile[@]+"${profile[@]}"} ${settings[@]+"${settings[@]}"} >>"${OUT}/train_step.txt" 2>&1
  echo "train_step.py --attention ${attention} exit $?" >>"${OUT}/train_step.txt"
done

cat "${OUT}/env.txt"
grep -v "^  ours\|^  xla\|^  cudnn\|Warning\|warn" "${OUT}/attention.txt" | tail -n 50
grep -E "kiln_flash|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|exit" \
  "${OUT}/ncu.txt" | head -n 36
grep -v "Warning\|warn" "${OUT}/train_step.txt" | tail -n 60
