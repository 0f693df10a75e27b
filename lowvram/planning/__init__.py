"""Recipe (+ command-line choices, + detected hardware) -> PlanRequest -> Plan: the one bridge into
the pure :mod:`lowvram.plan`. entry.py (what the CLI calls), request.py (recipe and flags ->
PlanRequest), budget.py (hardware -> budget, what the card can run), fixed.py (defaults when the
model cannot be read)."""
