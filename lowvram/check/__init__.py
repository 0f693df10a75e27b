"""Checks of a plan by running the real step: the FakeTensor simulator (simulate.py)."""
