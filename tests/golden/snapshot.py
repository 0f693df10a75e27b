"""The golden snapshot of the planner: the plan JSON (`lowvram plan --json`) of every catalog
model x method x a grid of cards, shapes and fixed techniques, and the memory estimate of every
catalog model x a grid of RunSetups, committed as tests/golden/plans.json.gz.

A refactoring of plan/ or planning/ must leave it identical (tests/plan/test_golden.py). A change
that means to move numbers refreshes it and shows what moved:

    make golden          # = .venv/bin/python -m tests.golden.snapshot --refresh

prints one line per changed case and field (old -> new) and rewrites the file.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

SNAPSHOT = Path(__file__).with_name("plans.json.gz")

METHODS = ("full", "lora", "qlora")
CARDS = ("8GiB", "24GiB", "80GiB")
SHAPES = ((1024, 16), (8192, 1))  # (seq_len, batch_size)
# Fixed techniques (flags of `lowvram plan`), each planned on the 24 GiB card at both shapes.
VARIANTS = {
    "checkpointing+chunked": {"gradient_checkpointing": True, "loss": "chunked"},
    "2gpus": {"gpus": 2},  # at batch 1 this is the planner's refusal (batch not divisible)
    "packing+eager": {"packing": True, "attention": "eager"},
}


def plan_cases() -> list[tuple[str, dict]]:
    """(key, make_plan kwargs): every model x method x card x shape on auto, and every model x
    method x shape x VARIANTS on 24 GiB (41 models: 1,476 plans)."""
    from lowvram.plan.model.catalog import catalog_names

    cases = []
    for model, method, (seq, batch) in itertools.product(catalog_names(), METHODS, SHAPES):
        base = {"model": model, "method": method, "seq_len": seq, "batch_size": batch}
        for card in CARDS:
            cases.append((f"{model}|{method}|{card}|s{seq}b{batch}|auto", {**base, "vram": card}))
        for name, flags in VARIANTS.items():
            cases.append((f"{model}|{method}|24GiB|s{seq}b{batch}|{name}", {**base, "vram": "24GiB", **flags}))
    return cases


def estimate_cases() -> list[tuple[str, object]]:
    """(key, RunSetup): every model x precision/quantization/LoRA x checkpointing x attention x
    two shapes x FSDP x packing (the grid compared by hand before the named moments)."""
    from lowvram.plan.model.catalog import catalog_names, resolve_model
    from lowvram.plan.setup import RunSetup

    methods = {"bf16-full": dict(precision="bf16"), "fp32-full": dict(precision="fp32"),
               "bf16-mixed-lora": dict(precision="bf16-mixed", lora=True),
               "bf16-lora": dict(precision="bf16", lora=True),
               "qlora": dict(precision="bf16", lora=True, quantization="nf4-dq")}
    cases = []
    for model in catalog_names():
        spec = resolve_model(model)
        for (mname, m), gc, attn, (seq, mb), offload, packing in itertools.product(
                methods.items(), (False, True), ("sdpa", "eager"), ((512, 4), (4096, 1)),
                ("none", "fsdp"), (False, True)):
            if offload == "fsdp" and m.get("quantization"):
                continue
            setup = RunSetup(model=spec, gradient_checkpointing=gc, attention=attn, seq_len=seq,
                             micro_batch_size=mb, offload=offload, gpus=2 if offload != "none" else 1,
                             packing=packing, **m)
            key = f"{model}|{mname}|gc{int(gc)}|{attn}|s{seq}m{mb}|{offload}|pack{int(packing)}"
            cases.append((key, setup))
    return cases


def plan_json(kwargs: dict) -> dict:
    from lowvram.errors import LowvramError
    from lowvram.plan.serialize import choice_to_dict
    from lowvram.planning.entry import make_plan

    try:
        # host RAM fixed (not this machine's): the snapshot is the same on every machine
        return json.loads(json.dumps(choice_to_dict(make_plan(host_ram="1TiB", **kwargs))))
    except LowvramError as err:  # a request the planner refuses is part of the snapshot too
        return {"error": str(err), "hint": err.hint}


def estimate_json(setup) -> dict:
    from lowvram.errors import LowvramError
    from lowvram.plan.memory.memory import estimate_memory

    try:
        return asdict(estimate_memory(setup))
    except LowvramError as err:  # a setup the model refuses is part of the snapshot too
        return {"error": str(err)}


def _compute_share(every: int, share: int, shares: int) -> dict[str, dict]:
    """Each shares-th case (from the share-th) of the every-th cases of each grid."""
    out = {}
    for key, kwargs in plan_cases()[::every][share::shares]:
        out["plan|" + key] = plan_json(kwargs)
    for key, setup in estimate_cases()[::every][share::shares]:
        out["estimate|" + key] = estimate_json(setup)
    return out


def compute(every: int = 1, jobs: int = 1) -> dict[str, dict]:
    """The snapshot's entries; ``every`` > 1: only each every-th case of each grid; ``jobs`` > 1:
    computed in that many processes (the planner is pure Python: one core a process; the whole
    grid takes about 14 CPU-minutes)."""
    if jobs <= 1:
        return _compute_share(every, 0, 1)
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(jobs) as pool:
        parts = pool.starmap(_compute_share, [(every, k, jobs) for k in range(jobs)])
    return {key: value for part in parts for key, value in part.items()}


def load() -> dict[str, dict]:
    with gzip.open(SNAPSHOT, "rt") as f:
        return json.load(f)


def save(entries: dict[str, dict]) -> None:
    data = json.dumps(entries, sort_keys=True, indent=0, separators=(",", ":")).encode()
    SNAPSHOT.write_bytes(gzip.compress(data, compresslevel=9, mtime=0))


def _flat(value, prefix=""):
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _flat(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _flat(v, f"{prefix}[{i}]")
    else:
        yield prefix, value


def differences(old: dict[str, dict], new: dict[str, dict]) -> list[str]:
    """One line per case added, removed, or field changed (old -> new)."""
    lines = []
    for key in sorted(set(old) | set(new)):
        if key not in old:
            lines.append(f"+ {key}")
        elif key not in new:
            lines.append(f"- {key}")
        elif old[key] != new[key]:
            a, b = dict(_flat(old[key])), dict(_flat(new[key]))
            for field in sorted(set(a) | set(b)):
                if a.get(field, "<absent>") != b.get(field, "<absent>"):
                    lines.append(f"~ {key} {field}: {a.get(field, '<absent>')!r} -> {b.get(field, '<absent>')!r}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--refresh", action="store_true", help="rewrite the snapshot (after showing the diff)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="processes that compute the cases (default: this machine's cores)")
    args = ap.parse_args(argv)
    new = compute(jobs=args.jobs)
    old = load() if SNAPSHOT.exists() else {}
    lines = differences(old, new)
    for line in lines:
        print(line)
    changed = len({line.split()[1] for line in lines})
    print(f"{len(new)} cases; {len(lines)} difference(s) in {changed} case(s)")
    if args.refresh and lines:
        save(new)
        print(f"wrote {SNAPSHOT}")
    return 0 if (args.refresh or not lines) else 1


if __name__ == "__main__":
    sys.exit(main())
