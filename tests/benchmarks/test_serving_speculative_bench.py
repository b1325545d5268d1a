"""benchmarks/serving_speculative.py: its prompt sets, its plot on rows shaped like its own, and a whole run on the
tiny Llama fixture (with a tokenizer), every row compared with the best baseline."""

import json

import matplotlib.pyplot as plt
import pytest
from helpers.server import model_folder

from benchmarks import serving_speculative


def _row(prompts: str, drafter: str, concurrency: int, tokens_per_s: float, speedup: float,
         acceptance: float) -> dict:
    return dict(prompts=prompts, drafter=drafter, concurrency=concurrency, tokens_per_s=tokens_per_s, speedup=speedup,
                mean_acceptance_length=acceptance)


def test_agentic_prompts_carry_the_file_and_are_the_same_every_time():
    prompts = serving_speculative.agentic_prompts(4)
    assert prompts == serving_speculative.agentic_prompts(4)
    text = prompts[0][0]["content"]
    assert "Reply with the whole updated file only." in text and "```python\n" in text and "def " in text
    assert len({p[0]["content"] for p in prompts}) == 4
    chats = serving_speculative.prompt_set("chat", 70)  # more than the 64 held-out chats: cycled
    assert len(chats) == 70 and chats[64] == chats[0]


def test_plot_draws_every_drafter_at_every_concurrency_it_ran(tmp_path):
    rows = [_row("chat", "none_d1", 1, 200.0, 0.8, 1.0), _row("chat", "suffix", 1, 320.0, 1.28, 2.4),
            _row("chat", "ngram", 1, 250.0, 1.0, 1.9), _row("chat", "suffix", 16, 1000.0, 0.99, 1.9),
            _row("agentic", "suffix", 1, 700.0, 2.8, 4.1)]
    serving_speculative.plot(rows, "spec", tmp_path)
    assert (tmp_path / "spec.png").stat().st_size > 0
    chat, agentic = plt.gcf().axes
    assert [t.get_text() for t in chat.get_xticklabels()] == ["suffix", "ngram"]  # no bar for a baseline
    assert [t.get_text() for t in chat.texts] == ["x1.28\n320/s\nacc 2.40", "x1.00\n250/s\nacc 1.90",
                                                  "x0.99\n1000/s\nacc 1.90"]
    assert agentic.get_title() == "agentic prompts"


def test_a_pass_that_compiled_counts_in_no_median():
    assert serving_speculative.median([None, 2.0, 5.0, 4.0]) == 4.0
    assert serving_speculative.median([None, None]) is None


def test_plot_without_drafted_rows_writes_nothing(tmp_path):
    serving_speculative.plot([_row("chat", "none_d1", 1, 200.0, 1.0, 1.0)], "spec", tmp_path)
    assert not (tmp_path / "spec.png").exists()


@pytest.mark.slow  # ~30-60 s on 2 shared cores: three engines compile their shapes
def test_a_run_on_the_tiny_model_compares_each_drafter_with_the_best_baseline_round_by_round(tmp_path):
    folder = model_folder(tmp_path)
    serving_speculative.main(["--model", str(folder), "--max-tokens", "6", "--prompts", "2", "--concurrency", "2",
                              "--sets", "agentic", "--drafters", "suffix", "--rounds", "3", "--name", "spec",
                              "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "spec.json").read_text())
    rows = result["rows"]
    assert [r["drafter"] for r in rows] == ["none_d1", "none_d8", "suffix"]
    assert rows[2]["decode_steps"] in (rows[0]["decode_steps"], rows[1]["decode_steps"])  # on a baseline's
    assert [1.0, 1.0, 1.0] in (rows[0]["speedups"], rows[1]["speedups"])  # every row over one baseline, each round
    for row in rows:
        assert row["rounds"] == len(row["speedups"]) == 3
        assert row["speedup"] == sorted(row["speedups"])[1]  # the median round
        assert row["identical_outputs"] == 2 and row["tokens"] == 12  # greedy: every row the same tokens
        # warm passes (at least 3: two, then one that compiles nothing), then the timed ones, which compile nothing:
        # a baseline's in the 3 rounds that pick the best and in the 3 of every row
        timed = 6 if row["drafter"] in serving_speculative.BASELINES else 3
        assert row["compiles_timed"] == 0 and 3 + timed <= row["passes"] <= serving_speculative.MAX_PASSES + timed
    assert result["meta"]["git_commit"] and (tmp_path / "spec.png").exists()
