"""Building what a run trains: the model with its quantization, adapters and GGUF conversion
(model.py, gguf.py), the Trainer and its arguments (trainer.py, preference.py for TRL's
trainers), the chunked loss (loss.py) and the techniques wired into them (tiled_mlp.py,
in_backward.py, galore_cpu.py, allocator.py). May import data/, types.py and plan/; never run/
or after/. check/ builds through here, so what is measured is what runs."""
