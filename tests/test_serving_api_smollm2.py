"""The demo round trip with the real SmolLM2-135M-Instruct: loopback server, official openai client (slow)."""

import pytest

from serving.api import demo_round_trip


@pytest.mark.slow  # loads SmolLM2 and compiles its steps: about a minute on 2 shared cores
def test_demo_round_trip_answers_paris(capsys):
    result = demo_round_trip(max_tokens=24)
    assert "Paris" in result["reply"] and result["completion_tokens"] > 0 and result["tokens_per_s"] > 0
    assert result["url"].startswith("http://127.0.0.1:")
    assert "tokens/s" in capsys.readouterr().out
