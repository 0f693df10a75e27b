"""Generate recipes/data/lowvram_preference.jsonl (preference pairs for the DPO/ORPO recipes) from
lowvram_instruct.jsonl, and beside it lowvram_unpaired.jsonl (for the KTO recipe). Deterministic.

Usage: python recipes/data/make_lowvram_preference.py recipes/data/lowvram_preference.jsonl

Each row is conversational: the instruction (and its input) as the user's message, the set's
exact answer as the chosen assistant message, and a worse one as the rejected: its first number
that the question does not hold changed (a wrong result, same shape), or, where the answer has no number, the direct sentence
without its explanation (a correct but unexplained answer).

The unpaired file has two rows per pair: the chosen answer with label true, the rejected one with
label false, shuffled (seed 2029) so a batch seldom holds both halves of one pair (TRL's KTO
estimates its KL term from mismatched prompt/completion rows of a batch).
"""
import json
import random
import re
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("lowvram_instruct.jsonl")
NUMBER = re.compile(r"\d[\d,]*(?:\.\d+)?")


def wrong_number(text: str, prompt: str, rng: random.Random) -> str | None:
    """The answer with its first number that the prompt does not hold changed (the result, not
    a restated quantity of the question)."""
    given = set(NUMBER.findall(prompt))
    m = next((m for m in NUMBER.finditer(text) if m.group() not in given), None)
    if not m:
        return None
    digits = m.group().replace(",", "")
    value = float(digits) if "." in digits else int(digits)
    changed = value + rng.choice((1, 2, 3, 10)) if isinstance(value, int) else round(value * 1.5, 2)
    return text[:m.start()] + (f"{changed:,}" if "," in m.group() else str(changed)) + text[m.end():]


def rejected_for(output: str, prompt: str, rng: random.Random) -> str | None:
    wrong = wrong_number(output, prompt, rng)
    if wrong and wrong != output:
        return wrong
    first = output.split(". ")[0].rstrip(".") + "."
    return first if first != output else None


def main(out: str) -> None:
    rng = random.Random(2028)
    rows = []
    for line in SOURCE.read_text().splitlines():
        r = json.loads(line)
        user = r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "")
        rejected = rejected_for(r["output"], user, rng)
        if rejected is None:
            continue
        rows.append({"prompt": [{"role": "user", "content": user}],
                     "chosen": [{"role": "assistant", "content": r["output"]}],
                     "rejected": [{"role": "assistant", "content": rejected}]})
    write(out, rows)
    print(f"wrote {len(rows)} pairs to {out}")
    unpaired = [{"prompt": p["prompt"], "completion": p[k], "label": k == "chosen"}
                for p in rows for k in ("chosen", "rejected")]
    random.Random(2029).shuffle(unpaired)
    write(str(Path(out).with_name("lowvram_unpaired.jsonl")), unpaired)
    print(f"wrote {len(unpaired)} unpaired rows beside it")


def write(out: str, rows: list[dict]) -> None:
    with open(out, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).with_name("lowvram_preference.jsonl")))
