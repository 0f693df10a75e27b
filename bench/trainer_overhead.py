"""Tokens/s of `lowvram train` against a hand-written transformers.Trainer script with the same
settings (model, data, batch, LoRA, optimizer, steps) on a tiny Llama (hidden 256, 4 layers).
Target: ratio >= 0.98. Median of RUNS runs each, alternating. lowvram train runs with
--no-track-memory (the live-bytes tracker is a measurement, off here; its cost is printed too).

Run: .venv/bin/python bench/trainer_overhead.py  (~2 min on 2 cores); writes
bench/results/trainer_overhead-<date>.txt.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
RUNS, STEPS, SEQ, BATCH = 3, 30, 128, 4
PY = sys.executable

HAND = r'''
import json, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments
from peft import LoraConfig, get_peft_model
model_dir, data, out, steps, seq, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
tok = AutoTokenizer.from_pretrained(model_dir)
rows = []
for line in open(data):
    r = json.loads(line)
    ids = tok(f"### Instruction:\n{r['instruction']}\n\n### Response:\n{r['output']}")["input_ids"][:seq]
    rows.append({"input_ids": ids, "labels": ids})
def collate(fs):
    n = max(len(f["input_ids"]) for f in fs)
    pad = lambda x, v: x + [v] * (n - len(x))
    return {"input_ids": torch.tensor([pad(f["input_ids"], tok.pad_token_id) for f in fs]),
            "labels": torch.tensor([pad(f["labels"], -100) for f in fs]),
            "attention_mask": torch.tensor([pad([1] * len(f["input_ids"]), 0) for f in fs])}
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"))
args = TrainingArguments(out, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-3,
    optim="adamw_torch", use_cpu=True, logging_steps=10, save_strategy="no", report_to=[],
    disable_tqdm=True, remove_unused_columns=False, dataloader_pin_memory=False, seed=42)
tr = Trainer(model=model, args=args, train_dataset=rows, data_collator=collate)
t0 = time.perf_counter(); tr.train(); dt = time.perf_counter() - t0
tokens = sum(len(r["input_ids"]) for r in rows[: steps * batch])
print(json.dumps({"tokens_per_s": tokens / dt}))
'''


def main() -> None:
    from lowvram.testing import save_tiny_model

    work = Path(tempfile.mkdtemp(prefix="lowvram-bench-"))
    model = save_tiny_model(work / "model", hidden=256, layers=4, heads=4, kv_heads=2, intermediate=688)
    data = work / "data.jsonl"
    with data.open("w") as f:
        for i in range(STEPS * BATCH):
            f.write(json.dumps({"instruction": f"Count from {i}.", "input": "",
                                "output": " ".join(str(i + j) for j in range(80))}) + "\n")
    (work / "hand.py").write_text(HAND)
    recipe = work / "recipe.yaml"
    recipe.write_text(f"""model: {{name_or_path: {model}}}
data: {{datasets: [{{path: {data}, format: alpaca}}]}}
training: {{max_steps: {STEPS}, learning_rate: 1.0e-3, lr_scheduler: linear, warmup_ratio: 0.0, batch_size: {BATCH},
  micro_batch_size: {BATCH}, seq_len: {SEQ}, logging_steps: 10, save_steps: 100000, output_dir: {work / 'out'},
  report_to: none}}
lora: {{r: 8, alpha: 16, dropout: 0.0, target_modules: all-linear}}
techniques: {{lora: on, mixed_precision: fp32, optimizer: adamw, gradient_checkpointing: off,
  gradient_accumulation: 1, loss: standard}}
""")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}

    def lowvram(track: bool) -> float:
        shutil.rmtree(work / "out", ignore_errors=True)
        cmd = [PY, "-m", "lowvram", "train", str(recipe), "--json"] + ([] if track else ["--no-track-memory"])
        subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
        m = json.loads((work / "out" / "metrics.json").read_text())
        return m["tokens_seen"] / m["train_runtime_s"]

    def hand() -> float:
        r = subprocess.run([PY, str(work / "hand.py"), str(model), str(data), str(work / "hand-out"),
                            str(STEPS), str(SEQ), str(BATCH)], check=True, env=env, capture_output=True, text=True)
        return json.loads(r.stdout.strip().splitlines()[-1])["tokens_per_s"]

    ours, theirs, tracked = [], [], []
    for _ in range(RUNS):
        ours.append(lowvram(False))
        theirs.append(hand())
    tracked.append(lowvram(True))
    o, t = statistics.median(ours), statistics.median(theirs)
    lines = [f"# trainer overhead, {datetime.date.today()}, {os.cpu_count()} CPU cores, tiny Llama h256 L4, "
             f"LoRA r8 all-linear fp32, batch {BATCH} x seq {SEQ}, {STEPS} steps, median of {RUNS}",
             f"lowvram train (--no-track-memory): {o:.0f} tokens/s  runs {[round(x) for x in ours]}",
             f"hand-written Trainer script:       {t:.0f} tokens/s  runs {[round(x) for x in theirs]}",
             f"ratio: {o / t:.3f} (target >= 0.98)",
             f"lowvram train with the live-bytes tracker (default on CPU): {tracked[0]:.0f} tokens/s "
             f"({tracked[0] / o:.2f}x of untracked)"]
    print("\n".join(lines))
    out = Path(__file__).parent / "results" / f"trainer_overhead-{datetime.date.today()}.txt"
    out.write_text("\n".join(lines) + "\n")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
