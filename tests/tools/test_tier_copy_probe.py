"""tools/tier_copy_probe.py on the CPU, small: every copy of the tiers is timed while a computation runs, and a
call's result is never ready before the call returns."""

import json

from tools import tier_copy_probe


def test_probe_times_each_tier_copy_with_work_in_flight(tmp_path):
    out = tmp_path / "probe.json"
    rows = tier_copy_probe.main(["--busy-iters", "2", "--size", "256", "--out", str(out)])
    assert [r["call"] for r in rows] == ["gather", "to pinned_host", "from pinned_host", "scatter"]
    assert all(0 <= r["returned_ms"] <= r["ready_ms"] and r["busy_ms"] > 0 for r in rows)
    assert json.loads(out.read_text())["rows"] == rows
