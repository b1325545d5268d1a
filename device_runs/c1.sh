source device_runs/setup.sh
timeout 280 python3 benchmarks/serving_decode.py --models qwen3-vl-30b-a3b --layers 8 --timeout 140 --out-dir $OUT/vl 2>&1 | tail -14 | tee $OUT/logs/serving_decode_vl.log
timeout 270 python3 -m benchmarks.train_step --suite curves --optimizers optax.adamw,apexw-int8,apexw-int4 --tag h200_int 2>&1 | tail -8 | tee $OUT/logs/train_step_curves.log
cp benchmarks/results/train_step_curves*h200_int*.json benchmarks/results/train_step_curves*h200_int*.png $OUT/ 2>/dev/null
ls $OUT
