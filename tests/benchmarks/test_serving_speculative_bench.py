"""benchmarks/serving_speculative.py's plot, on rows shaped like the benchmark's."""

import matplotlib.pyplot as plt

from benchmarks import serving_speculative


def _row(drafter: str, concurrency: int, tokens_per_s: float, speedup: float, acceptance: float) -> dict:
    return dict(drafter=drafter, concurrency=concurrency, tokens_per_s=tokens_per_s, speedup=speedup,
                mean_acceptance_length=acceptance)


def test_plot_draws_every_drafter_at_every_concurrency_it_ran(tmp_path):
    rows = [_row("none", 1, 200.0, 1.0, 1.0), _row("ngram", 1, 320.0, 1.6, 2.4),
            _row("self_spec_8l", 1, 80.0, 0.4, 1.0),
            _row("none", 16, 2000.0, 1.0, 1.0), _row("ngram", 16, 1000.0, 0.5, 1.9)]  # self_spec did not run at 16
    serving_speculative.plot(rows, "spec", tmp_path, k=4)
    assert (tmp_path / "spec.png").stat().st_size > 0
    speed, accept = plt.gcf().axes
    assert [t.get_text() for t in speed.get_xticklabels()] == ["ngram", "self_spec_8l"]  # no bar for "none"
    assert [t.get_text() for t in speed.texts] == ["x1.60\n320 tok/s", "x0.40\n80 tok/s", "x0.50\n1000 tok/s"]
    assert [t.get_text() for t in accept.texts] == ["2.40", "1.00", "1.90"]
    assert accept.get_legend_handles_labels()[1][0] == "every draft accepted (k=4)"


def test_plot_without_drafted_rows_writes_nothing(tmp_path):
    serving_speculative.plot([_row("none", 1, 200.0, 1.0, 1.0)], "spec", tmp_path, k=4)
    assert not (tmp_path / "spec.png").exists()
