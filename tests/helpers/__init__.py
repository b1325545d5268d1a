"""Helpers shared by the test folders (no tests here), imported as ``helpers.<module>`` from every folder: the
tests/ root is on ``sys.path`` (tests/conftest.py puts it there).

``hf``: the HF fixtures' configs, tensors and a ragged prefill through the paged cache; ``server``: the tiny Llama
with a tokenizer and a loopback server; ``engine``: made-up sequences, request mixes and an engine driver;
``kernels``: packed attention inputs and the lowered-module readers of the kernel tests."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent
HF = TESTS / "fixtures" / "hf"  # tiny random HF checkpoints and their reference logits (fixtures/make_hf_fixtures.py)
