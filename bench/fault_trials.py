"""Fault trials for issue 15 ("never lose a run"): SIGKILL at random moments, then `--resume` until
the run finishes; two runs started at once on one folder; a checkpoint corrupted in place. Each
trial must end with the final loss and adapter weights of one uninterrupted run.

Then issue 42's trials, each through the CLI on the tiny model, bounded in time and memory
(TRIAL_TIMEOUT_S, TRIAL_MEMORY_BYTES), one `holds` / `FAILS` line each: a recipe, data or model
file that is a FIFO, /dev/zero, /dev/urandom or a link to one; a 40 MB data line; a 2 MiB recipe;
train, --print-launch, --resume and merge --out on read-only storage (a real read-only tmpfs:
needs root); generate from a run on read-only storage; `runs` over a damaged run; --resume on a
base model whose weights changed; a custom-code model (auto_map) without the opt-in in train,
generate and merge (a marker file says whether its code ran).

Run: .venv/bin/python bench/fault_trials.py [TRIALS] [SEED]  (~1 min per kill trial on 2 busy
cores, ~5 min for issue 42's; TRIALS 0: none of the kill trials); prints one line per trial and
writes bench/results/fault_trials-<date>.txt.
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



# --------------------------------------------------------------------------------------------
# Issue 42: inputs that are not ordinary files, read-only storage, a damaged run in a listing, a
# base model changed under --resume, custom code without the opt-in. Each trial is one or more
# CLI commands in a child limited to TRIAL_TIMEOUT_S seconds and TRIAL_MEMORY_BYTES of address
# space (a regression fails the trial instead of hanging or eating the machine); it holds when
# every command ends as the issue says (exit code, the error naming the file, no traceback).

TRIAL_TIMEOUT_S = 300
TRIAL_MEMORY_BYTES = 4 << 30
_CHILD = ("import sys\nfrom lowvram.cli import main\ntry:\n    main()\nfinally:\n"
          "    hwm = [x for x in open('/proc/self/status') if x.startswith('VmHWM:')][0].split()[1]\n"
          "    sys.stderr.write(f'peak_rss_kib {hwm}\\n')\n")


def _limit() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (TRIAL_MEMORY_BYTES, TRIAL_MEMORY_BYTES))


def cli(cwd: Path, *args: str) -> tuple[int, str, int]:
    """(exit code, stdout + stderr, peak RSS bytes) of `lowvram ARGS`; exit 124 past the timeout."""
    try:
        p = subprocess.run([PY, "-c", _CHILD, *args], cwd=cwd, capture_output=True, text=True,
                           timeout=TRIAL_TIMEOUT_S, preexec_fn=_limit)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {TRIAL_TIMEOUT_S} s", 0
    lines = (p.stdout + p.stderr).splitlines()
    rss = next((int(x.split()[1]) * 1024 for x in lines if x.startswith("peak_rss_kib ")), 0)
    return p.returncode, "\n".join(x for x in lines if not x.startswith("peak_rss_kib ")), rss


def refused(result: tuple[int, str, int], *needles: str, code: int = 1) -> tuple[bool, str]:
    rc, text, rss = result
    errors = [x for x in text.splitlines() if x.startswith("error: ")]
    ok = rc == code and "Traceback" not in text and len(errors) == (1 if code else 0) and all(n in text for n in needles)
    said = errors[0][:110] if errors else text.strip().splitlines()[-1][:110] if text.strip() else ""
    return ok, f"exit {rc}, peak {rss / 2**20:.0f} MiB: {said}"


def _mount(folder: Path, *options: str) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(("size=16m", *options)), "tmpfs", str(folder)],
                          capture_output=True).returncode == 0


def _umount(folder: Path) -> None:
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def _trial_dir(root: Path, name: str, model: Path) -> tuple[Path, Path]:
    d = root / name
    d.mkdir()
    return d, write_recipe(d, model)


def input_trials(root: Path, model: Path):
    """Item 3: a FIFO, /dev/zero, /dev/urandom or a link to one where a file is read; one 40 MB
    line; a 2 MiB recipe."""
    import shutil

    for kind, cmd in (("fifo", "validate"), ("zero-link", "validate"), ("urandom", "train")):
        d = root / f"recipe-{kind}"
        d.mkdir()
        path = Path("/dev/urandom") if kind == "urandom" else d / "recipe.yaml"
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "zero-link":
            path.symlink_to("/dev/zero")
        yield f"{cmd} on a recipe that is {kind}", refused(cli(d, cmd, str(path)), "not an ordinary file")
    for kind in ("fifo", "zero", "urandom"):
        d, recipe = _trial_dir(root, f"data-{kind}", model)
        (d / "data.jsonl").unlink()
        os.mkfifo(d / "data.jsonl") if kind == "fifo" else (d / "data.jsonl").symlink_to(f"/dev/{kind}")
        yield f"train on a data file that is {kind}", refused(cli(d, "train", str(recipe)), "data file", "not an ordinary file")
    for name, kind in (("config.json", "fifo"), ("tokenizer.json", "zero")):
        d = root / f"model-{name}"
        d.mkdir()
        copy = d / "model"
        shutil.copytree(model, copy)
        (copy / name).unlink()
        os.mkfifo(copy / name) if kind == "fifo" else (copy / name).symlink_to("/dev/zero")
        recipe = write_recipe(d, copy)
        yield f"train on a model whose {name} is {kind}", refused(cli(d, "train", str(recipe)), str(copy / name))
    d, recipe = _trial_dir(root, "huge-line", model)
    rows = (d / "data.jsonl").read_text().splitlines(keepends=True)
    huge = json.dumps({"instruction": "word " * (8 << 20), "input": "", "output": "y"}) + "\n"
    (d / "data.jsonl").write_text("".join(rows[:2]) + huge + "".join(rows[2:]))
    for cmd in ("validate", "train"):
        ok, said = refused(result := cli(d, cmd, str(recipe)), "data.jsonl:3: the line is longer than")
        yield f"{cmd} on a 40 MB line (peak under 1 GiB)", (ok and 0 < result[2] < 1 << 30, said)
    big = d / "big.yaml"
    big.write_text(recipe.read_text() + "# " + "x" * (2 << 20) + "\n")
    yield "validate on a 2 MiB recipe", refused(cli(d, "validate", str(big)), "is larger than 1.0 MiB")


def storage_trials(root: Path, model: Path, finished: Path):
    """Item 4: read-only storage (a real read-only tmpfs; needs root), and `runs` past a damaged run."""
    import shutil

    ro = root / "ro"
    if os.geteuid() != 0 or not _mount(ro, "ro"):
        yield "read-only storage (needs root to mount a tmpfs)", (False, "skipped: not root")
        return
    try:
        d, recipe = _trial_dir(root, "on-ro", model)
        for flags in ((), ("--print-launch",)):
            yield (f"train {' '.join(flags)} into a read-only folder".replace("  ", " "),
                   refused(cli(d, "train", str(recipe), *flags, "--set", f"training.output_dir={ro}"),
                           f"training.output_dir {ro} cannot be written"))
        yield "merge --out into a read-only folder", refused(cli(d, "merge", str(finished), "--out", str(ro / "m")),
                                                             f"{ro}, the folder that would hold --out")
    finally:
        _umount(ro)
    disk = root / "disk"
    if _mount(disk):
        try:
            shutil.copytree(finished, disk / "out")
            subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
            yield "train --resume on a read-only run folder", refused(
                cli(d, "train", str(recipe), "--resume", "--set", f"training.output_dir={disk / 'out'}"),
                f"training.output_dir {disk / 'out'} cannot be written")
            yield "generate from a run on read-only storage", refused(
                cli(d, "generate", str(disk / "out"), "--prompt", "hi", "--max-new-tokens", "2"), code=0)
        finally:
            _umount(disk)
    runs = root / "listing"
    for name in ("good", "garbage", "fifo"):
        shutil.copytree(finished, runs / name)
    (runs / "garbage" / "metrics.json").write_text('{"steps": 2, "train_')
    (runs / "fifo" / "metrics.json").unlink()
    os.mkfifo(runs / "fifo" / "metrics.json")
    rc, text, rss = cli(root, "runs", str(runs))
    warned = [x for x in text.splitlines() if x.startswith("warning: run ")]
    yield "runs over a damaged run and a FIFO metrics.json", (
        rc == 0 and len(warned) == 2 and "garbage" in warned[1] and "fifo" in warned[0],
        f"exit {rc}, {len(warned)} warning(s)")


def resume_trials(root: Path, model: Path):
    """Item 6: --resume after the base model's weights changed at the same path."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = root / "base-changed"
    d.mkdir()
    copy = d / "model"
    shutil.copytree(model, copy)
    recipe = write_recipe(d, copy)
    rc, text = train(recipe, "--set", "training.max_steps=2")
    (d / "out" / "metrics.json").unlink(missing_ok=True)  # as if stopped after checkpoint-2
    weights = copy / "model.safetensors"
    save_file({k: v + 0.01 for k, v in load_file(str(weights)).items()}, str(weights), metadata={"format": "pt"})
    yield "train --resume on a base whose weights changed", refused(
        cli(d, "train", str(recipe), "--resume"), "base model file model.safetensors changed since the run started")


