"""What the CPU live-bytes tracker (lowvram.livebytes.LiveBytes, on by default for CPU runs; `lowvram
train --no-track-memory` turns it off) costs in the shipped GRPO recipe's generation: CPU seconds
(time.process_time, user + sys of every thread) of one generation round of
recipes/smollm2-135m-grpo.yaml (SmolLM2-135M-Instruct as lowvram loads it, LoRA on, 8 rows = 2
prompts x 4 generations, 16 new tokens), alternately without and with the tracker, then one tracked
round under cProfile: the tracker's own Python time (tottime of __torch_dispatch__, track, the
finalizers) against its cumulative time, which holds every aten op it dispatches.

    PYTHONPATH=. python bench/grpo_tracker_cost.py [--rounds 2]

Quote CPU seconds, not wall: the host is shared.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "smollm2-135m-grpo.yaml"


def main() -> int:
    import torch

    from lowvram.livebytes import LiveBytes
    from lowvram.planning.fixed import resolve_fixed
    from lowvram.recipe import load_recipe
    from lowvram.train.build.model import load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2, help="pairs of untracked and tracked rounds")
    args = ap.parse_args()
    recipe = load_recipe(RECIPE)
    loaded = load_model(recipe, resolve_fixed(recipe))
    model, tok = loaded.model, loaded.tokenizer
    rows = [json.loads(line) for line in (RECIPE.parent / "data" / "addition_prompts.jsonl").open()][:2]
    texts = [tok.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True)
             for r in rows for _ in range(recipe.grpo.num_generations)]
    tok.padding_side = "left"
    batch = tok(texts, return_tensors="pt", padding=True)
    new = recipe.grpo.max_completion_length

    def generate():
        torch.manual_seed(0)
        with torch.no_grad():
            return model.generate(**batch, max_new_tokens=new, min_new_tokens=new, do_sample=True)

    generate()  # warm
    for _ in range(args.rounds):
        for tracked in (False, True):
            t0 = time.process_time()
            if tracked:
                tracker = LiveBytes()
                tracker.register(model)
                with tracker:
                    generate()
            else:
                generate()
            print(f"{'tracked' if tracked else 'untracked':>9}: {time.process_time() - t0:6.2f} s CPU", flush=True)
    tracker = LiveBytes()
    tracker.register(model)
    prof = cProfile.Profile()
    with tracker:
        prof.enable()
        generate()
        prof.disable()
    for (path, _line, name), (_, calls, own, total, _) in pstats.Stats(prof).stats.items():
        if "livebytes" in path and name in ("__torch_dispatch__", "track", "add", "drop"):
            print(f"  {name:>18}: {calls:>7} calls, own {own:5.2f} s, cumulative {total:7.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
