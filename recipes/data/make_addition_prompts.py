"""Generate recipes/data/addition_prompts.jsonl (the prompts of recipes/smollm2-135m-grpo.yaml).
Deterministic (seed 2044).

Usage: python recipes/data/make_addition_prompts.py recipes/data/addition_prompts.jsonl

Each row is a chat prompt, "What is A + B? Reply with the number only.", A and B drawn from 1-20,
and its ``answer`` column (the sum, as text), which the rewards receive by name
(recipes/rewards/addition.py).
"""
import json
import random
import sys
from pathlib import Path

ROWS = 256


def rows(n: int = ROWS, seed: int = 2044) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 20), rng.randint(1, 20)
        out.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."}],
                    "answer": str(a + b)})
    return out


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).with_name("addition_prompts.jsonl"))
    target.write_text("".join(json.dumps(r) + "\n" for r in rows()))
