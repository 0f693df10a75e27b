"""What a model is, before any training setup: its shapes and parameter counts (models.py), the
config.json readers per family (readers.py), the offline catalog of names (catalog.py with
catalog.json), one decoder layer's kinds (layer.py), mixture-of-experts (moe.py) and vision towers
(vision.py). May import constants/ and units; never setup.py, memory/ or choose/."""
