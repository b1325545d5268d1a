# issue 17: K-major int8 / fp8 expert codes (113ebd7+): the kernel and dispatch tests compiled (both layouts), one
# layer's decode experts (gather_experts: bf16 / int8 / fp8, [E,in,out] and K-major, against XLA), then the
# Qwen3-30B-A3B 8-layer decode profile at batch 1 / 8 (the runner now stores the codes K-major), bf16 beside it
source device_runs/setup.sh
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_grouped_matmul_kernel.py \
  tests/serving/test_serving_kernel_dispatch.py -k "uantized or moe or ather or layout" 2>&1 | tail -3 > $OUT/logs/tests.log
cat $OUT/logs/tests.log
timeout 120 python3 benchmarks/serving_kernels.py --kernels gather_experts --out-dir $OUT 2>&1 | tail -12 \
  > $OUT/logs/gather_experts.log; tail -11 $OUT/logs/gather_experts.log | cut -c1-60,150-260
timeout 100 python3 benchmarks/serving_decode.py --profile --models qwen3-30b-a3b --layers 8 --batches 1,8 \
  --engines serving-int8 --gather-configs 64x128x4x4,64x256x4x3,32x256x4x3,fma:64x128x8x3 --out-dir $OUT/serving-int8 \
  2>&1 | grep -v "^ *$" | tail -60 >> $OUT/logs/profile.log
for eng in serving-fp8 serving; do
  timeout 60 python3 benchmarks/serving_decode.py --profile --models qwen3-30b-a3b --layers 8 --batches 1,8 \
    --engines $eng --out-dir $OUT/$eng 2>&1 | grep -v "^ *$" | tail -40 >> $OUT/logs/profile.log
done
grep -e "ms/step" -e "gather sweep" $OUT/logs/profile.log | cut -c1-220
rm -f $OUT/*.png
