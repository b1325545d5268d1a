# issue 18: muPC on the H200, 64 and 128 hidden layers on all 60k (results/pc_mupc_64.json, pc_mupc_128.json);
# each run's lr is cosine-decayed over the epochs that fit its budget
source device_runs/setup.sh
timeout 280 python3 benchmarks/pc_mnist.py --suite mupc --hidden-layers 64 --epochs 30 --time-budget 230 2>&1 | tail -6 | tee $OUT/logs/pc_mupc_64.log
timeout 290 python3 benchmarks/pc_mnist.py --suite mupc --hidden-layers 128 --epochs 30 --time-budget 230 2>&1 | tail -6 | tee $OUT/logs/pc_mupc_128.log
cp benchmarks/results/pc_mupc_64.* benchmarks/results/pc_mupc_128.* $OUT/ 2>/dev/null
