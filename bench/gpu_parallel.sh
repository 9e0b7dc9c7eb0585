#!/usr/bin/env bash
# ZeRO stages, precisions, offload and activation checkpointing on one CUDA GPU, each next to the
# memory planner's prediction for the same run. For a lent GPU box without Ray or MLflow: the
# local launcher runs the same train_loop.
#
#   bash bench/gpu_parallel.sh OUT_DIR [NAME ...]     (data: data/stdlib-bpe-1024, see bench/results/gpu.md)
#
# CPU smoke of this script itself (bf16 runs only; fp16 is refused on CPU):
#   CFG=jobs/configs/debug.yaml STEPS=8 EXTRA="parallel.use_gpu=false data.path=data/stdlib-bpe" \
#     bash bench/gpu_parallel.sh /tmp/gpu-smoke zero2-bf16 zero3-bf16
set -euo pipefail
out=${1:?output dir}; shift
mkdir -p "$out"
cfg=${CFG:-jobs/configs/gpt2-124m.yaml}
steps=${STEPS:-40}
extra=(); for s in ${EXTRA:-}; do extra+=(--set "$s"); done
declare -A RUNS=(
  [zero2-bf16]="parallel.zero_stage=2 train.precision=bf16"
  [zero3-bf16]="parallel.zero_stage=3 train.precision=bf16"
  [zero2-fp16]="parallel.zero_stage=2 train.precision=fp16"
  [zero2-bf16-ckpt]="parallel.zero_stage=2 train.precision=bf16 model.activation_checkpointing=true"
  [zero2-bf16-offload]="parallel.zero_stage=2 train.precision=bf16 parallel.offload_optimizer=cpu"
)
names=("$@"); [ ${#names[@]} -gt 0 ] || names=(zero2-bf16 zero3-bf16 zero2-fp16 zero2-bf16-ckpt zero2-bf16-offload)
for name in "${names[@]}"; do
  sets=("${extra[@]}"); for s in ${RUNS[$name]}; do sets+=(--set "$s"); done
  python -m kiln.cli plan --config "$cfg" "${sets[@]}" > "$out/$name.plan.txt"
  # RUN_TIMEOUT bounds each run (0: none), so one stuck run cannot eat a whole lease.
  timeout "${RUN_TIMEOUT:-0}" python -m kiln.launch.local --config "$cfg" "${sets[@]}" --set train.max_steps="$steps" --set train.eval_every=0 \
    --set train.eval_batches=2 --set logging.progress_every=10 --set train.storage_path=/tmp/kiln-runs \
    --summary-json "$out/$name.json" > "$out/$name.log" 2>&1 || echo "$name failed: see $name.log"
  tail -n 12 "$out/$name.log"
done
if command -v nvidia-smi > /dev/null; then nvidia-smi --query-gpu=name,memory.total --format=csv > "$out/gpu.txt"; fi
