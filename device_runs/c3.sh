source device_runs/setup.sh
timeout 560 python3 -m tools.gpu_check 2>&1 | tail -40 | tee $OUT/logs/gpu_check.log
# the tool writes $OUT/gpu_check.json itself: do not copy the repo JSON over it
