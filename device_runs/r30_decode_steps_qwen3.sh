# issue 14: r29's A/B on Qwen3-30B-A3B's shape (8 layers): default DecodeSteps against --decode-steps 4, HTTP +
# engine at 16 / 64, two rounds alternating, one compilation cache
source device_runs/setup.sh
for round in 1 2; do
  for opt in "" "--decode-steps=4"; do
    d=$OUT/q${opt:+4}_$round; mkdir -p $d
    timeout 220 python3 benchmarks/serving_load.py --models qwen3-30b-a3b --layers 8 --concurrency 16,64 --rates '' \
      --paths engine,http --serve-options="$opt" --compilation-cache /tmp/jaxcache_qwen3 --out-dir $d 2>&1 | tail -4 \
      | cut -c1-200 | tee -a $OUT/logs/decode_steps_ab_qwen3.log
  done
done
rm -f $OUT/*/serving_load.png
