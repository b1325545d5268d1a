source device_runs/setup.sh
timeout 240 python3 benchmarks/pc_mnist.py --suite mupc --hidden-layers 64 --epochs 40 --time-budget 200 2>&1 | tail -8 | tee $OUT/logs/pc_mupc_64.log
timeout 245 python3 benchmarks/pc_mnist.py --suite mupc --hidden-layers 128 --epochs 40 --time-budget 200 2>&1 | tail -8 | tee $OUT/logs/pc_mupc_128.log
cp benchmarks/results/pc_mupc_64.* benchmarks/results/pc_mupc_128.* $OUT/ 2>/dev/null
