"""Predicted vs measured peak memory on one CUDA GPU (calibrates cuda_overheads()).

Random-init real architectures from the catalog (no downloads). For each model and technique
the model is built once; at each sequence length one warm-up step (the optimizer state
exists) and one measured step of the Trainer lowvram train builds
(lowvram.check.step.measure_trainer_step).
Measured: torch.cuda.max_memory_allocated (tensors: compared with the planner's tensor terms),
max_memory_reserved (allocator slack) and, from torch.cuda.mem_get_info, the device memory the
process holds outside the caching allocator (CUDA context, kernels, cuBLAS/cuDNN handles).
The end of the output suggests calibrated values for lowvram.plan.setup.cuda_overheads().

    HF_HUB_OFFLINE=1 python bench/gpu_check.py   # table on stdout, JSON to $OUT/gpu_check.json
    bash bench/gpu_check.sh                       # the same on the device machine (see its header)
    python bench/gpu_check.py --dry-run           # the same code on CPU with a tiny model
                                                  # (tests/bench/test_gpu_check.py keeps it working)

Not run in CI (no GPU there); at most --budget-s seconds (default 420) on one large GPU: small
models first, so a cut-short run still covers every technique.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's lowvram
# the allocator as `lowvram train` runs it: expandable segments unless PYTORCH_CUDA_ALLOC_CONF is
# set, before torch is imported (lowvram.train.build.allocator); the plans read the same variable
from lowvram.train.build.allocator import set_expandable_segments  # noqa: E402

set_expandable_segments()

MODELS = ["qwen2.5-0.5b", "llama-3.2-1b", "llama-2-7b"]
SEQ_LENS = (512, 2048)
TECHNIQUES = [
    ("full bf16", dict(precision="bf16")),
    ("full bf16 + ckpt", dict(precision="bf16", gradient_checkpointing=True)),
    ("full bf16-mixed", dict(precision="bf16-mixed")),
    ("full bf16 adamw_8bit", dict(precision="bf16", optimizer="adamw_8bit")),
    ("full bf16 adafactor", dict(precision="bf16", optimizer="adafactor")),
    ("lora bf16", dict(precision="bf16", lora=True)),
    ("lora bf16 + ckpt", dict(precision="bf16", lora=True, gradient_checkpointing=True)),
    ("qlora nf4 + ckpt", dict(precision="bf16", lora=True, quantization="nf4",
                              gradient_checkpointing=True)),
    ("qlora nf4-dq + ckpt", dict(precision="bf16", lora=True, quantization="nf4-dq",
                                 gradient_checkpointing=True)),
    ("qlora nf4-dq + ckpt + chunked b4", dict(precision="bf16", lora=True, quantization="nf4-dq",
                                              gradient_checkpointing=True, loss="chunked",
                                              micro_batch_size=4)),
]
# Rows that mean something on a GPU only: transformers' activation offload (save_on_cpu around each
# checkpoint) puts the layer inputs in pinned host RAM, which needs CUDA.
CUDA_TECHNIQUES = [
    ("qlora nf4-dq + ckpt + act offload", dict(precision="bf16", lora=True, quantization="nf4-dq",
                                               gradient_checkpointing=True, activation_offload=True)),
]
GIB = 2**30


def other_processes_bytes() -> int:
    """Device memory in use before this process touches CUDA (nvidia-smi; 0 if unavailable)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                              "-i", "0"], capture_output=True, text=True, timeout=20).stdout
        return int(float(out.split()[0]) * 2**20)
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return 0


