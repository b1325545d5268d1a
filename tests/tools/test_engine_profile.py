"""``tools/engine_profile``: serving_load's closed loop on the engine, each ``Engine.step`` classed by what it ran
and its wall time split into the device wait and the host's own work."""

import json

from tools import engine_profile


def test_profile_classes_every_step_and_splits_its_time(tmp_path):
    result = engine_profile.main(["--cpu", "--model", "tiny-moe", "--concurrency", "2", "--requests-per-client", "2",
                                  "--output-len", "12", "--serve-arg=--decode-steps=4", "--cprofile",
                                  "--out-dir", str(tmp_path)])
    [row] = result["rows"]
    steps = row["steps"]
    # the first step prefills; the ones after it, multi-step decodes among them, are dispatched behind another
    assert set(steps) <= {"multi", "chained-multi", "chained-decode", "chained-mixed", "decode", "mixed", "idle"}
    assert {"chained-multi", "mixed"} <= set(steps)
    assert steps["chained-multi"]["tokens"] > 2 * steps["chained-multi"]["steps"]  # several tokens per call
    assert sum(kind["tokens"] for kind in steps.values()) == 4 * 12  # 4 requests of --output-len tokens
    for kind in steps.values():
        assert kind["steps"] > 0 and kind["wall_s"] > 0
        assert abs(kind["wall_s"] - kind["device_wait_s"] - kind["host_s"]) < 1e-3 and kind["device_wait_s"] >= 0
    assert result["decode_steps"] == {"n": 4, "small_n": 0, "small_batch": 0} and "function calls" in result["cprofile"]
    assert json.loads((tmp_path / "engine_profile_tiny-moe.json").read_text())["rows"] == result["rows"]
