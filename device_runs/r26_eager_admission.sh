# issue 14: moe-1b HTTP vs engine at 16 / 64, default against serve --eager-admission, back to back
source device_runs/setup.sh
for opt in "" "--eager-admission"; do
  d=$OUT/eager${opt:+_on}; mkdir -p $d
  timeout 280 python3 benchmarks/serving_load.py --models moe-1b --concurrency 16,64 --rates '' --paths engine,http \
    --serve-options="$opt" --compilation-cache /tmp/jaxcache_moe1b --out-dir $d 2>&1 | tail -6 | tee $OUT/logs/serving_load_eager${opt:+_on}.log
done
