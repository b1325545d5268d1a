"""examples.tour (`make demo`) in a tiny mode: every step runs, the optimizer table is filled, every variant learns."""

import io

import numpy as np
import pytest
from rich.console import Console

from examples import tour as demo

TINY_STEPS = 40  # enough for every variant's loss to fall clearly below its start (2.3 -> about 0.5)


def test_tiny_tour_runs_every_step_and_every_variant_learns():
    out = io.StringIO()
    tour = demo.run(steps=TINY_STEPS, console=Console(file=out, width=120))
    text = out.getvalue()

    names = [row.variant for row in tour.optimizer_rows]
    assert names == [variant.name for variant in demo.make_variants(tour.config)]
    for row in tour.optimizer_rows:
        assert row.variant in text  # the row made it into the printed table
        assert row.losses.shape == (TINY_STEPS,) and np.all(np.isfinite(row.losses)), row
        first, last = row.losses[:5].mean(), row.losses[-5:].mean()
        assert last < 0.5 * first, f"{row.variant}: loss {first:.3f} -> {last:.3f}"
        assert 0.5 < row.test_accuracy <= 1.0 and row.step_ms > 0 and row.state_bytes > 0
    per_param = {row.variant: row.bytes_per_param for row in tour.optimizer_rows}
    assert per_param["optax.adamw fp32"] > 7.9 and per_param["apexw int8 (optax)"] < 2.2
    assert "restored bit-exactly" in text
    for step in demo.STEPS:
        assert step.name in text
    assert tour.results["pc_test_accuracy"] > 0.5
    served = tour.results["serving"]  # SmolLM2 through the loopback server and the openai client
    assert "Mercury" in served["reply"] and served["tokens_per_s"] > 0 and served["url"].startswith("http://127.0.0.1:")
    assert served["completion_tokens"] > 1 and 0 < served["ttft_s"] < served["total_s"]
    summary = text[text.index("apex-jax tour"):]  # the summary table comes last, a line per part
    for part in ("apex_jax", "checkpoint", "pc", "serving"):
        assert f"│ {part} " in summary, part
    assert "budget" in summary and set(tour.seconds) == {step.run.__name__ for step in demo.STEPS}


def test_config_rejects_too_few_steps():
    with pytest.raises(ValueError, match="steps must be >= 2"):
        demo.DemoConfig(steps=1)
