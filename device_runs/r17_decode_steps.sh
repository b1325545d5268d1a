# issues 14 + 24: does a shorter multi-step decode call (4 steps instead of 8 at batches above 8) cut the closed
# loop's admission wait (HTTP 0.88x the engine at 16 / 64) without costing throughput? moe-1b, back to back
source device_runs/setup.sh
for n in 8 4; do
  mkdir -p $OUT/ds$n
  timeout 280 python3 benchmarks/serving_load.py --models moe-1b --concurrency 16,64 --rates '' --paths engine,http \
    --serve-options "--decode-steps $n" --out-dir $OUT/ds$n 2>&1 | tail -12 | tee $OUT/logs/serving_load_ds$n.log
done
