# issue 19: the adamw kernel + ApexW tests compiled, whole (218), then optax.adamw's capacity search alone (its JSON)
source device_runs/setup.sh
timeout 330 python3 -m pytest -q -p no:cacheprovider tests/pallas_kernels/test_adamw_kernel.py tests/apex_jax/test_apexw.py -k "not sharded" 2>&1 | tail -6 | tee $OUT/logs/adamw_tests.log
timeout 240 python3 -m benchmarks.train_step --suite capacity --models llama-1b --optimizers optax.adamw --tag optax 2>&1 | tail -8 | tee $OUT/logs/train_step_capacity_optax.log
cp benchmarks/results/train_step_capacity*.json $OUT/ 2>/dev/null
