# issue 19: int8 / int4 loss curves on the H200 beside optax.adamw (2000 steps, one init, one batch order)
source device_runs/setup.sh
timeout 320 python3 -m benchmarks.train_step --suite curves --optimizers optax.adamw,apexw-int8,apexw-int4 --tag h200_int 2>&1 | tail -8 | tee $OUT/logs/train_step_curves.log
cp benchmarks/results/train_step_curves*h200_int*.json benchmarks/results/train_step_curves*h200_int*.png $OUT/ 2>/dev/null
