source device_runs/setup.sh
t0=$(date +%s)
timeout 330 python3 -m benchmarks.serving_multiturn --think-ms 2000 --name serving_multiturn_think > $OUT/logs/multiturn_think.log 2>&1; echo "multiturn rc=$? $(( $(date +%s)-t0 ))s"
left=$(( 570 - ($(date +%s)-t0) ))
timeout $left python3 benchmarks/optimizer.py --layouts 4x32M --groups torch,optax,apexw-fused,apexw-fused-mixed --blocks '{"fp32": [4, 1], "bf16": [4, 1]}' > $OUT/logs/optimizer.log 2>&1; echo "optimizer rc=$? $(( $(date +%s)-t0 ))s"
cp benchmarks/results/optimizer.json $OUT/ 2>/dev/null
tail -4 $OUT/logs/multiturn_think.log
grep "^ \|best" $OUT/logs/optimizer.log | tail -12
python3 - <<'PY'
import json
d = json.load(open("benchmarks/results/optimizer.json"))
for r in d["rows"]:
    if r["layout"] == "4x32M" and r.get("step_ms"):
        print(f'{r["impl"]:<24} {r.get("state",""):<5} {r.get("precision","fp32"):<12} {r["step_ms"]:.3f} ms  floor {r.get("floor_pct") or 0:.1f}%  {r.get("block")}')
PY
