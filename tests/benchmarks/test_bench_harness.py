"""Tests of benchmarks/harness.py: timers, result files and tables."""

import json
import subprocess
import sys
import types

import jax.numpy as jnp
import pytest

from benchmarks import harness


def test_time_jax_returns_sane_timing():
    x = jnp.ones((256, 256))
    timing = harness.time_jax(lambda a: a @ a, x, warmup=2, iters=20)
    assert timing.runs == 20
    assert 0 < timing.p10_ms <= timing.median_ms <= timing.p90_ms < 10_000


def test_time_jax_refuses_few_runs():
    with pytest.raises(ValueError, match="iters=5"):
        harness.time_jax(lambda: jnp.zeros(1), iters=5)


def test_time_torch_without_cuda_uses_wall_clock(monkeypatch):
    """torch is only on the GPU machine; a stand-in without CUDA exercises the CPU path."""
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: False))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    calls = []
    timing = harness.time_torch(lambda: calls.append(1), warmup=3, iters=20)
    assert len(calls) == 23 and timing.runs == 20
    assert 0 <= timing.p10_ms <= timing.median_ms <= timing.p90_ms


def test_copy_bandwidth_counts_bytes_read_and_written_over_the_median_pass(monkeypatch):
    timed = {}

    def fake_time_jax_steps(step, carry, **_):
        (x,) = carry
        timed["shape"], timed["nbytes"] = x.shape, x.nbytes
        (timed["out"],) = step(x)
        return harness.Timing(median_ms=2.0, p10_ms=1.0, p90_ms=3.0, runs=20), (timed["out"],)

    monkeypatch.setattr(harness, "time_jax_steps", fake_time_jax_steps)
    tb_s = harness.copy_bandwidth_tb_s(gib=1 / 64)
    assert timed["nbytes"] == 2**30 // 64 and timed["out"].shape == timed["shape"]  # a pass over all of it
    assert tb_s == pytest.approx(2 * 2**30 / 64 / 2e-3 / 1e12)


def test_copy_bandwidth_on_this_cpu_is_a_memory_speed():
    assert 1e-4 < harness.copy_bandwidth_tb_s(gib=1 / 256) < 10  # 100 MB/s .. 10 TB/s


def test_previous_results_are_merged_into_only_on_the_device_they_came_from(tmp_path):
    path = tmp_path / "bench.json"
    assert harness.previous_results(path, "NVIDIA H200") is None  # nothing yet
    path.write_text(json.dumps({"meta": {"device": "NVIDIA H200"}, "rows": [1]}))
    assert harness.previous_results(path, "NVIDIA H200")["rows"] == [1]
    assert harness.previous_results(path, "NVIDIA H100 80GB HBM3") is None  # replaced, never mixed


def test_write_results(tmp_path, monkeypatch):
    monkeypatch.setenv("APEX_GIT_COMMIT", "abc123")
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    payload = {"rows": [{"impl": "x", "step_ms": 1.5, "gb_s": float("nan")}], "meta": {"note": "hi"}}
    path = harness.write_results("demo", payload, out_dir=tmp_path / "results")
    assert path == tmp_path / "results" / "demo.json"
    result = json.loads(path.read_text())
    assert result["benchmark"] == "demo"
    assert result["rows"] == [{"impl": "x", "step_ms": 1.5, "gb_s": None}]
    meta = result["meta"]
    for key in ("date_utc", "device", "device_count", "git_commit", "platform", "versions"):
        assert key in meta
    assert list(meta) == sorted(meta)
    assert meta["git_commit"] == "abc123" and meta["note"] == "hi" and meta["platform"] == "cpu"
    assert {"python", "jax", "jaxlib", "numpy", "optax"} <= set(meta["versions"])
    assert (tmp_path / "out" / "demo.json").read_text() == path.read_text()


def test_git_commit_names_head_and_says_when_tracked_files_differ_from_it(tmp_path, monkeypatch):
    """A device call's tree comes with the .git of an older checkout: its HEAD alone would name the wrong code."""
    monkeypatch.delenv("APEX_GIT_COMMIT", raising=False)
    assert harness.git_commit(tmp_path) == "unknown"  # no checkout
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "a.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "a.py"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "a"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    (tmp_path / "untracked.txt").write_text("results\n")
    assert harness.git_commit(tmp_path) == head  # untracked files (results, logs) change nothing
    (tmp_path / "a.py").write_text("x = 2\n")
    assert harness.git_commit(tmp_path) == head + "+modified"
    monkeypatch.setenv("APEX_GIT_COMMIT", "abc123")
    assert harness.git_commit(tmp_path) == "abc123"


def test_write_results_into_out_itself(tmp_path, monkeypatch):
    """``--out-dir $OUT``: the file is written in $OUT and not copied onto itself (shutil.SameFileError)."""
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    path = harness.write_results("demo", {"rows": [1]}, out_dir=out)
    assert path == out / "demo.json" and json.loads(path.read_text())["rows"] == [1]
    monkeypatch.setenv("OUT", str(tmp_path / "." / "out"))  # the same folder under another spelling
    assert json.loads(harness.write_results("demo", {"rows": [2]}, out_dir=out).read_text())["rows"] == [2]


def test_write_results_refuses_path_names(tmp_path):
    with pytest.raises(ValueError, match="plain file stem"):
        harness.write_results("../demo", {}, out_dir=tmp_path)


def test_save_plot(tmp_path):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1], [1, 0])
    path = harness.save_plot(fig, "demo", out_dir=tmp_path)
    plt.close(fig)
    assert path.read_bytes().startswith(b"\x89PNG")


def test_format_table_aligns():
    rows = [
        {"impl": "optax.adamw", "step_ms": 12.3456, "status": "ok"},
        {"impl": "apexw fused", "step_ms": 1.5, "status": "ok"},
        {"impl": "bnb", "step_ms": None, "status": "timeout"},
    ]
    lines = harness.format_table(rows, ["impl", "step_ms", "status"]).splitlines()
    assert len(lines) == 2 + len(rows)
    assert len({len(line) for line in lines}) == 1
    assert lines[2].split() == ["optax.adamw", "12.35", "ok"]
    assert lines[4].split() == ["bnb", "-", "timeout"]
    # Numbers are right-aligned under their header; text is left-aligned.
    step_end = lines[0].index("step_ms") + len("step_ms")
    assert all(line[step_end - 1] != " " for line in (lines[2], lines[3], lines[4]))
    status_start = lines[0].index("status")
    assert lines[4][status_start:].startswith("timeout")
