# issue 17: the grouped matmul's Triton geometries on int8 / fp8 / bf16 expert weights, Qwen3-30B-A3B's prefill
# shapes (1-byte codes ran 15-28% slower than bf16 at bf16's default on an H100 at 00d5b09)
source device_runs/setup.sh
timeout 400 python3 benchmarks/serving_kernels.py --kernels quantized_experts --quantized-configs sweep \
  --expert-shapes prefill_gate_up,prefill_down --out-dir $OUT 2>&1 | grep quantized_experts | tee $OUT/logs/quantized_sweep.log
