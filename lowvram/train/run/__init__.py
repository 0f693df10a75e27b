"""A run's life: the entry point (run.py), the launcher and its workers (launch.py, worker.py),
recovery after an out-of-memory or a signal (recover.py, oom.py, signals.py), the run folder, its
lock and manifest (folder.py, lock.py, manifest.py), checkpoints and resuming (checkpoints.py,
resume_check.py), the checks before loading (preflight.py) and what a run shows and leaves
(progress.py, plots.py). May import build/, data/, types.py, diskfull.py and plan/; never
after/."""
