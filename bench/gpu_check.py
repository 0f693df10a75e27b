"""Predicted vs measured peak memory on one CUDA GPU (calibrates cuda_overheads()).

Random-init real architectures from the catalog (no downloads), one warm-up step and one
measured step the way the Trainer runs it; torch.cuda.max_memory_allocated/reserved against
estimate_memory(device="cuda"). Not run in CI (no GPU there); about 8 minutes on one large GPU.

    HF_HUB_OFFLINE=1 python bench/gpu_check.py   # table on stdout, JSON to $OUT/gpu_check.json
    bash bench/gpu_check.sh                       # the same on the device machine (see its header)
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's lowvram

MODELS = ["qwen2.5-0.5b", "llama-3.2-1b", "llama-2-7b"]
TECHNIQUES = [
    ("full bf16", dict(precision="bf16")),
    ("full bf16 + ckpt", dict(precision="bf16", gradient_checkpointing=True)),
    ("full bf16-mixed", dict(precision="bf16-mixed")),
    ("lora bf16", dict(precision="bf16", lora=True)),
    ("lora bf16 + ckpt", dict(precision="bf16", lora=True, gradient_checkpointing=True)),
    ("qlora nf4-dq + ckpt", dict(precision="bf16", lora=True, quantization="nf4-dq",
                                 gradient_checkpointing=True)),
    ("full bf16 adamw_8bit", dict(precision="bf16", optimizer="adamw_8bit")),
]
BUDGET_S = 8 * 60


def run_case(spec, kw, seq_len):
    import torch

    from lowvram.measure import (
        _one_step,
        autocast_dtype,
        build_model,
        build_optimizer,
        make_batch,
    )
    from lowvram.plan.memory import RunSetup, estimate_memory

    setup = RunSetup(spec, seq_len=seq_len, device="cuda", **kw)
    est = estimate_memory(setup)
    total = torch.cuda.get_device_properties(0).total_memory
    if est.peak_bytes > 0.9 * total:
        return dict(predicted=est.peak_bytes, skipped="predicted over 90% of the card")
    model = build_model(setup, device="cuda")
    opt = build_optimizer(model, setup.optimizer)
    batch = make_batch(setup, device="cuda")
    ac = autocast_dtype(setup)
    _one_step(model, opt, batch, ac, 1.0, 1)  # warm-up: optimizer state exists
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.time()
    _one_step(model, opt, batch, ac, 1.0, 1)
    torch.cuda.synchronize()
    out = dict(
        predicted=est.peak_bytes,
        predicted_tensors=est.peak_bytes - est.breakdown["cuda_context"] - est.breakdown["allocator"],
        allocated=torch.cuda.max_memory_allocated(),
        reserved=torch.cuda.max_memory_reserved(),
        step_s=round(time.time() - t, 3),
    )
    del model, opt, batch
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU: nothing to check", file=sys.stderr)
        return 1
    from lowvram.plan.models import resolve_model

    start = time.time()
    rows = []
    print(f"# {torch.cuda.get_device_name(0)}, torch {torch.__version__}; GiB")
    print(f"{'model':14} {'technique':22} {'seq':>5} {'pred tensors':>12} {'allocated':>10} "
          f"{'err':>7} {'pred+ovh':>9} {'reserved':>9}")
    for seq_len in (512, 2048):
        for name in MODELS:
            spec = resolve_model(name)
            for tech, kw in TECHNIQUES:
                if time.time() - start > BUDGET_S:
                    print("time budget reached", file=sys.stderr)
                    break
                try:
                    r = run_case(spec, kw, seq_len)
                except torch.OutOfMemoryError as e:
                    r = dict(error=f"OOM: {e}"[:200])
                    gc.collect()
                    torch.cuda.empty_cache()
                r.update(model=name, technique=tech, seq_len=seq_len)
                rows.append(r)
                if "allocated" in r:
                    g = 2**30
                    err = (r["predicted_tensors"] - r["allocated"]) / r["allocated"] * 100
                    print(f"{name:14} {tech:22} {seq_len:>5} {r['predicted_tensors'] / g:>12.2f} "
                          f"{r['allocated'] / g:>10.2f} {err:>+6.1f}% {r['predicted'] / g:>9.2f} "
                          f"{r['reserved'] / g:>9.2f}", flush=True)
                else:
                    print(f"{name:14} {tech:22} {seq_len:>5} {r.get('skipped') or r.get('error')}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "gpu_check.json"), "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
