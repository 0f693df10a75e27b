"""Predicted vs measured peak memory of real training steps on CPU.

Each case of lowvram.check.cases.ACCURACY_MATRIX builds a small random-init Llama (transformers,
peft, bitsandbytes), runs one warm-up step and one measured step the way the Trainer does, and
compares the exact live tensor bytes (lowvram.livebytes.LiveBytes) with
lowvram.plan.memory.memory.estimate_memory(device="cpu").

    HF_HUB_OFFLINE=1 python bench/plan_accuracy.py [> bench/results/plan_accuracy_cpu.txt]
"""

from __future__ import annotations

import os
import platform
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> int:
    import torch

    from lowvram.check.cases import ACCURACY_MATRIX, SMALL_LOGITS_MATRIX, tiny_llama_spec
    from lowvram.check.step import measure_setup
    from lowvram.plan.memory.memory import estimate_memory
    from lowvram.plan.setup import RunSetup

    spec = tiny_llama_spec()
    print(f"# lowvram plan accuracy on CPU ({time.strftime('%Y-%m-%d')}, torch {torch.__version__}, "
          f"{platform.machine()}); model: Llama h{spec.hidden_size} L{spec.num_layers} "
          f"a{spec.num_heads}/kv{spec.num_kv_heads} I{spec.intermediate_size} V{spec.vocab_size}; "
          "default b1 s512, AdamW fused, clip 1.0")
    print(f"{'case':40} {'predicted':>12} {'measured':>12} {'error':>8}  peak phase")
    small = tiny_llama_spec(vocab_size=512)
    worst = 0.0
    for model, cases in ((spec, ACCURACY_MATRIX), (small, SMALL_LOGITS_MATRIX)):
        if model is small:
            print(f"# small logits: the same model with V{small.vocab_size} (the peak moves into the backward)")
        for name, kw in cases:
            setup = RunSetup(model, device="cpu", **kw)
            measured = measure_setup(setup)
            est = estimate_memory(setup)
            err = (est.peak_bytes - measured.peak_bytes) / measured.peak_bytes * 100
            worst = max(worst, abs(err))
            print(f"{name:40} {est.peak_bytes:>12,} {measured.peak_bytes:>12,} {err:>+7.2f}%  "
                  f"{measured.peak_phase}", flush=True)
    print(f"worst |error|: {worst:.2f}%")
    return 0 if worst <= 3.0 else 1


if __name__ == "__main__":
    sys.exit(main())
