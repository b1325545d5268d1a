# issue 17: gather_matmul's row on CUDA cores (tensor_cores=False, "fma:") against the 16-row MMA tile, int8 and
# bf16, Qwen3-30B-A3B 8 layers at decode batch 1 / 8; first the kernel's tests compiled (both row paths)
source device_runs/setup.sh
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_grouped_matmul_kernel.py -k "ather" 2>&1 \
  | tail -3 > $OUT/logs/tests.log; cat $OUT/logs/tests.log
for eng in serving-int8 serving; do
  timeout 55 python3 benchmarks/serving_decode.py --profile --models qwen3-30b-a3b --layers 8 --batches 1,8 \
    --engines $eng --gather-configs 64x128x4x4,fma:64x64x4x4,fma:128x32x4x4,fma:64x128x8x3 \
    --out-dir $OUT/$eng 2>&1 | grep -v "^ *$" | tail -60 >> $OUT/logs/fma_sweep.log
done
grep -e "gather sweep" $OUT/logs/fma_sweep.log
