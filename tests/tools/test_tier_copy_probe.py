"""tools/tier_copy_probe.py on the CPU, small: every copy of the tiers (both ways of copying) is timed while a
computation runs (and ``KVTiers.apply`` itself on the cache as a compiled step leaves it), a call's result is
never ready before the call returns, and no measured call compiles."""

import json

from tools import tier_copy_probe


def test_probe_times_each_tier_copy_with_work_in_flight(tmp_path):
    rows = tier_copy_probe.main(["--busy-iters", "2", "--size", "256", "--leaves", "3", "--page", "4,2,8",
                                 "--out-dir", str(tmp_path)])
    assert [r["call"] for r in rows] == ["gather", "to pinned_host", "from pinned_host", "scatter",
                                         "gather to host (program)", "scatter from host (program)",
                                         "apply: save 64 blocks (put)", "apply: load 64 blocks (put)",
                                         "apply: save 64 blocks (program)", "apply: load 64 blocks (program)",
                                         "commit each leaf"]
    assert all(0 <= r["returned_ms"] <= r["ready_ms"] and r["busy_ms"] > 0 for r in rows)
    assert [r["compiles"] for r in rows] == [0] * len(rows)
    result = json.loads((tmp_path / "tier_copy_probe.json").read_text())
    assert result["rows"] == rows and result["meta"]["git_commit"]
    assert (result["leaves"], result["page"]) == (3, [4, 2, 8])
