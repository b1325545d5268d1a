"""The prefix cache tiers through the API layer: the CLI flags reach ``EngineSpec`` and the engine, the tiers'
counters cross the core's wire in ``EngineStats`` and show on ``/metrics``."""

import argparse

import httpx
import pytest
from helpers.server import MODEL_NAME, make_engine, model_folder, running_server

from serving.api.cli import _spec, add_commands
from serving.api.engine_client import EngineStats
from serving.api.engine_spec import EngineSpec

SMALL = 16  # GPU blocks: the second prompt evicts the first one's


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    return parser.parse_args(argv)


def test_cli_flags_make_the_spec(tmp_path):
    args = _parse(["serve", "--host-cache-gb", "0.5", "--disk-cache", str(tmp_path), "--persist-disk-cache"])
    spec, _, _ = _spec(args)
    assert (spec.host_cache_gb, spec.disk_cache, spec.persist_disk_cache) == (0.5, str(tmp_path), True)
    assert EngineSpec.from_dict(spec.as_dict()) == spec  # what the core process receives
    with pytest.raises(ValueError, match="--host-cache-gb > 0"):
        EngineSpec(disk_cache=str(tmp_path))
    with pytest.raises(ValueError, match="--persist-disk-cache needs --disk-cache"):
        EngineSpec(host_cache_gb=1.0, persist_disk_cache=True)


def test_tier_counters_cross_the_wire_and_show_on_metrics(tmp_path):
    engine = make_engine(model_folder(tmp_path), num_blocks=SMALL, max_model_len=SMALL * 4, host_cache_gb=0.001)
    assert engine.tiers is not None and engine.tiers.host_blocks > SMALL
    first, second = " ".join(["alpha"] * 6), " ".join(["beta"] * 10)  # ~35 and ~50 byte tokens
    with running_server(engine) as (server, _):
        for prompt in (first, second, first):
            response = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL_NAME, "prompt": prompt,
                                                                        "max_tokens": 2, "temperature": 0}, timeout=120)
            assert response.status_code == 200, response.text
        text = httpx.get(f"{server.url}/metrics").text
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert samples['serving_prefix_cache_hit_blocks_total{tier="host"}'] > 0
    assert samples['serving_prefix_cache_bytes_total{direction="device_to_host"}'] > 0
    assert samples['serving_prefix_cache_bytes_total{direction="host_to_device"}'] > 0
    loaded = samples['serving_prefix_cache_copied_blocks_total{direction="loaded"}']
    assert loaded > 0 and samples['serving_prefix_cache_copied_blocks_total{direction="saved"}'] > 0
    assert 0 < samples["serving_prefix_cache_load_batches_total"] <= loaded
    stats = EngineStats.of(engine)
    assert EngineStats.from_wire(stats.to_wire()) == stats and stats.tiers.host_hits > 0
