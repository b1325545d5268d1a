"""benchmarks/serving_multistep.py on the tiny random MoE: every (batch, n) row is written, n steps per dispatch
cut the decode dispatches by n with the same tokens, and bad arguments are refused."""

import json

import pytest

from benchmarks import serving_multistep


def test_tiny_sweep_writes_every_row_with_fewer_dispatches_and_the_same_tokens(tmp_path):
    argv = ["--models", "tiny", "--batches", "1,2", "--steps", "1,2,4", "--decode-tokens", "8", "--repeats", "1"]
    serving_multistep.main([*argv, "--name", "multistep", "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "multistep.json").read_text())
    assert result["benchmark"] == "multistep" and result["meta"]["repeats"] == 1
    rows = result["rows"]
    assert [(r["model"], r["batch"], r["decode_steps"]) for r in rows] == [("tiny", b, n) for b in (1, 2)
                                                                           for n in (1, 2, 4)]
    base = {r["batch"]: r["decode_tokens_per_s"] for r in rows if r["decode_steps"] == 1}
    for r in rows:
        assert r["identical"] and r["dispatches"] == 8 // r["decode_steps"], r
        assert r["decode_tokens_per_s"] == pytest.approx(r["batch"] * 8 / r["decode_seconds"])
        assert r["speedup"] == pytest.approx(r["decode_tokens_per_s"] / base[r["batch"]])
        assert r["best_tokens_per_s"] >= r["decode_tokens_per_s"]
    assert (tmp_path / "multistep.png").stat().st_size > 0


@pytest.mark.parametrize("argv", [["--steps", "2,4"], ["--steps", "1,0"], ["--batches", "one"], ["--repeats", "0"],
                                  ["--models", "gpt-5"], ["--models", "tiny,tiny"]])
def test_rejects_bad_arguments(argv):
    with pytest.raises(SystemExit):
        serving_multistep.main(["--models", "tiny", *argv])
