"""Which setup fits, and why: the techniques and their costs (techniques.py), a request and its
budget (request.py), the search over candidate setups (search.py) and its lazily estimated pool
(pool.py), their reasons (explain.py), the limits of a card (limits.py), the ladder of cheaper
plans (ladder.py), what is not predicted (unpredicted.py), suggestions when nothing fits
(suggestions.py), the choice itself (choose.py) and the replanning a run asks for after an
out-of-memory (replan.py). May import memory/, model/, setup.py, constants/ and types.py."""
