"""Predicted vs measured peak memory on one CUDA GPU (calibrates cuda_overheads()), in one
device call: a plan of cases (plan_cases) that fits --budget-s (390 s of the call's 8 minutes),
the most informative first, each row written to $OUT/gpu_check.json as it comes.

Random-init real architectures from the catalog (no downloads; a QLoRA base quantized from memory),
built once per case; at each sequence length one warm-up step and one measured step of the Trainer
lowvram train builds (lowvram.check.step.measure_trainer_step), which saves nothing: no case writes
a checkpoint or a model file, and each starts only if the disk keeps DISK_RESERVE_BYTES free.
Measured: torch.cuda.max_memory_allocated (tensors: compared with the planner's tensor terms),
max_memory_reserved (allocator slack, with and without expandable segments) and, from
torch.cuda.mem_get_info, the memory held outside the caching allocator: after a step (context,
kernels, handles), for a bare context, and for one NCCL rank (per GPU count: one lent GPU).

    HF_HUB_OFFLINE=1 python bench/gpu_check.py   # table on stdout, JSON to $OUT/gpu_check.json
    bash bench/gpu_check.sh                       # the same on the device machine (see its header)
    python bench/gpu_check.py --plan              # the cases, their estimated seconds
    python bench/gpu_check.py --dry-run           # every case on CPU with a tiny model
                                                  # (tests/bench/test_gpu_check.py keeps it working)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo's lowvram
# the allocator as `lowvram train` runs it: expandable segments unless PYTORCH_CUDA_ALLOC_CONF is
# set, before torch is imported (lowvram.train.build.allocator); the plans read the same variable
from lowvram.train.build.allocator import set_expandable_segments  # noqa: E402

set_expandable_segments()

# The plan of one device call (issue 41 item 6): at most 8 minutes on either lent kind (H100 80 GB,
# H200 141 GB; 64 GiB of disk), the most informative cases first, so a run cut short still returns
# what matters most. Each case: (name, kind, model, technique, seq_lens, estimated seconds on one
# H100/H200, disk bytes it may write). The seconds are estimates from the model sizes (a 7B random
# init and 4-bit load ~30 s, a step of a few seconds), not yet measured: the first GPU run prints
# each case's real time beside them. Nothing writes a checkpoint (lowvram.check.step) and the
# QLoRA bases are quantized from memory (builders.build_model in_memory), so no case writes a
# model file: disk_bytes is the allowance for library caches (Triton kernels) only.
QLORA = dict(precision="bf16", lora=True, quantization="nf4-dq", gradient_checkpointing=True)
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
    ("qlora nf4-dq + ckpt", QLORA),
    ("qlora nf4-dq + ckpt + chunked b4", dict(QLORA, loss="chunked", micro_batch_size=4)),
]
# Rows that mean something on a GPU only: transformers' activation offload (save_on_cpu around each
# checkpoint) puts the layer inputs in pinned host RAM; paged optimizers page CUDA unified memory;
# int8 runs bitsandbytes' MatMul8bitLt on CUDA, MatMul8bitFp on a CPU (docs/planner.md, int8 on CUDA):
# its CPU dry run would measure another autograd path (-4.5% on the tiny Llama, 2026-12-06).
CUDA_TECHNIQUES = [
    ("qlora nf4-dq + ckpt + act offload", dict(QLORA, activation_offload=True)),
    ("int8 lora + ckpt", dict(precision="bf16", lora=True, quantization="int8", gradient_checkpointing=True)),
    ("full bf16 paged_adamw_8bit", dict(precision="bf16", optimizer="paged_adamw_8bit")),
]
BUDGET_S = 390.0  # of one device call's 8 minutes: the wheels install and imports take the rest (gpu_check.sh)
CACHE_BYTES = 1 * 2**30  # Triton/inductor kernel caches a case may write
DISK_RESERVE_BYTES = 4 * 2**30  # never let a case take the disk below this
GIB = 2**30


class Case(NamedTuple):
    name: str
    kind: str  # step | churn (a step in a child without expandable segments) | outside
    model: str | None
    technique: str | None
    seq_lens: tuple[int, ...]
    estimate_s: float
    disk_bytes: int = CACHE_BYTES


def plan_cases(cuda: bool = True) -> list[Case]:
    """The device call's cases, most informative first (issue 41): QLoRA on a 4-bit base at
    several lengths (the published QLoRA rows are where the plan is furthest off); the allocator's
    churn share without expandable segments (the QLoRA row at 2048 is the one with them); the
    memory outside the allocator per GPU count (a bare context, and one NCCL rank); then each
    technique's first real step on a small model."""
    techniques = TECHNIQUES + (CUDA_TECHNIQUES if cuda else [])
    return [
        Case("qlora 7b", "step", "llama-2-7b", "qlora nf4-dq + ckpt", (512, 2048, 8192), 75),
        Case("churn without expandable segments", "churn", "llama-2-7b", "qlora nf4-dq + ckpt", (2048,), 60),
        Case("outside: bare context", "outside", None, "bare", (0,), 10),
        Case("outside: one nccl rank", "outside", None, "nccl", (0,), 15),
        *[Case(f"first step: {t}", "step", "qwen2.5-0.5b", t, (1024,), 12) for t, _ in techniques],
        Case("1b full", "step", "llama-3.2-1b", "full bf16", (512, 2048), 25),
    ]


