"""``python -m examples.train_drafter``: ``train.main``."""

from examples.train_drafter.train import main

main()
