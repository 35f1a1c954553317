#!/usr/bin/env bash
# The product's measurements on one TPU v5e, a part per command (each under 10 min):
#   bash benchmarks/tpu_check.sh tune|attention|training|steps|profile...
# It uses the machine's python3 and JAX (no kiln install: PYTHONPATH gets src/python), with flax
# and optax from the machine's own package index. Everything goes under $OUT (default
# /tmp/kiln-tpu), and each part prints its table last.
#  tune:      benchmarks/attention.py --tune: ours' tiles (split or fused dQ) and splash's chosen
#             by measurement at seq 4096, then the attention part's sweep with them; the winners
#             go to $OUT/tuned.json, which later parts of the run use (TILES=FILE: an earlier's).
#  attention: benchmarks/attention.py, ours (the table's v5e tiles) vs splash (its tuned tiles)
#             vs pallas.ops.tpu.flash_attention, seq 2k-8k, d 128, GQA 1:1 and 4:1, causal, no
#             segment ids and packed documents, errors against the fp32 reference.
#  training:  benchmarks/same_training.py, 100 steps of one model with Kiln's kernel and with
#             XLA attention on the TPU, XLA on the CPU, and the kernel resumed after step 50:
#             the loss differences against the kernel's run.
#  steps:     benchmarks/train_step.py rows (one process each): 470M with XLA attention (full
#             remat), 470M with the kernel at save_dots batch 4, and at batch 8 in 2 microbatches,
#             1B with full remat.
#  profile:   the 470M save_dots batch-4 row under jax.profiler: where its step goes by category;
#             the trace comes back gzipped as $OUT/trace.xplane.pb.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/kiln-tpu}"
mkdir -p "${OUT}"
if ! python3 -c 'import flax, optax' 2>/dev/null; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
    --index-url file:///opt/pypi/simple --target /tmp/site flax optax >"${OUT}/pip.txt" 2>&1
fi
export PYTHONPATH="${PYTHONPATH:-}:/tmp/site:${PWD}/src/python:${PWD}/src/contract:${PWD}/benchmarks"
export PYTHONUNBUFFERED=1
parts=("$@")
tiles=()  # TILES: a tuned.json of an earlier tune part (else this run's, if it tunes)
[[ -n "${TILES:-}" ]] && tiles=(--block-sizes "${TILES}")
quiet() { grep -v "Warning\|warn\|^  File\|^    " "$1" | cut -c1-220; }

for part in "${parts[@]}"; do
  case "${part}" in
    tune | attention)
      tune=()
      [[ "${part}" == tune ]] && tune=(--tune --tune-json "${OUT}/tuned.json")
      timeout 560 python3 benchmarks/attention.py --seqs 2048 4096 8192 --head-dims 128 \
        --groups 1 4 --causal true --layouts none docs --json "${OUT}/${part}.json" "${tune[@]}" \
        >"${OUT}/${part}.txt" 2>&1
      echo "attention.py exit $?" >>"${OUT}/${part}.txt"
      [[ "${part}" == tune && -f "${OUT}/tuned.json" ]] && tiles=(--block-sizes "${OUT}/tuned.json")
      quiet "${OUT}/${part}.txt" | grep -v "^  ours\|^  splash\|^  jax_flash" | tail -n 60
      ;;
    training)
      for run in "pallas" "xla" "pallas --resume-at 50"; do
        name="tpu-${run// /}"
        timeout 100 python3 benchmarks/same_training.py --attention ${run} \
          --out "${OUT}/${name}.json" >>"${OUT}/training.txt" 2>&1
      done
      JAX_PLATFORMS=cpu timeout 100 python3 benchmarks/same_training.py --attention xla \
        --out "${OUT}/cpu-xla.json" >>"${OUT}/training.txt" 2>&1
      python3 benchmarks/same_training.py --compare "${OUT}"/tpu-pallas.json \
        "${OUT}"/tpu-xla.json "${OUT}"/cpu-xla.json "${OUT}"/tpu-pallas--resume-at50.json \
        >>"${OUT}/training.txt" 2>&1
      quiet "${OUT}/training.txt" | tail -n 8
      ;;
    steps)
      for row in "470m xla --remat full" "470m pallas --batch-size 4" \
        "470m pallas --batch-size 8 --microbatches 2" "1b pallas"; do
        set -- ${row}
        timeout 130 python3 benchmarks/train_step.py --model "$1" --attention "$2" "${@:3}" \
          --layouts docs --steps 5 "${tiles[@]}" >>"${OUT}/train_step.txt" 2>&1
        echo "${row} exit $?" >>"${OUT}/train_step.txt"
      done
      quiet "${OUT}/train_step.txt" | grep -v "^---\|^  docs" | tail -n 16
      ;;
    profile)
      timeout 200 python3 benchmarks/train_step.py --model 470m --attention pallas \
        --batch-size 4 --layouts docs --steps 5 --profile /tmp/kiln-trace "${tiles[@]}" \
        >"${OUT}/profile.txt" 2>&1
      echo "profile exit $?" >>"${OUT}/profile.txt"
      trace=$(ls /tmp/kiln-trace/*/plugins/profile/*/*.xplane.pb 2>/dev/null | tail -n 1)
      [[ -n "${trace}" ]] && gzip -c "${trace}" >"${OUT}/trace.xplane.pb.gz"
      quiet "${OUT}/profile.txt" | tail -n 20
      ;;
  esac
done
