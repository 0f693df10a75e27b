"""Step time of each full fine-tuning optimizer against AdamW on this CPU: a cross-check of the
step-time factors in lowvram.plan.choose.techniques.OPTIMIZER_SLOWDOWN, which come from published GPU
measurements (the sources are beside each factor). A CPU ratio is not a GPU number: the CPU's
matmuls are slow next to its memory-bound optimizer arithmetic, so the optimizer's share of a step
differs; what carries over is the order and the per-step host work (Python loops, hooks).

Each optimizer runs through the Trainer `lowvram train` builds (lowvram.train.build.trainer:
build_training_args + build_trainer, the Plan's optimizer arguments, clipping where the plan keeps
it), same model (seed 0), same batch, same tokens. A callback times every step: the forward and
backward until the optimizer step (in-backward forms step inside it), then the optimizer step and
zero_grad, in CPU seconds of this process (time.process_time: a shared machine's other processes
changed the wall time of a round up to fourfold, hardly its CPU time). Step 1 makes the state (and
GaLore's first SVD, APOLLO's first projector); the steady steps after WARMUP are the median; ROUNDS
rounds run every optimizer in turn, and the fastest round is reported, with the ratio of the
rounds' medians beside it. torch runs on one thread.

Run: .venv/bin/python bench/optimizer_step_time.py [--hidden 512 --layers 4 --seq-len 512]
(about 5 minutes on an idle core); writes bench/results/optimizer_step_time.txt.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lowvram.check.builders import build_model, setup_plan  # noqa: E402
from lowvram.check.cases import tiny_llama_spec  # noqa: E402
from lowvram.plan.choose.techniques import OPTIMIZER_SLOWDOWN  # noqa: E402
from lowvram.plan.setup import RunSetup  # noqa: E402

OPTIMIZERS = ("adamw", "adamw_8bit", "adamw_in_backward", "galore_adamw", "galore_adamw_8bit",
              "galore_adamw_layerwise", "galore_adamw_8bit_layerwise", "apollo_adamw",
              "apollo_adamw_layerwise", "lomo")
# adalomo is not here: lomo_optim's AdaLomo makes its state with .cuda() (it needs CUDA,
# lowvram.plan.memory.optimizers), so this CPU cannot cross-check it
WARMUP = 2


def _recipe(setup: RunSetup, steps: int, output_dir: str):
    import yaml

    from lowvram.recipe import parse_recipe

    return parse_recipe(yaml.safe_dump({
        "model": {"name_or_path": "random-init"},
        "data": {"datasets": [{"path": "none.jsonl", "format": "text"}]},
        "training": {"seq_len": setup.seq_len, "batch_size": setup.micro_batch_size,
                     "micro_batch_size": setup.micro_batch_size, "max_steps": steps, "learning_rate": 1e-5,
                     "lr_scheduler": "constant", "logging_steps": 1000, "save_steps": 100000,
                     "output_dir": output_dir, "report_to": "none"},
    }))


def time_steps(setup: RunSetup, steps: int) -> list[tuple[float, float]]:
    """(forward+backward, optimizer step) seconds of each of ``steps`` Trainer steps of ``setup``."""
    import torch
    from transformers import TrainerCallback, default_data_collator

    from lowvram.train.build.trainer import build_trainer, build_training_args

    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(steps * setup.micro_batch_size):
        ids = torch.randint(0, setup.model.vocab_size, (setup.seq_len,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    times: list[tuple[float, float]] = []

    class Clock(TrainerCallback):
        begin = mid = 0.0

        def on_step_begin(self, args, state, control, **kw):
            self.begin = time.process_time()

        def on_pre_optimizer_step(self, args, state, control, **kw):
            self.mid = time.process_time()

        def on_step_end(self, args, state, control, **kw):
            end = time.process_time()
            times.append((self.mid - self.begin, end - self.mid))

    model = build_model(setup)
    with tempfile.TemporaryDirectory() as out:
        args = build_training_args(_recipe(setup, steps, out), setup_plan(setup, "cpu"))
        trainer = build_trainer(SimpleNamespace(model=model, tokenizer=None), SimpleNamespace(train=rows, eval=None),
                                args, default_data_collator, callbacks=[Clock()], optimizer=setup.optimizer)
        trainer.train()
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--precision", default="bf16")
    p.add_argument("--steps", type=int, default=8, help="timed steps per run, after the warm-up")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", nargs="*", default=None, help="a subset of the optimizers (adamw is always run)")
    p.add_argument("--out", default="bench/results/optimizer_step_time.txt")
    a = p.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    spec = tiny_llama_spec(hidden_size=a.hidden, num_layers=a.layers, vocab_size=a.vocab)
    base = RunSetup(spec, precision=a.precision, seq_len=a.seq_len, micro_batch_size=1, device="cpu")
    names = OPTIMIZERS if not a.only else ("adamw",) + tuple(o for o in a.only if o != "adamw")
    runs: dict[str, list[tuple[float, float, float, float]]] = {n: [] for n in names}
    for r in range(a.rounds):
        for name in names:
            times = time_steps(replace(base, optimizer=name), WARMUP + a.steps)
            steady = times[WARMUP:]
            runs[name].append((statistics.median(f + o for f, o in steady), statistics.median(f for f, _ in steady),
                               statistics.median(o for _, o in steady), sum(times[0])))
            print(f"round {r + 1} {name}: {runs[name][-1][0] * 1e3:.0f} ms/step", file=sys.stderr, flush=True)

    def med(name, i):  # the fastest round's (its median step)
        return min(runs[name], key=lambda run: run[0])[i]

    def round_median(name):
        return statistics.median(run[0] for run in runs[name])

    adamw = med("adamw", 0)
    lines = [
        f"# {Path(__file__).name}: Trainer steps on this CPU (1 thread, CPU time), torch {torch.__version__}",
        f"# tiny Llama hidden {a.hidden}, {a.layers} layers, vocab {a.vocab} (MLP "
        f"{spec.hidden_size}x{spec.intermediate_size}), {a.precision}, batch 1 x seq {a.seq_len}; "
        f"median of {a.steps} steady steps after {WARMUP}, the fastest of {a.rounds} rounds",
        "# step/AdamW: the CPU ratio, fastest rounds (a cross-check, not a GPU number); median: of the rounds' "
        "medians; planner: OPTIMIZER_SLOWDOWN",
        "# fwd+bwd: until the optimizer step (in-backward forms step inside it); step: optimizer step + zero_grad",
        "# first step: step 1 (makes the state; GaLore's first SVD, APOLLO's first projector)",
        "# adalomo: not measured (lomo_optim's AdaLomo needs CUDA)",
        "",
        f"{'optimizer':<30} {'ms/step':>8} {'fwd+bwd':>8} {'step':>7} {'first':>7} {'step/AdamW':>10} {'median':>7} {'planner':>8}",
    ]
    for name in names:
        lines.append(f"{name:<30} {med(name, 0) * 1e3:8.0f} {med(name, 1) * 1e3:8.0f} {med(name, 2) * 1e3:7.0f} "
                     f"{med(name, 3) * 1e3:7.0f} {med(name, 0) / adamw:10.2f} {round_median(name) / round_median('adamw'):7.2f} "
                     f"{OPTIMIZER_SLOWDOWN[name]:8.2f}")
    text = "\n".join(lines) + "\n"
    print(text)
    Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
