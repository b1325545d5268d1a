# issue 24: Qwen3-30B-A3B (48 layers), chat turns (16 users x 8 turns, 1024 / 256 / 128: short messages against
# histories up to 4k tokens), 2 s pauses, 2,560 GPU blocks for a 3,136-block working set; arg 1: decode steps
source device_runs/setup.sh
ds=${1:-4}
timeout 560 python3 -m benchmarks.serving_multiturn --model qwen3-30b-a3b --layers 48 --users 16 --turns 8 \
  --system-len 1024 --user-len 256 --answer-len 128 --think-ms 2000 --num-blocks 2560 --decode-steps $ds \
  --name serving_multiturn_qwen3_chat_ds$ds --out-dir $OUT 2>&1 | tail -8 | tee $OUT/logs/multiturn_chat.log
