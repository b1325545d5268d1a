"""``serve --quantize``: the CLI flag reaches ``EngineSpec``, whose engine serves the loaded weights quantized per
output column (the same params ``python -m serving quantize`` writes), and the combinations it cannot serve are
refused by name."""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers.server import model_folder

from serving import SamplingParams
from serving import __main__ as cli
from serving.api.cli import _spec, add_commands
from serving.api.engine_spec import EngineSpec
from serving.loaders import load_model
from serving.quantization import QuantizedWeight, is_quantized, quantize_params

SMALL = dict(dtype="float32", num_blocks=64, block_size=4, max_running=2, token_budget=32, max_model_len=64,
             compilation_cache=False)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_commands(parser.add_subparsers())
    return parser.parse_args(argv)


def quantized_leaves(params: dict) -> list[QuantizedWeight]:
    return [leaf for leaf in jax.tree.leaves(params, is_leaf=is_quantized) if is_quantized(leaf)]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_the_engine_serves_the_weights_quantized_as_the_cli_writes_them(tmp_path, kind):
    folder = model_folder(tmp_path)
    spec, _, _ = _spec(_parse(["serve", "--model", str(folder), "--quantize", kind]))
    assert spec.quantize == kind and EngineSpec.from_dict(spec.as_dict()) == spec  # what the core process receives
    engine = EngineSpec(model=str(folder), quantize=kind, **SMALL).build()
    loaded = load_model(folder, jnp.float32)
    want = quantize_params(loaded.params, kind, loaded.cfg)
    got = quantized_leaves(engine.runner.params)
    assert len(got) == len(quantized_leaves(want)) == 7 * loaded.cfg.layers
    for a, b in zip(got, quantized_leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a.q).view(np.uint8), np.asarray(b.q).view(np.uint8))
    assert engine.dtype == jnp.float32  # the cache and plain weights keep the requested dtype
    out = engine.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_refuses_what_it_cannot_quantize(tmp_path):
    with pytest.raises(ValueError, match=r"--quantize 'int4': expected one of \['int8', 'fp8'\]"):
        EngineSpec(quantize="int4")
    with pytest.raises(ValueError, match="--quantize fp8 with --batch-invariant: that mode runs plain"):
        EngineSpec(quantize="fp8", batch_invariant=True)
    with pytest.raises(SystemExit):
        _parse(["serve", "--quantize", "int4"])
    written = tmp_path / "int8"
    cli.main(["quantize", "--model", str(model_folder(tmp_path)), "--kind", "int8", "--out", str(written)])
    with pytest.raises(ValueError, match=r"--quantize fp8: --model '.*int8' is quantized already"):
        EngineSpec(model=str(written), quantize="fp8", **SMALL).build()
