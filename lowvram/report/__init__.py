"""All printing happens here: rich tables for people, JSON for scripts. No arithmetic.

console.py (console, error/hint lines, JSON), plans.py, training.py, results.py, info.py."""