def custom_code_trials(root: Path, model: Path):
    """Item 7: a model folder with auto_map to .py files that write a marker when imported."""
    from lowvram.testing import save_custom_code_model

    d = root / "custom"
    d.mkdir()
    marker = d / "MARKER"
    custom = save_custom_code_model(d / "model", model, marker)
    recipe = write_recipe(d, custom)
    ok, said = refused(cli(d, "train", str(recipe)), "model.trust_remote_code")
    yield "train a custom-code model without the opt-in", (ok and not marker.exists(), said)
    trusted = d / "trusted.yaml"
    trusted.write_text(recipe.read_text().replace(f"name_or_path: {custom}}}", f"name_or_path: {custom}, trust_remote_code: true}}")
                       .replace("output_dir: out", "output_dir: trusted"))
    rc, text = train(trusted)
    marker.unlink(missing_ok=True)
    run = d / "trusted"
    (run / "recipe.yaml").write_text((run / "recipe.yaml").read_text().replace("trust_remote_code: true", "trust_remote_code: false"))
    for args in (("generate", str(run), "--prompt", "hi", "--max-new-tokens", "2"), ("merge", str(run), "--out", str(d / "m"))):
        ok, said = refused(cli(d, *args), "model.trust_remote_code is off")
        yield f"{args[0]} on a run that did not opt in", (ok and not marker.exists(), said)