class CudaProbe:
    """Peak tensor bytes and allocator reserve from the caching allocator, device use from the driver.
    Called by lowvram.check.step.measure_trainer_step around the second Trainer step."""

    device = "cuda"

    def __init__(self):
        import torch

        self.torch = torch
        self.total = torch.cuda.get_device_properties(0).total_memory

    def start(self, model, optimizer):
        self.torch.cuda.synchronize()
        self.torch.cuda.reset_peak_memory_stats()
        self.t0 = time.time()

    def mark(self, phase):  # the caching allocator keeps one peak for the whole step
        pass

    def stop(self, last_phase) -> dict:
        cuda = self.torch.cuda
        cuda.synchronize()
        free, total = cuda.mem_get_info()
        return dict(allocated=cuda.max_memory_allocated(), reserved=cuda.max_memory_reserved(),
                    outside_allocator=(total - free) - cuda.memory_reserved(),
                    step_s=round(time.time() - self.t0, 3))

    def release(self):
        gc.collect()
        self.torch.cuda.empty_cache()


def _cpu_probe():
    """--dry-run: the live tensor bytes of the step (lowvram.check.step.TrackerProbe); no allocator."""
    from lowvram.check.step import TrackerProbe
    class CpuProbe(TrackerProbe):
        total = 24 * GIB

        def start(self, model, optimizer):
            self.t0 = time.time()
            super().start(model, optimizer)

        def stop(self, last_phase) -> dict:
            peak = super().stop(last_phase).peak_bytes
            return dict(allocated=peak, reserved=peak, outside_allocator=0, step_s=round(time.time() - self.t0, 3))

    return CpuProbe()


