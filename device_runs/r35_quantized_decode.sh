# issue 17: the README's quantized decode table again with K-major codes: Qwen3-30B-A3B 16 layers, bf16 / fp8 /
# int8 at batches 1 / 8 / 64 and the 4x2k prefill (as r24 at 00d5b09)
source device_runs/setup.sh
timeout 330 python3 benchmarks/serving_decode.py --models qwen3-30b-a3b --layers 16 --engines serving,serving-fp8,serving-int8 \
  --timeout 100 --out-dir $OUT 2>&1 | tail -22 | tee $OUT/logs/quantized_decode.log
rm -f $OUT/*.png
