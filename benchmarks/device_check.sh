#!/usr/bin/env bash
# The one script a GPU session runs on the lent device (see benchmarks/RESULTS.md):
#   run(command="bash benchmarks/device_check.sh", timeout_s=590)
# It uses the device image's python3 (jax with CUDA; no kiln install: PYTHONPATH=src/python).
#  1. attention_tune.py: the Hopper fused backward (FlashAttention-3's, dQ by TMA reduce-add)
#     against the Triton fused one, each Hopper (Mosaic GPU) kernel against its Triton one, and
#     the faster fused backward against dK/dV + dQ (causal, seq 4096, d=128: the goal's head
#     dim, so d=64 keeps the table's entry), every candidate checked against the fp32
#     reference before it is timed. The Triton kernels were tuned on the H200 on 2026-11-30
#     (RESULTS.md): only the table's setting is timed again, as the baseline
#     (--triton-candidates 1), so the 14 Hopper candidates get the time. None of the Hopper
#     kernels has run on a device before: each runs in its own process, stopped after
#     --stage-timeout (45 s), so one that hangs or breaks its CUDA context costs its own stage.
#  2. attention.py with the tuned sizes: error vs fp32 reference, TF/s for ours / XLA / cuDNN,
#     seq 1k-16k, d 128/64, causal and not, forward and forward+backward.
#  3. ncu (hardware counters, clocks left alone) on one forward+backward of ours: speed of light,
#     occupancy, launch stats (registers, shared memory) and warp state per kernel, whose rules
#     name the dominant stall reason (the dK/dV and dQ kernels run a copy of their code per
#     compute warpgroup: "No Instruction" stalls would mean the instruction cache pays for it,
#     RESULTS.md).
#  4. train_step.py: the 1.4B train step with pallas (tuned) and cudnn attention (xla measured:
#     17.0k tokens/s, benchmarks/RESULTS.md).
# Each part has its own time limit (together 580 s, under the 600 s call limit) so a slow one
# cannot eat the lease; each writes as it goes.
# Tables last; everything under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src/python PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/kiln-device}"
mkdir -p "${OUT}"

{
  nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,driver_version --format=csv
  python3 -c 'import jax, flax, optax; print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__, jax.devices())'
  # Which ptxas compiles the kernels here (hopper_compile.py's numbers are from 13.5.37).
  python3 -c 'from jax._src import lib; print("jax cuda_path", lib.cuda_path)'
  for ptxas in "$(command -v ptxas)" /usr/local/cuda/bin/ptxas; do
    [[ -x "${ptxas}" ]] && echo "${ptxas}: $("${ptxas}" --version | grep release)"
  done
} >"${OUT}/env.txt" 2>&1

timeout 230 python3 benchmarks/attention_tune.py --head-dims 128 --triton-candidates 1 \
  --json "${OUT}/tuned.json" >"${OUT}/tune.txt" 2>&1
echo "attention_tune.py exit $?" >>"${OUT}/tune.txt"
# A Hopper stage's process outlives the tuner only if the tuner died first: none may hold the GPU.
pkill -KILL -f "attention_tune.py --stage" && echo "killed a leftover Hopper stage" >>"${OUT}/tune.txt"
tuned=()
[[ -f "${OUT}/tuned.json" ]] && tuned=(--block-sizes "${OUT}/tuned.json")

timeout 160 python3 benchmarks/attention.py ${tuned[@]+"${tuned[@]}"} --json "${OUT}/attention.json" \
  >"${OUT}/attention.txt" 2>&1
echo "attention.py exit $?" >>"${OUT}/attention.txt"

ncu_sections=(--section SpeedOfLight --section Occupancy --section LaunchStats
  --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats)
timeout 50 ncu --clock-control none --kernel-name regex:kiln_flash --launch-count 3 \
  "${ncu_sections[@]}" python3 benchmarks/attention_once.py ${tuned[@]+"${tuned[@]}"} \
  >"${OUT}/ncu.txt" 2>&1
echo "ncu exit $?" >>"${OUT}/ncu.txt"

timeout 140 python3 benchmarks/train_step.py --model 1.4b --attention pallas,cudnn \
  --steps 5 ${tuned[@]+"${tuned[@]}"} >"${OUT}/train_step.txt" 2>&1
echo "train_step.py exit $?" >>"${OUT}/train_step.txt"

cat "${OUT}/env.txt"
grep -E "tuned d=|forward:|backward:|fused:|hopper|jax |cudnn|ours \(tuned\)|exit" "${OUT}/tune.txt"
grep -v "^  ours\|^  xla\|^  cudnn\|Warning\|warn" "${OUT}/attention.txt" | tail -n 50
grep -E "kiln_flash|Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|exit" \
  "${OUT}/ncu.txt" | head -n 36
tail -n 8 "${OUT}/train_step.txt"
