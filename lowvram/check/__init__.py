"""Checks of a plan by running the real step: measured (step.py) or simulated on fake tensors (simulate.py)."""
