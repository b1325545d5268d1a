# issue 24: TTFT on the H200 was the wait for the multi-step call in flight (34.9 ms GPU-only with ~2 ms of prefill,
# 2 s pauses, serving_multiturn_think.json), not the prefill the tier saves. Long histories (16 users x 5 turns,
# 2048 / 1024 / 128: up to 7.8k tokens, chunked over ~7 steps when recomputed) with the same pauses, at the engine's
# decode steps (arg 1: "default" or N)
source device_runs/setup.sh
ds=${1:-default}; opt=$([ "$ds" = default ] || echo "--decode-steps $ds")
timeout 560 python3 -m benchmarks.serving_multiturn --users 16 --turns 5 --system-len 2048 --user-len 1024 \
  --answer-len 128 --think-ms 2000 $opt --name serving_multiturn_long_think_ds$ds --out-dir $OUT 2>&1 | tail -8 \
  | tee $OUT/logs/serving_multiturn_long_think_ds$ds.log
