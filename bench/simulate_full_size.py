"""Analytic peak (lowvram.plan.memory.memory) vs the simulated real step (lowvram.check.simulate) at full size.

Catalog shapes of Llama-2-7B, Llama-3-8B and Qwen2.5-7B, batch 1, seq 512 and 2048, the main
technique combinations, tensors only (device "cpu": no CUDA context or allocator slack, which
both models add the same way). Prints GiB and the analytic error relative to the simulation.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/simulate_full_size.py [--quick] [--moe]

Output committed in bench/results/simulate_full_size.txt. About 5 s per row, < 1 GB of RAM.
``--moe``: Mixtral-8x7B and Qwen3-30B-A3B (catalog shapes) with full, LoRA and QLoRA, with and
without checkpointing, in bench/results/simulate_full_size_moe.txt (30-100 s per row).
``--families``: Gemma-3-1B, OLMo-2-7B and SmolLM3-3B (catalog shapes), every case, in
bench/results/simulate_full_size_families.txt. ``--gpt-oss``: gpt-oss-20b with the MoE cases,
eager attention (its only path in transformers), in bench/results/simulate_full_size_gpt_oss.txt.
``--vision``: the multimodal catalog entries (Gemma-3-4B/12B, Llava-1.5-7B, Mistral-Small-3.1-24B,
Qwen2.5-VL-3B/7B/72B, Qwen3-VL-2B/4B/8B/32B, Llama-3.2-11B/90B-Vision; ``--only NAME,NAME`` runs some of them,
vision tower frozen and loaded unquantized) with the MoE cases, text-only batches, in
bench/results/simulate_full_size_vision.txt (20-90 s per row).
``--images``: Qwen2.5-VL-7B, Qwen3-VL-8B and Llama-3.2-11B-Vision (catalog shapes) trained on image +
text rows (lowvram.check.simulate_images: the run's ImageCollator; Qwen-VL images of 1,280 tokens,
max_pixels 1,003,520 and 1,310,720), seq 2048, LoRA, QLoRA + checkpointing, full + checkpointing, and
two images a row at seq 4096, micro-batch 2 x accumulation 4, in bench/results/simulate_full_size_images.txt (30-150 s per row).
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from lowvram.plan.memory.memory import estimate_memory  # noqa: E402
from lowvram.plan.model.catalog import resolve_model  # noqa: E402
from lowvram.plan.model.moe import default_attention  # noqa: E402
from lowvram.plan.setup import RunSetup  # noqa: E402

MODELS = ["llama-2-7b", "llama-3-8b", "qwen2.5-7b"]
MOE_MODELS = ["mixtral-8x7b", "qwen3-30b-a3b"]
FAMILY_MODELS = ["gemma-3-1b", "olmo-2-7b", "smollm3-3b"]
GPT_OSS_MODELS = ["gpt-oss-20b"]
VISION_MODELS = ["gemma-3-4b", "gemma-3-12b", "llava-1.5-7b", "mistral-small-3.1-24b", "qwen2.5-vl-3b",
                 "qwen2.5-vl-7b", "qwen2.5-vl-72b", "qwen3-vl-2b", "qwen3-vl-4b", "qwen3-vl-8b", "qwen3-vl-32b",
                 "llama-3.2-11b-vision", "llama-3.2-90b-vision"]
SEQ_LENS = [512, 2048]
CASES: list[tuple[str, dict]] = [
    ("full bf16 adamw", dict(precision="bf16")),
    ("full bf16 adamw_8bit", dict(precision="bf16", optimizer="adamw_8bit")),
    ("lora r16 all-linear bf16", dict(precision="bf16", lora=True)),
    ("lora r16 all-linear bf16 + ckpt", dict(precision="bf16", lora=True, gradient_checkpointing=True)),
    ("qlora nf4-dq", dict(precision="bf16", lora=True, quantization="nf4-dq")),
    ("qlora nf4-dq + ckpt", dict(precision="bf16", lora=True, quantization="nf4-dq",
                                 gradient_checkpointing=True)),
    ("qlora nf4-dq + ckpt adamw_8bit", dict(precision="bf16", lora=True, quantization="nf4-dq",
                                            gradient_checkpointing=True, optimizer="adamw_8bit")),
]


IMAGE_MODELS = {"qwen2.5-vl-7b": 1280 * 28 * 28, "qwen3-vl-8b": 1280 * 32 * 32, "llama-3.2-11b-vision": None}
IMAGE_CASES: list[tuple[str, dict]] = [
    ("lora bf16, 1 image", dict(precision="bf16", lora=True, images_per_row=1)),
    ("qlora nf4-dq + ckpt, 1 image", dict(precision="bf16", lora=True, quantization="nf4-dq",
                                          gradient_checkpointing=True, images_per_row=1)),
    ("full bf16 + ckpt, 1 image", dict(precision="bf16", gradient_checkpointing=True, images_per_row=1)),
    ("qlora + ckpt, 2 images, b2 x 4", dict(precision="bf16", lora=True, quantization="nf4-dq",
                                            gradient_checkpointing=True, images_per_row=2, micro_batch_size=2,
                                            grad_accum=4, seq_len=4096)),
]


def compare(setup: RunSetup):
    """(analytic estimate, simulated estimate, seconds the simulation took, analytic error)."""
    from lowvram.check.simulate import simulate_memory

    est = estimate_memory(setup)
    t0 = time.perf_counter()
    sim = simulate_memory(setup)
    return est, sim, time.perf_counter() - t0, (est.peak_bytes - sim.peak_bytes) / sim.peak_bytes


def image_rows() -> int:
    """--images: full-size vision configs with images in the batch, analytic vs simulated."""
    from dataclasses import replace

    from lowvram.plan.model.image_size import sized_vision

    gib = 2**30
    worst = 0.0
    print(f"{'model':<22} {'seq':>5} {'case':<32} {'analytic':>9} {'simulated':>9} {'diff':>7}  {'moment (plan)':<24} "
          f"{'time':>5}")
    for name, max_pixels in IMAGE_MODELS.items():
        spec = resolve_model(name)
        if max_pixels:
            spec = replace(spec, vision=sized_vision(spec.vision, max_pixels, None))
        for label, kw in IMAGE_CASES:
            setup = RunSetup(spec, device="cpu", attention="sdpa", **{"micro_batch_size": 1, "seq_len": 2048, **kw})
            est, sim, dt, diff = compare(setup)
            worst = max(worst, abs(diff))
            print(f"{name:<22} {setup.seq_len:>5} {label:<32} {est.peak_bytes / gib:>9.2f} {sim.peak_bytes / gib:>9.2f} "
                  f"{100 * diff:>+6.2f}%  {est.peak_moment:<24} {dt:>4.0f}s", flush=True)
    print(f"worst |analytic - simulated| / simulated: {100 * worst:.2f}%")
    return 0


# MoE and vision: the 8-bit optimizer rows add nothing specific (expert state as any 3-D tensor;
# the tower is frozen, no state)
MOE_CASES = [c for c in CASES if "adamw_8bit" not in c[0]]


def main(quick: bool = False, moe: bool = False, families: bool = False,
         gpt_oss: bool = False, vision: bool = False, only: tuple[str, ...] = ()) -> int:
    gib = 2**30
    models, cases = (MOE_MODELS, MOE_CASES) if moe else (MODELS, CASES)
    if families:
        models = FAMILY_MODELS
    if gpt_oss:
        models, cases = GPT_OSS_MODELS, MOE_CASES
    if vision:
        models, cases = VISION_MODELS, MOE_CASES
    print(f"{'model':<14} {'seq':>5} {'case':<32} {'analytic':>9} {'simulated':>9} {'diff':>7}  "
          f"{'phase (sim)':<16} {'time':>5}")
    worst = 0.0
    if only:  # --only NAME[,NAME]: these catalog entries of the chosen set
        models = [m for m in models if m in only]
    for name in models[:1] if quick else models:
        spec = resolve_model(name)
        for seq in SEQ_LENS:
            for label, kw in cases:
                setup = RunSetup(spec, seq_len=seq, micro_batch_size=1, device="cpu",
                                 attention=default_attention(spec), **kw)
                est, sim, dt, diff = compare(setup)
                worst = max(worst, abs(diff))
                print(f"{name:<14} {seq:>5} {label:<32} {est.peak_bytes / gib:>9.2f} "
                      f"{sim.peak_bytes / gib:>9.2f} {100 * diff:>+6.2f}%  {sim.peak_phase:<16} "
                      f"{dt:>4.1f}s", flush=True)
    print(f"worst |analytic - simulated| / simulated: {100 * worst:.2f}%")
    return 0


if __name__ == "__main__":
    if "--images" in sys.argv:
        sys.exit(image_rows())
    names = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else ()
    sys.exit(main("--quick" in sys.argv, "--moe" in sys.argv, "--families" in sys.argv,
                  "--gpt-oss" in sys.argv, "--vision" in sys.argv, tuple(names)))
