# issue 19 after 1d4f727 (ApexW.step on the params pytree, range_params launches) and c8115f8 (row ranges): the
# adamw kernel and ApexW tests compiled, the speed suite (optimizer share), then the capacity search with remat
source device_runs/setup.sh
timeout 150 python3 -m pytest -q -x tests/pallas_kernels/test_adamw_kernel.py tests/apex_jax/test_apexw.py -k "not sharded" 2>&1 | tail -3 | tee $OUT/logs/adamw_tests.log
timeout 250 python3 -m benchmarks.train_step --suite speed --models llama-1b --optimizers optax.adamw,apexw-bf16,apexw-int8 2>&1 | tail -8 | tee $OUT/logs/train_step_speed.log
timeout 180 python3 -m benchmarks.train_step --suite capacity --models llama-1b --optimizers optax.adamw,apexw-int8 2>&1 | tail -8 | tee $OUT/logs/train_step_capacity.log
