"""CPU ladder: measured peak (live tensor bytes) and step time as each technique is added, with
the planner's prediction beside it (like torchtune's published memory/speed table).

Small Llama (hidden 512, 8 layers, vocab 32000), batch 1 x seq 512, one step after a warm-up,
measured with lowvram.check.step (the Trainer's step: autocast, clip, optimizer, zero_grad).
Run: .venv/bin/python bench/ladder_cpu.py  (a few minutes on 2 cores); writes
bench/results/ladder_cpu-<date>.txt. Also prints the QLoRA upcast saving for Llama-3-8B.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lowvram.check.builders import autocast_dtype, build_model, build_optimizer, make_batch  # noqa: E402
from lowvram.check.cases import tiny_llama_spec  # noqa: E402
from lowvram.check.step import measure_trainer_step, one_step  # noqa: E402
from lowvram.plan.memory.memory import estimate_memory  # noqa: E402
from lowvram.plan.model.catalog import resolve_model  # noqa: E402
from lowvram.plan.setup import RunSetup  # noqa: E402

SPEC = tiny_llama_spec(hidden_size=512, num_layers=8, vocab_size=32000)
BASE = RunSetup(SPEC, precision="fp32", seq_len=512, micro_batch_size=1, device="cpu")
LADDER = [
    ("fp32 baseline", {}),
    ("+ bf16", dict(precision="bf16")),
    ("+ gradient checkpointing", dict(gradient_checkpointing=True)),
    ("+ 8-bit AdamW", dict(optimizer="adamw_8bit")),
    ("+ LoRA r16 all-linear", dict(lora=True, optimizer="adamw")),
    ("+ QLoRA nf4-dq", dict(quantization="nf4-dq")),
    ("+ chunked loss (1024-token chunks, batch 4)", dict(loss="chunked", micro_batch_size=4)),
]


def run(setup: RunSetup, steps: int = 2):
    model = build_model(setup)
    opt = build_optimizer(model, setup.optimizer)
    batch = make_batch(setup)
    ac = autocast_dtype(setup)
    chunked = setup.loss == "chunked"
    one_step(model, opt, batch, ac, 1.0, 1, chunked_loss=chunked)  # warm-up: optimizer state
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        one_step(model, opt, batch, ac, 1.0, 1, chunked_loss=chunked)
        times.append(time.perf_counter() - t0)
    # memory: the Trainer lowvram train builds, second step, exact live bytes
    mem = measure_trainer_step(model, setup)
    return mem.peak_bytes, statistics.median(times)


def main() -> None:
    lines = [f"# CPU ladder, {datetime.date.today()}, {os.cpu_count()} cores; Llama h512 L8 V32000, "
             "batch 1 x seq 512 unless said; peak = live tensor bytes (exact)",
             f"{'technique':46s} {'measured MiB':>12s} {'predicted MiB':>13s} {'diff':>7s} {'step s':>7s}"]
    print("\n".join(lines), flush=True)
    setup = BASE
    for name, change in LADDER:
        setup = replace(setup, **change)
        peak, step = run(setup)
        pred = estimate_memory(setup).peak_bytes
        line = f"{name:46s} {peak / 2**20:12.1f} {pred / 2**20:13.1f} {100 * (pred - peak) / peak:+6.1f}% {step:7.2f}"
        print(line, flush=True)
        lines.append(line)
        if name.startswith("+ chunked"):  # the same batch without chunking, for the saving
            std = replace(setup, loss="standard")
            peak_std, step_std = run(std)
            line = (f"{'  (same, standard loss)':46s} {peak_std / 2**20:12.1f} "
                    f"{estimate_memory(std).peak_bytes / 2**20:13.1f} {'':7s} {step_std:7.2f}")
            print(line, flush=True)
            lines.append(line)
    l8b = RunSetup(resolve_model("llama-3-8b"), precision="bf16", lora=True, quantization="nf4-dq",
                   gradient_checkpointing=True, seq_len=2048, device="cuda")
    up, low = estimate_memory(replace(l8b, kbit_prepare=True)), estimate_memory(l8b)
    line = (f"# Llama-3-8B QLoRA nf4-dq bf16, checkpointing, seq 2048 (predicted): peft upcast "
            f"{up.peak_bytes / 2**30:.2f} GiB, lowvram (no upcast) {low.peak_bytes / 2**30:.2f} GiB, "
            f"saves {(up.peak_bytes - low.peak_bytes) / 2**30:.2f} GiB")
    print(line)
    lines.append(line)
    out = Path(__file__).parent / "results" / f"ladder_cpu-{datetime.date.today()}.txt"
    out.write_text("\n".join(lines) + "\n")
    print(f"written: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
