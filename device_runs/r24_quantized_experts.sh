# issue 17: int8 / fp8 experts through the Triton expert kernels (85ffb2a): their tests compiled, the kernel rows
# against ragged_dot and bf16, then Qwen3-30B-A3B decode (16 layers) bf16 vs fp8 vs int8 end to end
source device_runs/setup.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_grouped_matmul_kernel.py \
  tests/serving/test_serving_kernel_dispatch.py -k "uantized or moe" 2>&1 | tail -4 | tee $OUT/logs/quantized_tests.log
timeout 110 python3 benchmarks/serving_kernels.py --kernels quantized_experts --out-dir $OUT 2>&1 | tail -22 | tee $OUT/logs/quantized_kernels.log
timeout 320 python3 benchmarks/serving_decode.py --models qwen3-30b-a3b --layers 16 --engines serving,serving-fp8,serving-int8 \
  --timeout 100 --out-dir $OUT 2>&1 | tail -22 | tee $OUT/logs/quantized_decode.log
