"""The suite's setup, read by pytest before any test module: the tests/ root on ``sys.path``, so every folder
imports the shared helpers as ``helpers.<module>``."""

import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parent)
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
