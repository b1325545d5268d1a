# issue 17: prefill geometry for K-major int8 / fp8 expert codes: the quantized_experts sweep (Triton configs plus
# deeper K steps) on Qwen3-30B-A3B's prefill gate+up and down, codes [E,in,out] and K-major, bf16 beside them
source device_runs/setup.sh
timeout 420 python3 benchmarks/serving_kernels.py --kernels quantized_experts --quantized-configs sweep \
  --expert-shapes prefill_gate_up,prefill_down --out-dir $OUT 2>&1 | grep "quantized_experts " > $OUT/logs/qe.log
awk '{print $2, $4, $3, $6}' $OUT/logs/qe.log | sort -k1,1 -k2,2g | awk '{k=$1; if (n[k]++ < 3) print}' | cut -c1-150
rm -f $OUT/*.png