def run_technique(probe, spec, kw, seq_lens, saved_dir):
    """Build the model once (lowvram train's builders) and measure its second Trainer step at
    each sequence length (lowvram.check.step.measure_trainer_step: the Trainer lowvram train makes).
    Yields each row as soon as it is measured, so the caller can write it before the next one."""
    from lowvram.check.builders import build_model
    from lowvram.check.step import measure_trainer_step
    from lowvram.plan.memory.memory import estimate_memory
    from lowvram.plan.setup import RunSetup, expandable_segments_set

    expandable = expandable_segments_set(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
    setups = [RunSetup(spec, seq_len=s, device=probe.device, expandable_segments=expandable, **kw)
              for s in seq_lens]
    ests = [estimate_memory(s) for s in setups]
    fitting = []
    for s, e in zip(setups, ests, strict=True):
        if e.peak_bytes <= 0.9 * probe.total:
            fitting.append((s, e))
        else:
            yield dict(seq_len=s.seq_len, predicted=e.peak_bytes,
                       skipped="predicted over 90% of the device")
    if not fitting:
        return
    t0 = time.time()
    model = build_model(setups[0], device=probe.device,
                        saved_dir=saved_dir if setups[0].quantization != "none" else None)
    build_s = time.time() - t0
    for setup, est in fitting:
        measured = measure_trainer_step(model, setup, probe, device=probe.device)
        tensors = est.peak_bytes - est.breakdown["cuda_context"] - est.breakdown["allocator"]
        yield dict(seq_len=setup.seq_len, micro_batch_size=setup.micro_batch_size,
                   predicted=est.peak_bytes, predicted_tensors=tensors,
                   predicted_once=est.allocated_once_bytes,
                   predicted_phase=est.peak_phase, build_s=round(build_s, 1), **measured)
    del model
    probe.release()


def report_versions() -> list[str]:
    """What this process imports, and from where (carried wheels on PYTHONPATH win over the
    machine's site-packages), then lowvram's bounds (lowvram.deps): printed before measuring.
    Returns the problems: a bounded library missing or too old, or pydantic missing."""
    import importlib.util
    import platform

    from lowvram.deps import installed_versions, version_problems

    found = installed_versions()
    from importlib import metadata

    # and what the carried wheels lean on from the machine (datasets 5.2 needs pyarrow>=24)
    for extra in ("pydantic", "pydantic-core", "huggingface-hub", "tokenizers", "pyarrow"):
        try:
            found[extra] = metadata.version(extra)
        except metadata.PackageNotFoundError:
            found[extra] = None
    parts = [f"python {platform.python_version()}"]
    for name, version in found.items():
        spec = importlib.util.find_spec({"huggingface-hub": "huggingface_hub"}.get(name, name.replace("-", "_")))
        where = os.path.dirname(os.path.dirname(spec.origin)) if spec and spec.origin else "-"
        parts.append(f"{name} {version or 'MISSING'} ({where})")
    try:
        import torch

        parts.append(f"torch CUDA {torch.version.cuda or 'none'}")
    except ImportError:
        pass
    print("# versions: " + "; ".join(parts), flush=True)
    problems = version_problems(found)
    if found["pydantic"] is None:
        problems.append("pydantic is not installed (lowvram.recipe needs it)")
    return problems


def summarize(rows: list[dict], baseline: int) -> list[str]:
    """Worst errors and the overheads the measurements suggest."""
    done = [r for r in rows if "allocated" in r]
    if not done:
        return ["no case measured"]
    errs = [(r["predicted_tensors"] - r["allocated"]) / r["allocated"] * 100 for r in done]
    from lowvram.plan.setup import cuda_overheads, expandable_segments_set

    slack = max((r["reserved"] - r["allocated"]) / r["allocated"] for r in done)
    # the churn share the runs ask for, the loaded_once share kept (setup.CudaOverheads)
    once = cuda_overheads().once_fraction
    churn = max(((r["reserved"] - r["allocated"] - once * r.get("predicted_once", 0))
                 / (r["allocated"] - r.get("predicted_once", 0)) for r in done
                 if r["allocated"] > r.get("predicted_once", 0)), default=0.0)
    context = max(r["outside_allocator"] for r in done) - baseline
    device_used = [r["reserved"] + r["outside_allocator"] - baseline for r in done]
    under = sum(r["predicted"] < u for r, u in zip(done, device_used, strict=True))
    return [
        f"cases measured: {len(done)} of {len(rows)}",
        f"tensors: worst |error| {max(map(abs, errs)):.2f}%, worst under-prediction "
        f"{min(min(errs), 0.0):+.2f}%",
        f"outside the allocator (CUDA context, kernels, handles): up to {context / GIB:.3f} GiB "
        f"({context:,} bytes; other processes' {baseline / GIB:.3f} GiB taken off)",
        f"allocator slack (reserved over allocated): up to {slack * 100:.1f}%",
        f"plans under the device memory really used (reserved + outside): {under} of {len(done)}",
        f"suggested cuda_overheads(): context_bytes={context:,}, churn_fraction"
        f"{'_expandable' if expandable_segments_set(os.environ.get('PYTORCH_CUDA_ALLOC_CONF')) else ''}="
        f"{churn:.3f} (once_fraction {once} kept)",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="run the same code on CPU with a tiny model (no GPU needed)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting cases after this")
    ap.add_argument("--models", default=None, help="comma-separated catalog names")
    ap.add_argument("--only", default=None,
                    help="comma-separated technique names (default: all), e.g. 'full bf16,lora bf16'")
    args = ap.parse_args(argv)
    problems = report_versions()
    if problems:  # before any measurement: every row would fail the same way
        print("error: " + "; ".join(problems) + f"\nhint: {_hint()}", file=sys.stderr)
        return 1
    techniques = TECHNIQUES + ([] if args.dry_run else CUDA_TECHNIQUES)
    if args.only:
        wanted = [t.strip() for t in args.only.split(",")]
        unknown = [t for t in wanted if t not in {name for name, _ in techniques}]
        if unknown:
            print(f"error: no technique {unknown[0]!r}\nhint: one of: "
                  + ", ".join(name for name, _ in techniques), file=sys.stderr)
            return 2
        techniques = [t for t in techniques if t[0] in wanted]

    baseline = 0 if args.dry_run else other_processes_bytes()
    import torch

    from lowvram.plan.model.catalog import resolve_model

    if args.dry_run:
        from lowvram.check.cases import tiny_llama_spec
        probe = _cpu_probe()
        specs = [("tiny-llama", tiny_llama_spec(hidden_size=128, num_layers=2, vocab_size=2048))]
        seq_lens = (64, 128)
        title = f"CPU dry run, torch {torch.__version__}"
    else:
        if not torch.cuda.is_available():
            print("error: no CUDA GPU: nothing to check\nhint: run with --dry-run to test the "
                  "script on CPU", file=sys.stderr)
            return 1
        probe = CudaProbe()
        names = args.models.split(",") if args.models else MODELS
        specs = [(n, resolve_model(n)) for n in names]
        seq_lens = SEQ_LENS
        title = (f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
                 f"{probe.total / GIB:.1f} GiB")
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars between the rows
    unit, scale = ("MiB", 2**20) if args.dry_run else ("GiB", GIB)
    print(f"# gpu_check {time.strftime('%Y-%m-%d')}: {title}, transformers {transformers.__version__}; "
          f"b1 unless named; {unit}")
    print(f"{'model':14} {'technique':32} {'seq':>5} {'pred tensors':>12} {'allocated':>10} "
          f"{'err':>7} {'pred total':>10} {'reserved':>9} {'outside':>8}  step s")
    start = time.time()
    rows: list[dict] = []
    out_dir = os.environ.get("OUT")
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in specs:
            saved = os.path.join(tmp, name)  # one random-init checkpoint per model for the QLoRA rows
            os.makedirs(saved, exist_ok=True)
            for tech, kw in techniques:
                if time.time() - start > args.budget_s:
                    print(f"time budget reached: {name} {tech} and later not run", file=sys.stderr)
                    break
                done = set()
                failed = None
                try:
                    for r in run_technique(probe, spec, kw, seq_lens, saved):
                        done.add(r["seq_len"])
                        _record(rows, r, name, tech, scale, baseline, out_dir, title)
                except torch.OutOfMemoryError as e:
                    failed = f"OOM: {e}"
                except Exception as e:  # noqa: BLE001 - one device call: a broken row (bitsandbytes
                    # missing or built for another CUDA) is recorded, the other rows still run
                    failed = f"{type(e).__name__}: {e}"
                if failed is not None:  # out of the except block: its traceback no longer holds the model
                    probe.release()
                    for s in seq_lens:
                        if s not in done:
                            _record(rows, dict(seq_len=s, error=failed[:200]), name, tech, scale,
                                    baseline, out_dir, title)
            if os.path.isdir(saved):
                import shutil

                shutil.rmtree(saved, ignore_errors=True)
    for line in summarize(rows, baseline):
        print(f"# {line}")
    if not any("allocated" in r for r in rows):
        print("error: no case measured\nhint: each row's error is above and in $OUT/gpu_check.json",
              file=sys.stderr)
        return 1
    return 0


def _hint() -> str:
    from lowvram.deps import pip_line

    return ("on the device machine, run bench/gpu_wheels.sh here first and carry .whl "
            f"(bench/gpu_check.sh installs it); elsewhere: {pip_line()} 'pydantic>=2.7,<3'")


def _record(rows, r, name, tech, scale, baseline, out_dir, title) -> None:
    """Print one row and rewrite $OUT/gpu_check.json: a run cut short still leaves every row so far."""
    r.update(model=name, technique=tech)
    rows.append(r)
    if "allocated" in r:
        err = (r["predicted_tensors"] - r["allocated"]) / r["allocated"] * 100
        print(f"{name:14} {tech:32} {r['seq_len']:>5} {r['predicted_tensors'] / scale:>12.3f} "
              f"{r['allocated'] / scale:>10.3f} {err:>+6.1f}% {r['predicted'] / scale:>10.3f} "
              f"{r['reserved'] / scale:>9.3f} {(r['outside_allocator'] - baseline) / scale:>8.3f}"
              f"  {r['step_s']}", flush=True)
    else:
        print(f"{name:14} {tech:32} {r['seq_len']:>5} {r.get('skipped') or r.get('error')}", flush=True)
    if out_dir:
        with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
            json.dump(dict(title=title, baseline_bytes=baseline, rows=rows), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
