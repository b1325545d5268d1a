# issue 18: muPC epoch time at bf16 x3 / x6 tensor-core passes against float32 FFMA (64 x 512, 2 epochs of 30k each)
source device_runs/setup.sh
timeout 560 python3 device_runs/mupc_algorithms.py 30000 BF16_BF16_F32_X3 BF16_BF16_F32_X6 float32 2>&1 | grep '^{' | tee $OUT/logs/mupc_algorithms.log
