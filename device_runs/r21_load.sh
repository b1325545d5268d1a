# issue 14: serving_load at head: moe-1b (1/16/64, engine+device+http) then Qwen3-30B-A3B shape at 8 layers
source device_runs/setup.sh
mkdir -p $OUT/moe $OUT/qwen
timeout 300 python3 benchmarks/serving_load.py --models moe-1b --concurrency 1,16,64 --rates '' --out-dir $OUT/moe 2>&1 | tail -14 | tee $OUT/logs/serving_load_moe.log
timeout 270 python3 benchmarks/serving_load.py --models qwen3-30b-a3b --layers 8 --concurrency 1,16,64 --rates '' --out-dir $OUT/qwen 2>&1 | tail -14 | tee $OUT/logs/serving_load_qwen.log
