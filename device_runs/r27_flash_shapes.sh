# issue 16: flash attention over the shape sweep against cuDNN (FLASH_SHAPES), Mosaic GPU and Triton defaults
source device_runs/setup.sh
timeout 400 python3 benchmarks/serving_kernels.py --kernels flash_shapes --out-dir $OUT 2>&1 | tail -30 | tee $OUT/logs/flash_shapes.log
