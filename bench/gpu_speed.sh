#!/usr/bin/env bash
# Issue 20's GPU figures on one lent GPU without Ray or MLflow (the local launcher runs the same
# train_loop): gpt2-124m bf16 at micro-batch 16 against the plain loop for ZeRO-0/2/3, and a
# compiled large model's MFU. Results go to $1/RESULTS-gpu.md (bench/throughput.py's format).
#
#   bash bench/gpu_speed.sh OUT_DIR [small|large|both]     (data: data/stdlib-bpe-1024)
set -euo pipefail
out=${1:?output dir}; what=${2:-both}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
common=(--launcher local --device cuda --config jobs/configs/gpt2-124m.yaml --data data/stdlib-bpe-1024
        --precision bf16 --results "$out/RESULTS-gpu.md")
if [ "$what" != large ]; then
  python bench/throughput.py "${common[@]}" --flavour gpt2-124m --batch 16 --steps 80 --zero-stages 0,2,3
fi
if [ "$what" != small ]; then
  # 1.3B (1.2B params with this vocab) compiled, ZeRO-1, micro-batch 8 x 1024 tokens.
  python bench/throughput.py "${common[@]}" --flavour 1.3b --batch 8 --steps 40 --zero-stages 1 --compile \
    --set train.grad_clip=1.0
fi
