# the fused step fed leaf gradients (row-range launches) against flat gradients and on the params pytree (a launch
# per large leaf: 1024 x 128K shows what 1024 launches cost), 4 x 32M and 1024 x 128K, every state kind, with
# the geometry measured at 365eefb (no sweep); then the kernel tests compiled if r6 did not run them
source device_runs/setup.sh
timeout 500 python3 benchmarks/optimizer.py --layouts 4x32M,1024x128K --groups optax,apexw-transform,apexw-fused \
  --blocks '{"fp32":[4,1],"bf16":[4,1],"int8":[4,2],"int4":[2,1]}' 2>&1 | tail -40 | tee $OUT/logs/optimizer_leaf.log
