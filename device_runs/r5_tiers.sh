# issue 24: which tier copy waits on the H200 (both ways), then the multiturn run with both ways of copying
source device_runs/setup.sh
python3 -m tools.tier_copy_probe 2>&1 | tail -12 | tee $OUT/logs/tier_copy_probe.log
timeout 480 python3 -m benchmarks.serving_multiturn --think-ms 2000 --tier-copies put,program --host-batches 64,16 \
  --name serving_multiturn_think --out-dir $OUT 2>&1 | tail -15 | tee $OUT/logs/serving_multiturn_think.log
