# issue 17 / 14: Qwen3-30B-A3B (8 layers) through HTTP and the engine with serve --quantize fp8 (1-byte experts
# through the Triton kernels) at 1 / 16 / 64, against the bf16 rows of r21 (run them in the same session)
source device_runs/setup.sh
mkdir -p $OUT/fp8
timeout 300 python3 benchmarks/serving_load.py --models qwen3-30b-a3b --layers 8 --concurrency 1,16,64 --rates '' \
  --serve-options "--quantize fp8" --out-dir $OUT/fp8 2>&1 | tail -12 | tee $OUT/logs/serving_load_qwen_fp8.log