def plan_seconds(cases: list[Case]) -> float:
    return sum(c.estimate_s for c in cases)


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


def run_technique(probe, spec, kw, seq_lens, out_dir):
    """Build the model once (lowvram train's builders; a quantized base from memory, no file) and
    measure its second Trainer step at each sequence length (lowvram.check.step.measure_trainer_step:
    the Trainer lowvram train makes, saving nothing), its Trainer's folder ``out_dir``.
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
    model = build_model(setups[0], device=probe.device, in_memory=True)
    build_s = time.time() - t0
    for setup, est in fitting:
        measured = measure_trainer_step(model, setup, probe, device=probe.device, output_dir=out_dir)
        tensors = est.peak_bytes - est.breakdown["cuda_context"] - est.breakdown["allocator"]
        yield dict(seq_len=setup.seq_len, micro_batch_size=setup.micro_batch_size,
                   predicted=est.peak_bytes, predicted_tensors=tensors,
                   predicted_once=est.allocated_once_bytes, expandable_segments=expandable,
                   predicted_phase=est.peak_phase, build_s=round(build_s, 1), **measured)
    del model
    probe.release()


def run_in_child(case: Case, dry_run: bool, out_dir: str, timeout_s: float) -> list[dict]:
    """A case in a fresh process: its own CUDA context (the outside readings), or its own
    PYTORCH_CUDA_ALLOC_CONF (the churn case: the allocator reads it once, at CUDA's start).
    The child prints its rows as one JSON line."""
    env = dict(os.environ)
    if case.kind == "churn":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:False"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", case.name, "--scratch", out_dir]
    done = subprocess.run(cmd + (["--dry-run"] if dry_run else []), env=env, capture_output=True, text=True,
                          timeout=None if timeout_s == float("inf") else max(timeout_s, 1))
    rows = [json.loads(line[len(CHILD_ROWS):]) for line in done.stdout.splitlines() if line.startswith(CHILD_ROWS)]
    if done.returncode != 0 or not rows:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"child exited {done.returncode}: {tail[0][:200]}")
    return rows[-1]


CHILD_ROWS = "#rows "


def _child(name: str, dry_run: bool, out_dir: str) -> int:
    case = next(c for c in plan_cases(cuda=not dry_run) if c.name == name)
    if case.kind == "outside":
        from lowvram.check.outside import measure_outside

        rows = [dict(seq_len=0, **measure_outside(case.technique, "cpu" if dry_run else "cuda"))]
    else:
        probe, specs, seq_lens = _setting(dry_run, [case])
        rows = list(run_technique(probe, specs[case.model], _technique(case.technique), seq_lens(case), out_dir))
    print(CHILD_ROWS + json.dumps(rows), flush=True)
    return 0


def _technique(name: str) -> dict:
    return dict(TECHNIQUES + CUDA_TECHNIQUES)[name]


def _setting(dry_run: bool, cases: list[Case]):
    """(probe, model specs by case model name, the lengths a case runs at): the catalog's models
    on a GPU; on the CPU dry run one tiny Llama for every model and short lengths."""
    from lowvram.plan.model.catalog import resolve_model

    if dry_run:
        from lowvram.check.cases import tiny_llama_spec

        tiny = tiny_llama_spec(hidden_size=128, num_layers=2, vocab_size=2048)
        specs = {c.model: tiny for c in cases if c.model}
        return _cpu_probe(), specs, lambda c: tuple(64 * (i + 1) for i in range(len(c.seq_lens)))
    return CudaProbe(), {c.model: resolve_model(c.model) for c in cases if c.model}, lambda c: c.seq_lens


def _written(folder: str) -> tuple[int, list[str]]:
    """Bytes and files under ``folder`` (a case's Trainer folder: it should stay empty)."""
    size, files = 0, []
    for root, _, names in os.walk(folder):
        for n in names:
            path = os.path.join(root, n)
            files.append(os.path.relpath(path, folder))
            size += os.path.getsize(path)
    return size, files


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
    outside = [r for r in rows if "allocated" not in r and "outside_allocator" in r]
    if not done and not outside:
        return ["no case measured"]
    from lowvram.plan.setup import cuda_overheads

    lines = [f"cases measured: {len(done) + len(outside)} of {len(rows)}"]
    for r in outside:
        lines.append(f"outside the allocator, {r['case']}: {(r['outside_allocator'] - baseline) / GIB:.3f} GiB "
                     f"({r['outside_allocator'] - baseline:,} bytes; the plan's cuda_context "
                     f"{cuda_overheads().context_bytes:,})")
    if not done:
        return lines
    errs = [(r["predicted_tensors"] - r["allocated"]) / r["allocated"] * 100 for r in done]
    slack = max((r["reserved"] - r["allocated"]) / r["allocated"] for r in done)
    # the churn share the runs ask for, the loaded_once share kept (setup.CudaOverheads)
    once = cuda_overheads().once_fraction

    def churn(sel):
        return max(((r["reserved"] - r["allocated"] - once * r.get("predicted_once", 0))
                    / (r["allocated"] - r.get("predicted_once", 0)) for r in sel
                    if r["allocated"] > r.get("predicted_once", 0)), default=0.0)

    context = max(r["outside_allocator"] for r in done) - baseline
    device_used = [r["reserved"] + r["outside_allocator"] - baseline for r in done]
    under = sum(r["predicted"] < u for r, u in zip(done, device_used, strict=True))
    expandable = [r for r in done if r.get("expandable_segments", True)]
    plain = [r for r in done if not r.get("expandable_segments", True)]
    shares = ([f"churn_fraction_expandable={churn(expandable):.3f}"] if expandable else []) + (
        [f"churn_fraction={churn(plain):.3f}"] if plain else [])
    return lines + [
        f"tensors: worst |error| {max(map(abs, errs)):.2f}%, worst under-prediction "
        f"{min(min(errs), 0.0):+.2f}%",
        f"outside the allocator after a step (CUDA context, kernels, handles): up to {context / GIB:.3f} GiB "
        f"({context:,} bytes; other processes' {baseline / GIB:.3f} GiB taken off)",
        f"allocator slack (reserved over allocated): up to {slack * 100:.1f}%",
        f"plans under the device memory really used (reserved + outside): {under} of {len(done)}",
        f"suggested cuda_overheads(): context_bytes={context:,}, {', '.join(shares)} (once_fraction {once} kept)",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="run every case on CPU with a tiny model (no GPU needed)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no case estimated to end after this (default 390 on a GPU, none in a dry run)")
    ap.add_argument("--only", default=None,
                    help="comma-separated case or technique names (default: the whole plan)")
    ap.add_argument("--scratch", default=None, help="where the cases' Trainer folders go (default: a temporary one)")
    ap.add_argument("--plan", action="store_true", help="print the plan of cases and exit")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cases = plan_cases(cuda=not args.dry_run)
    if args.budget_s is None:
        args.budget_s = float("inf") if args.dry_run else BUDGET_S
    if args.plan:
        for c in cases:
            print(f"{c.name:44} {c.kind:8} {c.model or '-':14} {c.seq_lens} ~{c.estimate_s:.0f} s")
        print(f"# {len(cases)} cases, ~{plan_seconds(cases):.0f} s estimated (budget {args.budget_s:.0f} s)")
        return 0
    if args.child:
        return _child(args.child, args.dry_run, args.scratch or tempfile.gettempdir())
    problems = report_versions()
    if problems:  # before any measurement: every row would fail the same way
        print("error: " + "; ".join(problems) + f"\nhint: {_hint()}", file=sys.stderr)
        return 1
    if args.only:
        wanted = [t.strip() for t in args.only.split(",")]
        known = {c.name for c in cases} | {c.technique for c in cases}
        unknown = [t for t in wanted if t not in known]
        if unknown:
            print(f"error: no case or technique {unknown[0]!r}\nhint: one of: "
                  + ", ".join(c.name for c in cases), file=sys.stderr)
            return 2
        cases = [c for c in cases if c.name in wanted or c.technique in wanted]
    baseline = 0 if args.dry_run else other_processes_bytes()
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA GPU: nothing to check\nhint: run with --dry-run to test the "
              "script on CPU", file=sys.stderr)
        return 1
    probe, specs, seq_lens = _setting(args.dry_run, cases)
    title = (f"CPU dry run, torch {torch.__version__}" if args.dry_run else
             f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, {probe.total / GIB:.1f} GiB")
    import transformers

    transformers.utils.logging.disable_progress_bar()  # "Loading weights" bars between the rows
    unit, scale = ("MiB", 2**20) if args.dry_run else ("GiB", GIB)
    print(f"# gpu_check {time.strftime('%Y-%m-%d')}: {title}, transformers {transformers.__version__}; "
          f"b1 unless named; {unit}; plan: {len(cases)} cases, ~{plan_seconds(cases):.0f} s estimated")
    print(f"{'model':14} {'case':44} {'seq':>5} {'pred tensors':>12} {'allocated':>10} "
          f"{'err':>7} {'pred total':>10} {'reserved':>9} {'outside':>8}  step s")
    start = time.time()
    rows: list[dict] = []
    out_dir = os.environ.get("OUT")
    with tempfile.TemporaryDirectory() as tmp:
        scratch = args.scratch or tmp
        for i, case in enumerate(cases):
            left = args.budget_s - (time.time() - start)
            case_dir = os.path.join(scratch, f"case-{i:02d}")
            os.makedirs(case_dir, exist_ok=True)
            free = shutil.disk_usage(case_dir).free
            need = case.disk_bytes + DISK_RESERVE_BYTES
            why = (f"time budget: ~{case.estimate_s:.0f} s estimated, {left:.0f} s left" if case.estimate_s > left
                   else f"disk budget: {free / GIB:.1f} GiB free, {need / GIB:.1f} GiB needed" if free < need else None)
            if why:
                print(f"{case.name}: not run ({why})", file=sys.stderr)
                _record(rows, dict(seq_len=0, skipped=why), case, scale, baseline, out_dir, title)
                continue
            t0, done, failed = time.time(), set(), None
            try:
                if case.kind == "step":
                    measured = run_technique(probe, specs[case.model], _technique(case.technique),
                                             seq_lens(case), case_dir)
                else:
                    measured = run_in_child(case, args.dry_run, case_dir, left)
                for r in measured:
                    done.add(r["seq_len"])
                    r["written_bytes"], r["written_files"] = _written(case_dir)
                    _record(rows, r, case, scale, baseline, out_dir, title)
            except torch.OutOfMemoryError as e:
                failed = f"OOM: {e}"
            except Exception as e:  # noqa: BLE001 - one device call: a broken case (bitsandbytes
                # missing or built for another CUDA) is recorded, the other cases still run
                failed = f"{type(e).__name__}: {e}"
            if failed is not None:  # out of the except block: its traceback no longer holds the model
                probe.release()
                for s in seq_lens(case) if case.kind != "outside" else (0,):
                    if s not in done:
                        _record(rows, dict(seq_len=s, error=failed[:200]), case, scale, baseline, out_dir, title)
            rows[-1]["case_s"] = round(time.time() - t0, 1)
    for line in summarize(rows, baseline):
        print(f"# {line}")
    if not any("allocated" in r or "outside_allocator" in r for r in rows):
        print("error: no case measured\nhint: each row's error is above and in $OUT/gpu_check.json",
              file=sys.stderr)
        return 1
    return 0


def _hint() -> str:
    from lowvram.deps import pip_line

    return ("on the device machine, run bench/gpu_wheels.sh here first and carry .whl "
            f"(bench/gpu_check.sh installs it); elsewhere: {pip_line()} 'pydantic>=2.7,<3'")


def _record(rows, r, case, scale, baseline, out_dir, title) -> None:
    """Print one row and rewrite $OUT/gpu_check.json: a run cut short still leaves every row so far."""
    r.update(model=case.model or "-", case=case.name, kind=case.kind, technique=case.technique)
    rows.append(r)
    name = case.model or "-"
    if "allocated" in r:
        err = (r["predicted_tensors"] - r["allocated"]) / r["allocated"] * 100
        print(f"{name:14} {case.name:44} {r['seq_len']:>5} {r['predicted_tensors'] / scale:>12.3f} "
              f"{r['allocated'] / scale:>10.3f} {err:>+6.1f}% {r['predicted'] / scale:>10.3f} "
              f"{r['reserved'] / scale:>9.3f} {(r['outside_allocator'] - baseline) / scale:>8.3f}"
              f"  {r['step_s']}", flush=True)
    elif "outside_allocator" in r:
        print(f"{name:14} {case.name:44} {'':>5} {'':>12} {'':>10} {'':>7} {'':>10} {'':>9} "
              f"{(r['outside_allocator'] - baseline) / scale:>8.3f}  ({r['gpus']} gpu)", flush=True)
    else:
        print(f"{name:14} {case.name:44} {r['seq_len']:>5} {r.get('skipped') or r.get('error')}", flush=True)
    if out_dir:
        with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
            json.dump(dict(title=title, baseline_bytes=baseline, rows=rows), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
