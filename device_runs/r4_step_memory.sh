# issue 19: where the 1B Llama step's ~19.5 B/param of XLA temporaries go (optax vs apexw-int8), from XLA's
# buffer assignment of one capacity try (8 layers, batch 1), plus the probe for issue 24.
source device_runs/setup.sh
python3 -m tools.tier_copy_probe 2>&1 | tail -30 | tee $OUT/logs/tier_copy_probe.log
for opt in optax.adamw apexw-int8; do
  d=$OUT/xla_$opt; mkdir -p $d
  XLA_FLAGS="--xla_dump_to=/tmp/xla_$opt --xla_dump_hlo_module_re=.*step.*" \
    timeout 300 python3 benchmarks/train_step.py --try llama-1b:$opt:8 2>&1 | tail -3
  cp /tmp/xla_$opt/*buffer-assignment.txt /tmp/xla_$opt/*memory-usage-report* $d/ 2>/dev/null
  ls -la $d
done
