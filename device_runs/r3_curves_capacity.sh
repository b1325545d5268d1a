source device_runs/setup.sh
t0=$(date +%s)
timeout 150 python3 -m benchmarks.train_step --suite curves > $OUT/logs/train_curves.log 2>&1; echo "curves rc=$? $(( $(date +%s)-t0 ))s"
timeout 200 python3 -m benchmarks.train_step --suite capacity --models llama-1b --optimizers optax.adamw --min-layers 112 --max-layers 176 --tag optax > $OUT/logs/capacity_optax.log 2>&1; echo "cap optax rc=$? $(( $(date +%s)-t0 ))s"
left=$(( 560 - ($(date +%s)-t0) ))
timeout $left python3 -m benchmarks.train_step --suite capacity --models llama-1b --optimizers apexw-int8 --min-layers 176 --max-layers 272 --tag int8 > $OUT/logs/capacity_int8.log 2>&1; echo "cap int8 rc=$? $(( $(date +%s)-t0 ))s"
grep -h "^{" $OUT/logs/train_curves.log $OUT/logs/capacity_*.log
