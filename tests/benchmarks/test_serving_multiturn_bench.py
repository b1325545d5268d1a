"""benchmarks/serving_multiturn.py --cpu: both engines serve every turn with the same answers, the host tier
serves blocks the GPU evicted and cuts the prefill tokens computed, users pausing between turns as asked; a workload
that fits the GPU is refused."""

import json

import pytest

from benchmarks import serving_multiturn


@pytest.mark.slow  # ~60 s on 2 shared cores (five modes of one engine, each with an untimed round)
def test_cpu_run_writes_both_rows_and_the_host_tier_cuts_prefill(tmp_path, monkeypatch):
    think_ms = 20.0  # each user pauses between turns: its turns span at least (turns - 1) pauses
    written = []  # the modes in each write of the JSON: one more each time (a run cut short keeps its rows)
    write_results = serving_multiturn.write_results
    monkeypatch.setattr(serving_multiturn, "write_results", lambda name, result, out_dir: (
        written.append([r["mode"] for r in result["rows"]]), write_results(name, result, out_dir)))
    rows = serving_multiturn.main(["--cpu", "--name", "multiturn", "--think-ms", str(think_ms), "--host-batches",
                                   "64,2", "--tier-copies", "put,program", "--decode-steps", "2",
                                   "--layers", "1", "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "multiturn.json").read_text())
    assert result["rows"] == rows and [r["mode"] for r in rows] == ["gpu", "gpu+host", "gpu+host/program",
                                                                    "gpu+host/2", "gpu+host/2/program"]
    assert result["working_set_blocks"] > result["settings"]["num_blocks"]
    assert written == [[r["mode"] for r in rows[:i]] for i in range(1, len(rows) + 1)]
    assert result["settings"]["decode_steps"]["n"] == 2  # the engine's multi-step decode, as asked
    assert result["settings"]["layers"] == 1  # of the tiny model's 2
    gpu, tiered, program, small, small_program = rows
    workload = serving_multiturn.CPU_WORKLOAD
    turn_len = workload["user_len"] + workload["answer_len"]
    prompt_tokens = workload["users"] * sum(workload["system_len"] + workload["user_len"] + t * turn_len
                                            for t in range(workload["turns"]))
    for row in rows:
        assert row["requests"] == workload["users"] * workload["turns"]
        assert row["output_tokens"] == row["requests"] * workload["answer_len"]
        assert row["same_answers"] == 1.0  # fp32: restored blocks give the tokens recomputation gives
        assert row["seconds"] >= (workload["turns"] - 1) * think_ms / 1e3
        # every prompt token is either computed or served by the cache (no preemption recomputes any), whichever
        # scheduling path admitted it (the step dispatched ahead of the one in flight included)
        assert row["preemptions"] == 0 and row["prefill_tokens"] + row["cached_prompt_tokens"] == prompt_tokens
        # the slowest requests' TTFTs, each its wait for admission and the rest; the wait is part of the TTFT
        slowest = row["slowest"]
        assert len(slowest) == serving_multiturn.SLOWEST and slowest[0]["ttft_ms"] == max(row["ttft_ms"])
        assert [r["ttft_ms"] for r in slowest] == sorted((r["ttft_ms"] for r in slowest), reverse=True)
        assert all(0 <= r["wait_ms"] <= r["ttft_ms"] and r["cached_tokens"] < r["prompt_tokens"] for r in slowest)
        assert 0 <= row["wait_median_ms"] <= row["wait_p99_ms"] <= max(row["ttft_ms"])
        # executables compiled while timed, counted (on the CPU nothing is warmed up, so a shape the untimed round
        # did not meet may compile)
        assert isinstance(row["compiles"], int) and row["compiles"] >= 0
    assert "tiers" not in gpu and tiered["tiers"]["host_hits"] > 0 and tiered["tiers"]["saved_blocks"] > 0
    for row in (tiered, program, small, small_program):
        assert row["prefill_tokens"] < gpu["prefill_tokens"]
    # a load moves its block's whole host batch, of at most `most` rows
    for row, most in ((tiered, 64), (program, 64), (small, 2), (small_program, 2)):
        tiers = row["tiers"]
        block_bytes = tiers["device_to_host_bytes"] / tiers["saved_blocks"]
        assert tiers["loaded_blocks"] * block_bytes <= tiers["host_to_device_bytes"]
        assert tiers["host_to_device_bytes"] <= tiers["load_batches"] * most * block_bytes
    assert tiered["cached_prompt_tokens"] > gpu["cached_prompt_tokens"]
    assert tiered["prefill_reduction"] == pytest.approx(gpu["prefill_tokens"] / tiered["prefill_tokens"])
    assert (tmp_path / "multiturn.png").stat().st_size > 0


@pytest.mark.parametrize("argv", [["--num-blocks", "4096"], ["--users", "0"], ["--turns", "100"],
                                  ["--think-ms", "-1"], ["--host-batches", "3"], ["--host-batches", "128"],
                                  ["--host-batches", "a"], ["--tier-copies", "put,dma"], ["--decode-steps", "0"],
                                  ["--layers", "0"]])
def test_rejects_a_workload_that_fits_or_is_bad(argv):
    with pytest.raises(SystemExit):
        serving_multiturn.main(["--cpu", *argv])