def guard_trials(root: Path, model: Path, finished: Path):
    """Items 1 and 5 (fault1's, when lowvram/train/run/guard.py is on the branch): a loss that
    turns NaN stops with no NaN model and a finite checkpoint kept; every label masked is refused;
    a finite climbing loss warns; --resume on a finished run changes no file."""
    import hashlib
    import math
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    def finite(folder: Path) -> bool:
        f = folder / "adapter_model.safetensors"
        return f.is_file() and all(bool(t.isfinite().all()) for t in load_file(str(f)).values())

    d = root / "nan"
    d.mkdir()
    poisoned = d / "model"
    shutil.copytree(model, poisoned)
    (q,) = AutoTokenizer.from_pretrained(poisoned)("Q", add_special_tokens=False)["input_ids"]
    weights = load_file(str(poisoned / "model.safetensors"))
    weights["model.embed_tokens.weight"][q] = math.inf  # the row of "Q": a non-finite loss where it is trained
    save_file(weights, str(poisoned / "model.safetensors"), metadata={"format": "pt"})
    recipe = write_recipe(d, poisoned)
    rows = (d / "data.jsonl").read_text().splitlines()
    rows[15] = json.dumps({"instruction": "Add 1 and 2.", "input": "", "output": "Q"})
    (d / "data.jsonl").write_text("\n".join(rows) + "\n")
    recipe.write_text(recipe.read_text().replace(f"save_steps: {SAVE}", "save_steps: 1"))
    ok, said = refused(cli(d, "train", str(recipe)), "nan")
    kept = [c for c in (d / "out").glob("checkpoint-*") if finite(c)] if (d / "out").is_dir() else []
    final = d / "out" / "adapter_model.safetensors"
    yield "train on a loss that turns NaN (no NaN model, a finite checkpoint kept)", (
        ok and bool(kept) and (not final.exists() or finite(d / "out")), said)

    d, recipe = _trial_dir(root, "masked", model)
    (d / "text.jsonl").write_text((json.dumps({"text": "The quick brown fox jumps over the lazy dog."}) + "\n") * 16)
    recipe.write_text(recipe.read_text().replace("data.jsonl, format: alpaca", "text.jsonl, format: text")
                      .replace("seq_len: 64", "seq_len: 1"))
    yield "train on data whose every label is masked", refused(cli(d, "train", str(recipe)), "every label is masked")

    d, recipe = _trial_dir(root, "climbing", model)
    recipe.write_text(recipe.read_text().replace("learning_rate: 3.0e-3", "learning_rate: 0.9, max_grad_norm: 0")
                      .replace("techniques: {lora: on}", "techniques: {lora: off, mixed_precision: fp32}"))
    rc, text, rss = cli(d, "train", str(recipe))
    yield "train on a loss that climbs (a warning)", ("diverging" in text and "Traceback" not in text,
                                                      f"exit {rc}, peak {rss / 2**20:.0f} MiB")

    d = root / "finished"
    shutil.copytree(finished.parent, d)
    def digests():
        return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((d / "out").rglob("*")) if p.is_file()}
    before = digests()
    rc, text, rss = cli(d, "train", str(d / "recipe.yaml"), "--resume")
    yield "train --resume on a finished run (no file changed)", (
        digests() == before and "Traceback" not in text, f"exit {rc}: " + next(
            (x for x in text.splitlines() if x.startswith("error: ")), "")[:100])

def issue42_trials(root: Path, model: Path, finished: Path) -> list[str]:
    lines = []
    groups = [input_trials(root, model), storage_trials(root, model, finished), resume_trials(root, model),
              custom_code_trials(root, model)]
    if (Path(__file__).parent.parent / "lowvram" / "train" / "run" / "guard.py").is_file():  # items 1, 2, 5 landed
        groups.append(guard_trials(root, model, finished))
    for trials in groups:
        for name, (ok, said) in trials:
            lines.append(f"{'holds' if ok else 'FAILS'}: {name} ({said})")
            print(lines[-1], flush=True)
    return lines


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
    found = issue42_trials(root, model, ref_dir / "out")
    lines += found
    lines.append(f"issue 42: {sum(x.startswith('holds') for x in found)} of {len(found)} trials hold")
    print(lines[-1])
    res = Path(__file__).parent / "results" / f"fault_trials-{datetime.date.today()}.txt"
    res.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
