# issue 18: muPC wider (CPU probe: 16 layers, 20k, 2 epochs: width 128/256/512 -> 94.82/95.29/95.88%); float32 default
source device_runs/setup.sh
timeout 280 python3 benchmarks/pc_mnist.py --suite mupc --hidden-layers 64 --width 512 --epochs 40 --time-budget 260 2>&1 | tail -6 | tee $OUT/logs/pc_mupc_64_w512.log
cp benchmarks/results/pc_mupc_64_w512.* $OUT/
# second call (~300 s): the lower lr at width 128 (the float32 run climbed only as the lr decayed)
# source device_runs/setup.sh; timeout 280 python3 benchmarks/pc_mnist.py --suite mupc --hidden-layers 64 --lr-scale 0.03 --epochs 40 --time-budget 240 2>&1 | tail -6 | tee $OUT/logs/pc_mupc_64_lr.log; cp benchmarks/results/pc_mupc_64_lr0.03.* $OUT/
