source device_runs/setup.sh
t0=$(date +%s)
timeout 200 python3 benchmarks/optimizer.py --layouts 4x32M --groups torch,optax,apexw-fused,apexw-fused-mixed > $OUT/logs/optimizer.log 2>&1; echo "optimizer rc=$? $(( $(date +%s)-t0 ))s"
timeout 290 python3 -m benchmarks.train_step --suite speed --models llama-1b > $OUT/logs/train_speed_llama.log 2>&1; echo "speed rc=$? $(( $(date +%s)-t0 ))s"
left=$(( 575 - ($(date +%s)-t0) ))
timeout $left python3 -m benchmarks.train_step --suite curves > $OUT/logs/train_curves.log 2>&1; echo "curves rc=$? $(( $(date +%s)-t0 ))s"
grep -v "^{" $OUT/logs/optimizer.log | tail -30
grep "^  " $OUT/logs/optimizer.log | head; tail -12 $OUT/logs/train_speed_llama.log; tail -8 $OUT/logs/train_curves.log
