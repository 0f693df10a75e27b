"""Fault trials for issue 15 ("never lose a run"): SIGKILL at random moments, then `--resume` until
the run finishes; two runs started at once on one folder; a checkpoint corrupted in place. Each
trial must end with the final loss and adapter weights of one uninterrupted run.

Run: .venv/bin/python bench/fault_trials.py [TRIALS] [SEED]  (~1 min per trial on 2 busy cores);
prints one line per trial and writes bench/results/fault_trials-<date>.txt.
"""

from __future__ import annotations

import datetime
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PY = sys.executable
STEPS, SAVE = 6, 2


def write_recipe(d: Path, model: Path) -> Path:
    rng = random.Random(0)
    with (d / "data.jsonl").open("w") as f:
        for _ in range(48):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"instruction": f"Add {a} and {b}.", "input": "", "output": f"The answer is {a + b}."}) + "\n")
    r = d / "recipe.yaml"
    r.write_text(f"""model: {{name_or_path: {model}}}
data: {{datasets: [{{path: data.jsonl, format: alpaca}}]}}
training: {{max_steps: {STEPS}, learning_rate: 3.0e-3, lr_scheduler: constant, warmup_ratio: 0.0, batch_size: 4,
  seq_len: 64, logging_steps: 1, save_steps: {SAVE}, output_dir: out, report_to: none}}
lora: {{r: 8, alpha: 16, dropout: 0.0}}
techniques: {{lora: on}}
""")
    return r


def train(recipe: Path, *args: str, wait: bool = True):
    cmd = [PY, "-m", "lowvram", "train", str(recipe), *args]
    p = subprocess.Popen(cmd, cwd=recipe.parent, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if wait:
        out, err = p.communicate()
        return p.returncode, out + err
    return p


def result(out: Path):
    from safetensors.torch import load_file

    m = json.loads((out / "metrics.json").read_text())
    return m["train_loss"], m["steps"], load_file(str(out / "adapter_model.safetensors"))


def same(a, b) -> float:
    return max(float((a[2][k] - b[2][k]).abs().max()) for k in a[2])


def finish(recipe: Path) -> tuple[int, str]:
    """--resume (or start again when nothing was saved) until the run finishes."""
    out = recipe.parent / "out"
    for attempt in range(4):
        if (out / "metrics.json").exists():
            return attempt, "finished"
        rc, text = train(recipe, "--resume")
        if rc != 0 and "no checkpoint to resume from" in text:
            rc, text = train(recipe, "--overwrite")
        if rc != 0:
            return attempt, text.strip().splitlines()[-1]
    return 4, "not finished"


def main() -> None:
    trials = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    rng = random.Random(int(sys.argv[2]) if len(sys.argv) > 2 else 15)
    from lowvram.testing import save_tiny_model

    root = Path(tempfile.mkdtemp(prefix="lowvram-faults-"))
    model = save_tiny_model(root / "model")
    ref_dir = root / "ref"
    ref_dir.mkdir()
    rc, text = train(write_recipe(ref_dir, model))
    assert rc == 0, text
    seconds = json.loads((ref_dir / "out" / "metrics.json").read_text())["train_runtime_s"]
    ref = result(ref_dir / "out")
    lines = [f"reference: {STEPS} steps trained in {seconds:.1f} s, final loss {ref[0]:.6f}"]
    print(lines[-1], flush=True)
    ok = 0
    for i in range(trials):
        d = root / f"kill{i}"
        d.mkdir()
        recipe = write_recipe(d, model)
        # At a random point: after step K's log line (K = 0: while the model loads), plus up to a
        # step's time, so the kill lands in steps, checkpoint writes and the final save.
        k, extra = rng.randint(0, STEPS), rng.uniform(0.0, 1.5 * seconds / STEPS)
        p = train(recipe, wait=False)
        wait_for = "loading " if k == 0 else f"step {k}/"
        for line in p.stdout:
            if line.startswith(wait_for):
                break
        time.sleep(extra)
        p.send_signal(signal.SIGKILL)
        p.communicate()
        delay = f"step {k} + {extra:.2f} s"
        saved = sorted(x.name for x in (d / "out").glob("checkpoint-*")) if (d / "out").is_dir() else []
        attempts, how = finish(recipe)
        got = result(d / "out") if how == "finished" else None
        good = got is not None and got[1] == STEPS and abs(got[0] - ref[0]) < 1e-6 and same(got, ref) < 1e-6
        ok += good
        lines.append(f"kill -9 at {delay} (checkpoints then: {', '.join(saved) or 'none'}): "
                     f"{how} after {attempts} resume(s); "
                     + (f"loss {got[0]:.6f}, max weight diff {same(got, ref):.1e}" if got else "")
                     + (" OK" if good else " LOST"))
        print(lines[-1], flush=True)
    # Two runs started at the same instant on one folder: one trains, the other is refused.
    d = root / "twins"
    d.mkdir()
    recipe = write_recipe(d, model)
    a, b = train(recipe, wait=False), train(recipe, wait=False)
    outs = [(p.communicate(), p.returncode)[::-1] for p in (a, b)]
    refused = [o for rc, o in outs if rc == 1 and "is in use by pid" in o[1]]
    twins = sum(rc == 0 for rc, _ in outs) == 1 and len(refused) == 1 and abs(result(d / "out")[0] - ref[0]) < 1e-6
    lines.append(f"two runs at once: exit codes {[rc for rc, _ in outs]}; " + ("OK" if twins else "LOST"))
    print(lines[-1], flush=True)
    lines.append(f"{ok} of {trials} kill trials and {'1' if twins else '0'} of 1 twin trial lost nothing")
    print(lines[-1])
    res = Path(__file__).parent / "results" / f"fault_trials-{datetime.date.today()}.txt"
    res.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
