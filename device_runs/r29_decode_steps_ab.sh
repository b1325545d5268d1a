# issue 14: the GPU DecodeSteps default (8 per call, 16 at batches <= 8) against --decode-steps 4, moe-1b HTTP +
# engine at 16 / 64, two rounds alternating on one machine (at db5a5f1 on an H100, one run: HTTP 0.945x the engine
# at 16 with 4 against 0.89x with the default). One compilation cache: only the first run compiles cold (~90 s)
source device_runs/setup.sh
for round in 1 2; do
  for opt in "" "--decode-steps=4"; do
    d=$OUT/ds${opt:+4}_$round; mkdir -p $d
    timeout 200 python3 benchmarks/serving_load.py --models moe-1b --concurrency 16,64 --rates '' --paths engine,http \
      --serve-options="$opt" --compilation-cache /tmp/jaxcache_moe1b --out-dir $d 2>&1 | tail -4 | cut -c1-200 \
      | tee -a $OUT/logs/decode_steps_ab.log
  done
done
rm -f $OUT/*/serving_load.png  # the device tool returns ~8 files a call: JSONs and the one log
