"""What a training step keeps alive, term by term: the named moments (moments.py) and the estimate
that sums them (memory.py) over the floor no estimate is below (floor.py), from weights and
states (states.py, optimizers.py, sharding.py) to activations (activations.py, images.py), the
backward (backward.py), tiling (tiled.py), and the terms of adapters (dora.py, lora_init.py) and
objectives (preference.py), with the measured calibration (calibration.py). May import model/,
setup.py and constants/; never choose/. A new objective or technique adds its memory term here."""
