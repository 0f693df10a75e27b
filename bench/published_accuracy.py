"""The planner against published, measured GPU peak memory (bench/gpu_truth/*.yaml).

Each row of bench/gpu_truth is a fine-tuning run someone measured on a GPU and published, with its
settings and what was measured (bench/gpu_truth/README.md has the format). For every row this
builds the plan the way `lowvram plan` does (lowvram.plan.catalog.resolve_model, a RunSetup with
the row's settings, lowvram.plan.memory.estimate_memory) and compares like with like:

    allocated (torch.cuda.max_memory_allocated, "active")   vs the plan's tensor bytes
    reserved  (torch.cuda.max_memory_reserved)               vs tensors x (1 + allocator fraction)
    device    (nvidia-smi, the whole process)                vs tensors x (1 + fraction) + context
    capacity  (the longest run that fit a card of this size) vs the same device total

The CUDA context and the allocator fraction of lowvram.plan.setup.cuda_overheads() are fitted
here, on the sources marked `split: fit` only (fit_overheads); every other source is held out.
The headline is the error on the held-out rows.

    python bench/published_accuracy.py            # prints the report, writes bench/results/published_accuracy.txt
    python bench/published_accuracy.py --check    # prints only

Pure Python (no torch): a second or two.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lowvram.plan.catalog import resolve_model  # noqa: E402
from lowvram.plan.memory import estimate_memory  # noqa: E402
from lowvram.plan.setup import RunSetup, cuda_overheads  # noqa: E402

DATA = REPO / "bench" / "gpu_truth"
RESULTS = REPO / "bench" / "results" / "published_accuracy.txt"
GIB = 2**30
KINDS = ("allocated", "reserved", "device", "capacity")
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
# Keys a row may carry (defaults of its source apply first). Anything else is a typo.
ROW_KEYS = {
    "id", "model", "method", "lora_r", "lora_targets", "lora_dropout", "quantization", "precision",
    "seq_len", "micro_batch", "grad_accum", "gradient_checkpointing", "optimizer", "attention",
    "loss", "gpus", "offload", "kbit_prepare", "gpu", "measured", "where", "url", "score",
    "excluded", "differences", "assumptions", "overhead_fit", "overhead_why",
}
# The device total of a fitting row must stay below this share of the card: near the top the
# caching allocator frees its cache and retries instead of growing, so the slack it would show
# on a bigger card is squeezed out.
FIT_CAPACITY_SHARE = 0.90


def parse_size(text) -> int:
    """'19.77 GB' / '77256 MiB' / '72434837504 B' -> bytes."""
    number, unit = str(text).split()
    if unit not in UNITS:
        raise ValueError(f"unknown unit in {text!r} (known: {', '.join(UNITS)})")
    return round(float(number) * UNITS[unit])


@dataclass
class Row:
    source: str
    split: str
    id: str
    settings: dict
    measured: dict[str, int]
    where: str
    url: str
    score: bool = True
    excluded: str = ""
    differences: list[str] = field(default_factory=list)
    assumptions: list[str] = field(default_factory=list)
    overhead_fit: bool = False
    gpu_memory: int | None = None

    @property
    def key(self) -> str:
        return f"{self.source}/{self.id}"


@dataclass
class Source:
    name: str
    split: str
    url: str
    path: Path
    rows: list[Row]
    differences: str = ""


def load_sources(data: Path = DATA) -> list[Source]:
    """Every bench/gpu_truth/*.yaml, each row merged over its source's defaults."""
    sources = []
    for path in sorted(data.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        head = doc["source"]
        if head["split"] not in ("fit", "heldout"):
            raise ValueError(f"{path.name}: split must be fit or heldout")
        defaults = doc.get("defaults") or {}
        gpu_memory = parse_size(head["gpu_memory"]) if head.get("gpu_memory") else None
        rows = []
        for raw in doc["rows"]:
            merged = {**defaults, **raw}
            unknown = set(merged) - ROW_KEYS
            if unknown:
                raise ValueError(f"{path.name} row {raw.get('id')}: unknown keys {sorted(unknown)}")
            measured = {kind: parse_size(v) for kind, v in merged.pop("measured").items()}
            rows.append(Row(
                source=head["name"], split=head["split"], id=merged.pop("id"), measured=measured,
                where=merged.pop("where"), url=merged.pop("url", head["url"]),
                score=merged.pop("score", True), excluded=merged.pop("excluded", ""),
                differences=list(merged.pop("differences", [])),
                assumptions=list(merged.pop("assumptions", [])),
                overhead_fit=merged.pop("overhead_fit", False), gpu_memory=gpu_memory,
                settings={k: v for k, v in merged.items() if k not in ("gpu", "overhead_why")},
            ))
        sources.append(Source(head["name"], head["split"], head["url"], path, rows,
                              head.get("differences", "")))
    return sources


# --------------------------------------------------------------------------------------------
# The plan of one row


def resolve_row_model(name: str):
    """A catalog name, or configs/<dir> (a config.json copy under bench/gpu_truth)."""
    if name.startswith("configs/"):
        return resolve_model(str(DATA / name))
    return resolve_model(name)


def row_setup(row: Row) -> RunSetup | None:
    """The RunSetup `lowvram plan` would build for this row's settings (None: no model)."""
    s = row.settings
    if not s.get("model"):
        return None
    method = s.get("method", "full")
    kw = dict(
        model=resolve_row_model(s["model"]),
        precision=s.get("precision", "bf16"),
        quantization=s.get("quantization", "nf4-dq" if method == "qlora" else "none"),
        lora=method in ("lora", "qlora"),
        lora_r=s.get("lora_r", 16),
        lora_targets=tuple(s.get("lora_targets", ["all-linear"])),
        optimizer=s.get("optimizer", "adamw"),
        gradient_checkpointing=bool(s.get("gradient_checkpointing", False)),
        attention=s.get("attention", "sdpa"),
        loss=s.get("loss", "standard"),
        micro_batch_size=s["micro_batch"],
        seq_len=s["seq_len"],
        grad_accum=s.get("grad_accum", 1),
        gpus=s.get("gpus", 1),
        offload=s.get("offload", "none"),
        device="cuda",
        kbit_prepare=bool(s.get("kbit_prepare", False)),
    )
    # Inputs the planner gains later (issue 12: lora_dropout) are passed once RunSetup has them.
    names = {f.name for f in dataclasses.fields(RunSetup)}
    if "lora_dropout" in names and "lora_dropout" in s:
        kw["lora_dropout"] = s["lora_dropout"]
    return RunSetup(**kw)


def tensor_bytes(setup: RunSetup) -> int:
    """The plan's tensor peak: everything but the CUDA context and the allocator slack."""
    est = estimate_memory(setup)
    return est.peak_bytes - est.breakdown["cuda_context"] - est.breakdown["allocator"]


def predict(kind: str, tensors: int, context: int, fraction: float) -> int:
    if kind == "allocated":
        return tensors
    if kind == "reserved":
        return round(tensors * (1 + fraction))
    return round(tensors * (1 + fraction)) + context  # device, capacity


# --------------------------------------------------------------------------------------------
# Fitting the CUDA context and the allocator fraction (sources with split: fit only)


@dataclass(frozen=True)
class OverheadFit:
    context_bytes: int
    allocator_fraction: float
    context_rows: tuple[str, ...]
    pair_rows: tuple[str, ...]


def fit_overheads(sources: list[Source]) -> OverheadFit:
    """context: the median published CUDA context (rows measuring `context`); fraction: least
    squares through that context of (device - allocated - context) against allocated over the
    fitting rows that measured both in the same run (single GPU, below FIT_CAPACITY_SHARE of the
    card). The overhead pairs use the measured allocated bytes, not the plan's, so the tensor
    model's own error does not leak into these two constants. Rounded: context to MiB, fraction
    to 0.01 (what memory.cuda_overheads() ships)."""
    fit_rows = [r for src in sources if src.split == "fit" for r in src.rows]
    contexts = [r for r in fit_rows if "context" in r.measured and r.score]
    pairs = [r for r in fit_rows if r.overhead_fit and {"device", "allocated"} <= set(r.measured)]
    if not contexts or not pairs:
        raise ValueError("the fitting set needs context rows and device/allocated pairs")
    for r in pairs:
        if r.settings.get("gpus", 1) != 1:
            raise ValueError(f"{r.key}: overhead pairs must be single-GPU runs")
        if r.gpu_memory and r.measured["device"] > FIT_CAPACITY_SHARE * r.gpu_memory:
            raise ValueError(f"{r.key}: device total above {FIT_CAPACITY_SHARE:.0%} of the card")
    context = statistics.median(r.measured["context"] for r in contexts)
    context = round(context / 2**20) * 2**20
    num = sum(r.measured["allocated"] * (r.measured["device"] - r.measured["allocated"] - context)
              for r in pairs)
    den = sum(r.measured["allocated"] ** 2 for r in pairs)
    return OverheadFit(int(context), round(num / den, 2), tuple(r.key for r in contexts),
                       tuple(r.key for r in pairs))


# --------------------------------------------------------------------------------------------
# Scoring


@dataclass(frozen=True)
class Comparison:
    row: Row
    kind: str
    predicted: int
    measured: int
    scored: bool  # False: information only (row.excluded says why)

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured


def compare(sources: list[Source], context: int, fraction: float) -> list[Comparison]:
    out = []
    for src in sources:
        for row in src.rows:
            setup = row_setup(row)
            if setup is None:
                continue
            tensors = tensor_bytes(setup)
            for kind in KINDS:
                if kind in row.measured:
                    out.append(Comparison(row, kind, predict(kind, tensors, context, fraction),
                                          row.measured[kind], row.score))
    return out


def overhead_checks(sources: list[Source], context: int, fraction: float) -> list[tuple[Row, str, float]]:
    """Rows measuring allocated and reserved (or device) in the same run: the overheads alone,
    (predicted from the measured allocated - measured) / measured, whatever the tensor model says."""
    out = []
    for src in sources:
        for row in src.rows:
            m = row.measured
            if "allocated" not in m:
                continue
            if "reserved" in m:
                out.append((row, "reserved", (m["allocated"] * (1 + fraction) - m["reserved"]) / m["reserved"]))
            if "device" in m and row.settings.get("gpus", 1) == 1:
                pred = m["allocated"] * (1 + fraction) + context
                out.append((row, "device", (pred - m["device"]) / m["device"]))
    return out


@dataclass(frozen=True)
class Summary:
    n: int
    median_abs: float
    mean: float
    within_10: int
    worst_over: float
    worst_under: float


def summarize(errors: list[float]) -> Summary | None:
    if not errors:
        return None
    return Summary(len(errors), statistics.median(abs(e) for e in errors), statistics.fmean(errors),
                   sum(abs(e) <= 0.10 for e in errors), max(max(errors), 0.0), min(min(errors), 0.0))


def fmt_summary(s: Summary | None) -> str:
    if s is None:
        return "no rows"
    return (f"{s.n:3d} comparisons, median |error| {100 * s.median_abs:5.1f}%, mean {100 * s.mean:+6.1f}%, "
            f"within 10%: {s.within_10}/{s.n}, worst {100 * s.worst_under:+.1f}% / {100 * s.worst_over:+.1f}%")


def headline(comps: list[Comparison], split: str) -> Summary | None:
    return summarize([c.error for c in comps if c.scored and c.row.split == split])


# --------------------------------------------------------------------------------------------
# Report


def report(sources: list[Source]) -> str:
    fit = fit_overheads(sources)
    shipped = cuda_overheads()
    comps = compare(sources, shipped.context_bytes, shipped.allocator_fraction)
    old = compare(sources, 512 * 2**20, 0.05)
    lines = [
        "# lowvram plan vs published GPU measurements (bench/gpu_truth; python bench/published_accuracy.py)",
        "# error = (predicted - measured) / measured; allocated vs the plan's tensors, reserved vs tensors x (1 + f),",
        "# device/capacity vs tensors x (1 + f) + context. '~' marks information rows (not scored: see 'excluded').",
        "",
        "## CUDA overheads, fitted on the split: fit sources only",
        f"context_bytes      = {fit.context_bytes:,} ({fit.context_bytes / 2**20:.0f} MiB): median of "
        f"{len(fit.context_rows)} published CUDA-context readings ({', '.join(fit.context_rows)})",
        f"allocator_fraction = {fit.allocator_fraction:.2f}: least squares of device - allocated - context "
        f"against allocated over {len(fit.pair_rows)} single-GPU runs ({', '.join(fit.pair_rows)})",
        f"shipped in lowvram.plan.setup.cuda_overheads(): context_bytes={shipped.context_bytes:,}, "
        f"allocator_fraction={shipped.allocator_fraction}"
        + ("" if (shipped.context_bytes, shipped.allocator_fraction) == (fit.context_bytes, fit.allocator_fraction)
           else "  <-- DIFFERS FROM THE FIT"),
        "",
    ]
    for src in sources:
        rows = [c for c in comps if c.row.source == src.name]
        lines.append(f"## {src.name} ({'fitting set' if src.split == 'fit' else 'held out'}) -- {src.url}")
        if not rows:
            lines.append("(no planned rows: overhead readings only)")
        for i, c in enumerate(rows):
            mark = " " if c.scored else "~"
            lines.append(f"{mark} {c.row.id:<38} {c.kind:<9} predicted {c.predicted / GIB:7.2f} GiB  "
                         f"measured {c.measured / GIB:7.2f} GiB  {100 * c.error:+7.1f}%")
            if i + 1 == len(rows) or rows[i + 1].row is not c.row:  # after a row's last comparison
                lines += [f"      note: {d}" for d in c.row.differences]
                lines += [f"      assumed: {a}" for a in c.row.assumptions]
        for row in src.rows:
            if not row.score:
                lines.append(f"  excluded {row.id}: {row.excluded}")
        lines.append(f"  summary: {fmt_summary(summarize([c.error for c in rows if c.scored]))}")
        lines.append("")
    lines.append("## Overheads alone (measured allocated -> predicted reserved/device, vs measured)")
    for row, kind, err in overhead_checks(sources, shipped.context_bytes, shipped.allocator_fraction):
        lines.append(f"  {row.key:<48} {kind:<9} {100 * err:+7.1f}%  ({'fitting set' if row.split == 'fit' else 'held out'})")
    checks = overhead_checks(sources, shipped.context_bytes, shipped.allocator_fraction)
    for split, label in (("heldout", "held out"), ("fit", "fitting set")):
        lines.append(f"  summary, {label}: {fmt_summary(summarize([e for r, _, e in checks if r.split == split]))}")
    lines.append("")
    lines.append("## Headline")
    for split, label in (("heldout", "held out (never used in any fit)"), ("fit", "in sample (fitting set)")):
        lines.append(f"{label:<36} {fmt_summary(headline(comps, split))}")
        for kind in KINDS:
            s = summarize([c.error for c in comps if c.scored and c.row.split == split and c.kind == kind])
            if s:
                lines.append(f"  {kind:<34} {fmt_summary(s)}")
    lines.append("held out, by method:")
    for method in ("full", "lora", "qlora"):
        s = summarize([c.error for c in comps if c.scored and c.row.split == "heldout"
                       and c.row.settings.get("method", "full") == method])
        lines.append(f"  {method:<34} {fmt_summary(s)}")
    held_old = headline(old, "heldout")
    lines.append(f"{'held out, before the fit (0.5 GiB, 5%)':<36} {fmt_summary(held_old)}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="print only; do not write the results file")
    args = ap.parse_args(argv)
    text = report(load_sources())
    print(text, end="")
    if not args.check:
        RESULTS.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
