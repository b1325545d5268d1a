# issue 17: why the int8 decode step at batch 1 is 1.43x bf16's (H100, 00d5b09), Qwen3-30B-A3B 8 layers, kernels per
# step from the profile: (1) int8 with four gather_matmul geometries at batch 1 / 8 (1-byte tiles at bf16's
# 64-column geometry?), (2) bf16 at batch 1 for the kernel-by-kernel comparison, (3) int8 at batch 1 with XLA's
# Triton GEMMs for every dot (do the quantized attention projections' converts fuse into their GEMMs then?)
source device_runs/setup.sh
timeout 300 python3 benchmarks/serving_decode.py --profile --models qwen3-30b-a3b --layers 8 --batches 1,8 \
  --engines serving-int8 --gather-configs 64x128x4x4,128x128x4x4,64x256x4x3,128x256x4x3 \
  --out-dir $OUT/int8 2>&1 | grep -v "^ *$" | tail -60 > $OUT/logs/gather_sweep_int8.log
grep -e "gather sweep" -e "ms/step" $OUT/logs/gather_sweep_int8.log
timeout 110 python3 benchmarks/serving_decode.py --profile --models qwen3-30b-a3b --layers 8 --batches 1 \
  --out-dir $OUT/bf16 2>&1 | tail -28 > $OUT/logs/profile_bf16.log
grep "ms/step" $OUT/logs/profile_bf16.log
XLA_FLAGS="--xla_gpu_triton_gemm_any=true" timeout 110 python3 benchmarks/serving_decode.py --profile \
  --models qwen3-30b-a3b --layers 8 --batches 1 --engines serving-int8 --out-dir $OUT/int8_triton_gemm 2>&1 \
  | tail -28 > $OUT/logs/profile_int8_triton_gemm_any.log
grep "ms/step" $OUT/logs/profile_int8_triton_gemm_any.log
