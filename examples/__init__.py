"""Runnable examples that use the parts together; importable from the repository root, not installed.

tour.py is ``make demo`` (``python -m examples.tour``); serving_client.py is its serving step, a chat request
through the official ``openai`` client (the ``demo`` extra).
"""
