# issue 24: does a tier copy make the host wait (the probe), then Qwen3-30B-A3B (48 layers) long histories with
# both ways of copying (put, program) against GPU-only, 4 decode steps per call
source device_runs/setup.sh
timeout 60 python3 -m tools.tier_copy_probe --out-dir $OUT 2>&1 | tail -12 | tee $OUT/logs/tier_copy_probe.log
mkdir -p $OUT/qwen3; timeout 60 python3 -m tools.tier_copy_probe --leaves 96 --page 16,4,128 --out-dir $OUT/qwen3 2>&1 | tail -12 | tee $OUT/logs/tier_copy_probe_qwen3.log
timeout 470 python3 -m benchmarks.serving_multiturn --model qwen3-30b-a3b --layers 48 --users 16 --turns 5 \
  --system-len 2048 --user-len 1024 --answer-len 128 --think-ms 2000 --decode-steps 4 --tier-copies put,program \
  --name serving_multiturn_qwen3_l48_copies --out-dir $OUT 2>&1 | tail -8 | tee $OUT/logs/multiturn_copies.log
