# issue 23's image-prefill row after the flash encoder (913f43d) and device-resident embeddings (fd27f90);
# issue 19's 128M fused-step bars at the head (fixed geometry, no sweep): fp32-p/g rows and bf16 p/g rows
source device_runs/setup.sh
timeout 300 python3 benchmarks/serving_decode.py --models qwen3-vl-30b-a3b --layers 8 --timeout 140 --out-dir $OUT/vl 2>&1 | tail -14 | tee $OUT/logs/serving_decode_vl.log
#timeout 250 python3 benchmarks/optimizer.py --layouts 4x32M --groups apexw-fused,apexw-fused-mixed \
#  --blocks '{"fp32":[4,1],"bf16":[4,1],"int8":[4,2],"int4":[2,1],"bf16:bf16":[4,1],"bf16:int8":[4,2]}' 2>&1 | tail -16 | tee $OUT/logs/optimizer_128m.log
#cp benchmarks/results/optimizer.json $OUT/optimizer_128m.json
