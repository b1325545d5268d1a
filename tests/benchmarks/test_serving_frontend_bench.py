"""benchmarks/serving_frontend.py: the front end's capacity against a synthetic core, both variants, one small run."""

import json

import pytest

from benchmarks import serving_frontend


def test_both_variants_stream_every_token_of_the_synthetic_core_and_write_json_and_png(tmp_path):
    rows = serving_frontend.main(["--concurrency", "2,3", "--tokens-per-event", "1,3", "--output-len", "7",
                                  "--requests-per-client", "2", "--step-ms", "2", "--out-dir", str(tmp_path)])
    [path] = tmp_path.glob("serving_frontend_*.json")  # named by the platform
    assert json.loads(path.read_text())["rows"] == json.loads(json.dumps(rows)) and path.with_suffix(".png").is_file()
    assert [(r["tokens_per_event"], r["variant"], r["concurrency"]) for r in rows] == [
        (k, v, c) for k in (1, 3) for v in serving_frontend.VARIANTS for c in (2, 3)]
    for r in rows:
        # every request streamed its 7 tokens (runs of 3, 3, 1 at 3 per event), none failed
        assert r["statuses"]["ok"] == r["requests"] == 2 * r["concurrency"], r
        assert r["output_tokens"] == 7 * r["requests"]
        assert r["offered_throughput"] == pytest.approx(r["concurrency"] / 2e-3)
        assert 0 < r["output_throughput"] < 1.1 * r["offered_throughput"]
        assert r["frontend_us_per_token"] > 0 and 0 < r["client_cpu"] < 1
    for r in rows[2:4] + rows[6:]:  # the reference's own ratios
        assert r["variant"] == "uvicorn-defaults" and r["throughput_vs_defaults"] == r["cpu_per_token_vs_defaults"] == 1


def test_one_client_process_or_concurrency_one_is_refused():
    with pytest.raises(ValueError, match="client_processes 1"):
        serving_frontend.run([4], [1], dict(serving_frontend.DEFAULTS, client_processes=1))
    with pytest.raises(ValueError, match=r"concurrency \[1\]"):
        serving_frontend.run([1], [1], dict(serving_frontend.DEFAULTS))
