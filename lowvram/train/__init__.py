"""The run: builds the model, adapters and Trainer the Plan describes and runs them. In layers,
imports only downward (.importlinter, "train/"): after/ (what follows a run) and run/ (a run's
life), independent of each other, over build/ (model and Trainer) over data/ (rows to batches);
types.py (what train is asked and returns, the ignored label id) and diskfull.py (a full disk
recognised) at the bottom. Reads every setting from the Plan; never imports planning."""
