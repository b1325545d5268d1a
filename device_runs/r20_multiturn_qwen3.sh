# issue 24: the tier's TTFT gain where prefill is costly: Qwen3-30B-A3B's shape (arg 1: layers, default 8), long
# histories (16 users x 5 turns, 2048 / 1024 / 128, up to 7.8k tokens), 2 s pauses, 4 decode steps per call (arg 2)
source device_runs/setup.sh
layers=${1:-8}; ds=${2:-4}
timeout 560 python3 -m benchmarks.serving_multiturn --model qwen3-30b-a3b --layers $layers --users 16 --turns 5 \
  --system-len 2048 --user-len 1024 --answer-len 128 --think-ms 2000 --decode-steps $ds \
  --name serving_multiturn_qwen3_l${layers}_ds$ds --out-dir $OUT 2>&1 | tail -8 | tee $OUT/logs/multiturn_qwen3.log
