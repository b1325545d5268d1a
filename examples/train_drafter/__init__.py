"""Train a block drafter for speculative decoding: ``python -m examples.train_drafter --out DIR`` (``train.py``),
on chat prompts built offline (``prompts.py``)."""
