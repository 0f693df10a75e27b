"""The planner: given a model, a request and a card, the peak memory of a training step and the
cheapest techniques that fit. Pure (no torch, no recipe, no hardware probe) and in three layers,
imports only downward (.importlinter, "plan/"): model/ (what a model is) under memory/ (what a
step keeps alive) under choose/ (which setup fits, and why). Beside them: constants/ (the one
table of fitted constants, part by part, each with its source), types.py (the Plan handed to train/), cards.py
(a card's memory size as sold), setup.py (RunSetup and MemoryEstimate: a run as the memory terms
see it, built from the model's facts, so a floor between model/ and memory/) and serialize.py
(a chosen plan written down, above the choice)."""
