#!/usr/bin/env bash
# Issue 20's GPU figures on one lent GPU without Ray or MLflow (the local launcher runs the same
# train_loop), most important first, each step bounded so one stuck run cannot eat a lease:
#   1. gpt2-124m at micro-batch 16, bf16 autocast (auto's choice at ZeRO-0), ZeRO-0/2/3 against
#      the plain loop;
#   2. a compiled 1.3B model's MFU (ZeRO-0, autocast) against the compiled plain loop;
#   3. where a step's time goes (bench/profile_step.py: plain, ZeRO-0, ZeRO-3);
#   4. the same small runs with DeepSpeed's bf16 weights (train.mixed_precision: weights).
# Issue 44's steps (sharded training, `bash bench/gpu_speed.sh OUT syncs fsdp2-profile sharded units host knobs large-sharded generate`):
#   sharded: gpt2-124m at micro-batch 16, ZeRO-0, FSDP2 at ZeRO-2 and 3, and DeepSpeed's ZeRO-2
#     and 3 under autocast, against the plain loop;
#   knobs: DeepSpeed's ZeRO-2/3 knobs that might cut their host work (stage3_module_granularity_threshold
#     is left out: at 1e6 it failed inside DeepSpeed 0.19.8 on gpt2-124m, bench/results/gpu.md);
#   units: FSDP2 at ZeRO-3 with a unit a block (torchtitan's layout) against its default grouping
#     (parallel.fsdp2_unit_params), and DeepSpeed's ZeRO-2 with contiguous_gradients off (the host
#     costs bench/host_overhead.py measures on a CPU);
#   syncs: the health guard's CUDA test (needs pytest there), where each engine's step makes the
#     host wait for the GPU (bench/host_syncs.py), then
#     ZeRO-0 with DeepSpeed's throughput timer back on (its two syncs a step, off since 2026-12-02)
#     and ZeRO-0 and FSDP2 ZeRO-3 with the health guard off (no host read in a step at all);
#   fsdp2-profile: where FSDP2's step goes on this GPU (bench/profile_step.py: the plain loop, FSDP2
#     at ZeRO-2 and 3): its 0.46-0.68x of the plain loop on one H200 (gpu.md, 11-27 and 11-29) is
#     more than the host work bench/host_overhead.py finds on a CPU, and no lease profiled it yet;
#   host: bench/host_overhead.py on this machine's CPU (each engine's host work per step, no
#     device), to scale the CPU dev VM's figures to the host the GPU rows were measured on;
#   large-sharded: a compiled 1.3B model at ZeRO-0 and FSDP2 ZeRO-3;
#   generate: bf16 generation, Kiln against transformers (bench/generate.py).
# Tables go to $1/RESULTS-gpu.md (bench/throughput.py's format), profiles to $1/profile.txt and
# $1/profile-fsdp2.txt.
#
#   bash bench/gpu_speed.sh OUT_DIR [STEP ...]     (data: data/stdlib-bpe-1024, see bench/results/gpu.md)
set -uo pipefail
out=${1:?output dir}; shift
steps=("$@"); [ ${#steps[@]} -gt 0 ] || steps=(small large profile weights)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PY:-python3}
results="$out/RESULTS-gpu.md"
common=(--launcher local --device cuda --config jobs/configs/gpt2-124m.yaml --data data/stdlib-bpe-1024
        --precision bf16 --results "$results" --repeats 1)
small=(--flavour gpt2-124m --batch 16 --steps 80)
z=parallel.deepspeed.zero_optimization  # DeepSpeed's passthrough, for the knob rows
bounded() { local limit=$1; shift; timeout "$limit" "$@" || echo "FAILED or timed out ($limit s): $*"; }
# profiles FILE TOP ARGS...: bench/profile_step.py on gpt2-124m at micro-batch 16 once per ARGS
# (each a string of its flags), appended to FILE, each run's RESULT line shown.
profiles() {
  local file=$1 top=$2 args; shift 2
  for args in "$@"; do
    # shellcheck disable=SC2086
    bounded 80 "$py" -m bench.profile_step --device cuda --precision bf16 --flavour gpt2-124m --batch 16 \
      --top "$top" $args >> "$file" 2>&1
    grep "^RESULT" "$file" | tail -1
  done
}

for step in "${steps[@]}"; do
  echo "=== $step $(date +%T)"
  case $step in
    small) bounded 220 "$py" -m bench.throughput "${common[@]}" "${small[@]}" --zero-stages 0,2,3 \
             --set train.mixed_precision=autocast ;;
    # 1.3B (1.2B params with this vocab) compiled, micro-batch 8 x 1024 tokens.
    large) bounded 300 "$py" -m bench.throughput "${common[@]}" --flavour 1.3b --batch 8 --steps 40 --zero-stages 0 \
             --compile --set train.mixed_precision=autocast ;;
    profile) profiles "$out/profile.txt" 20 "--plain" "--zero-stage 0 --mixed-precision autocast" \
               "--zero-stage 3 --mixed-precision autocast" ;;
    weights) bounded 160 "$py" -m bench.throughput "${common[@]}" "${small[@]}" --zero-stages 0,2 \
               --set train.mixed_precision=weights ;;
    # About 30 s a run on a fresh lent machine (2026-11-27): each table below is 5-6 runs.
    sharded) bounded 240 "$py" -m bench.throughput "${common[@]}" "${small[@]}" --steps 60 --keep-going \
        --zero-stages 0,fsdp2-2,fsdp2-3 \
        --run "ZeRO-2 autocast|parallel.zero_stage=2 train.mixed_precision=autocast" \
        --run "ZeRO-3 autocast|parallel.zero_stage=3 train.mixed_precision=autocast" ;;
    knobs)
      bounded 240 "$py" -m bench.throughput "${common[@]}" "${small[@]}" --steps 60 --keep-going --zero-stages "" \
        --run "ZeRO-2 autocast, overlap_comm on (Kiln's default before 2026-12-02)|parallel.zero_stage=2 train.mixed_precision=autocast $z.overlap_comm=true" \
        --run "ZeRO-2 autocast, overlap_comm and contiguous_gradients off|parallel.zero_stage=2 train.mixed_precision=autocast $z.overlap_comm=false $z.contiguous_gradients=false" \
        --run "ZeRO-3 autocast, prefetch 2e8 and max live 2e9|parallel.zero_stage=3 train.mixed_precision=autocast $z.stage3_prefetch_bucket_size=200000000 $z.stage3_max_live_parameters=2000000000" ;;
    units)
      bounded 240 "$py" -m bench.throughput "${common[@]}" "${small[@]}" --steps 60 --keep-going --zero-stages "" \
        --run "FSDP2 ZeRO-3, a unit a block|parallel.engine=fsdp2 parallel.zero_stage=3 parallel.fsdp2_unit_params=0" \
        --run "FSDP2 ZeRO-3, blocks grouped (default)|parallel.engine=fsdp2 parallel.zero_stage=3" \
        --run "ZeRO-2 autocast, contiguous_gradients off|parallel.zero_stage=2 train.mixed_precision=autocast $z.contiguous_gradients=false" ;;
    syncs)
      # the guard's CUDA read (page-locked copy and event) judged on this GPU first
      bounded 60 "$py" -m pytest -q -p no:cacheprovider tests/unit/core/test_health.py -k gpu 2>&1 | tail -3
      bounded 90 "$py" -m bench.host_syncs --device cuda --results "$out/RESULTS-syncs.md"
      bounded 200 "$py" -m bench.throughput "${common[@]}" "${small[@]}" --steps 60 --keep-going --zero-stages "" \
        --run "ZeRO-0, DeepSpeed's throughput timer on|parallel.zero_stage=0 parallel.deepspeed.timers.throughput.enabled=true" \
        --run "ZeRO-0, health guard off|parallel.zero_stage=0 train.health.policy=off" \
        --run "FSDP2 ZeRO-3, health guard off|parallel.engine=fsdp2 parallel.zero_stage=3 train.health.policy=off" ;;
    fsdp2-profile) profiles "$out/profile-fsdp2.txt" 25 "--plain" "--engine fsdp2 --zero-stage 2" \
                     "--engine fsdp2 --zero-stage 3" ;;
    host) bounded 240 "$py" -m bench.host_overhead --rounds 9 --results "$out/RESULTS-host.md" ;;
    large-sharded) bounded 290 "$py" -m bench.throughput "${common[@]}" --flavour 1.3b --batch 8 --steps 30 --keep-going \
             --zero-stages 0,fsdp2-3 --compile ;;
    generate) bounded 240 "$py" -m bench.generate --device cuda --dtype bf16 --rounds 3 --results "$out/generation-gpu.md" ;;
    *) echo "unknown step $step" ;;
  esac
done
if command -v nvidia-smi > /dev/null; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; fi
