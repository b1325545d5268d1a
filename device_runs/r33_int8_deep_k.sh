# issue 17: int8 gather_matmul with deeper K steps and narrower column tiles (more bytes per load in flight, more
# programs): is the 1-byte path latency-bound (its converted tiles not software-pipelined)? Qwen3 8 layers
source device_runs/setup.sh
timeout 120 python3 benchmarks/serving_decode.py --profile --models qwen3-30b-a3b --layers 8 --batches 1,8 \
  --engines serving-int8 --gather-configs 64x128x4x4,64x256x4x3,32x512x4x2,64x512x4x2,16x512x4x2,32x256x4x3 \
  --out-dir $OUT/int8 2>&1 | grep -v "^ *$" | tail -60 >> $OUT/logs/deep_k.log
grep -e "gather sweep" $OUT/logs/deep_k.log
