"""After a run: a trained run's artifacts found and loaded (artifacts.py), its adapter merged into
the base (merge.py) and the model tried (generate.py); export and evaluation belong here too.
May import build/ (to load as training did), data/, types.py, diskfull.py and plan/; never run/."""
