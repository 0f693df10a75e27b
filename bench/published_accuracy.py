"""The planner against published, measured GPU peak memory (bench/gpu_truth/*.yaml).

Each row of bench/gpu_truth is a fine-tuning run someone measured on a GPU and published, with its
settings and what was measured (bench/gpu_truth/README.md has the format). For every row this
builds the plan the way `lowvram plan` does (lowvram.plan.model.catalog.resolve_model, a RunSetup with
the row's settings, lowvram.plan.memory.memory.estimate_memory) and compares like with like:

    allocated (torch.cuda.max_memory_allocated, "active")   vs the plan's tensor bytes
    reserved  (torch.cuda.max_memory_reserved)               vs tensors + the allocator slack
    device    (nvidia-smi, the whole process)                vs tensors + slack + context
    capacity  (the longest run that fit a card of this size) vs the same device total

The slack has two shares (lowvram.plan.setup.CudaOverheads): once x (weights + optimizer state)
+ churn x (tensors - those), the churn share smaller with expandable segments. The CUDA context
and the three allocator constants of lowvram.plan.setup.cuda_overheads() are fitted here, on the
sources marked `split: fit` and on bench/gpu_truth/allocator_pairs.yaml only (fit_overheads);
every other source is held out. The headline is the error on the held-out rows.

    python bench/published_accuracy.py            # prints the report, writes bench/results/published_accuracy.txt
    python bench/published_accuracy.py --check    # prints only

Pure Python (no torch): a second or two.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from lowvram.plan.memory.memory import estimate_memory  # noqa: E402
from lowvram.plan.model.catalog import resolve_model  # noqa: E402
from lowvram.plan.setup import CudaOverheads, RunSetup, cuda_overheads  # noqa: E402

DATA = REPO / "bench" / "gpu_truth"
# Pairs of reserved and allocated bytes that give the allocator slack its shares (not planned rows)
ALLOCATOR_PAIRS = DATA / "allocator_pairs.yaml"
RESULTS = REPO / "bench" / "results" / "published_accuracy.txt"
GIB = 2**30
KINDS = ("allocated", "reserved", "device", "capacity")
UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
# Keys a row may carry (defaults of its source apply first). Anything else is a typo.
ROW_KEYS = {
    "id", "model", "method", "lora_r", "lora_targets", "lora_dropout", "quantization", "precision",
    "seq_len", "micro_batch", "grad_accum", "gradient_checkpointing", "optimizer", "attention",
    "loss", "gpus", "offload", "kbit_prepare", "gpu", "measured", "where", "url", "score",
    "excluded", "differences", "assumptions", "overhead_fit", "overhead_why", "allocated_once",
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
    # bytes allocated once and kept (weights + optimizer state) for a row the planner cannot plan
    allocated_once: int | None = None
    expandable_segments: bool = False  # the run had PyTorch's expandable segments (its source says)

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
        if path.name == ALLOCATOR_PAIRS.name:  # not planned rows: fit_allocator reads it
            continue
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
                allocated_once=parse_size(merged.pop("allocated_once")) if "allocated_once" in merged else None,
                expandable_segments=bool(head.get("expandable_segments", False)),
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
        expandable_segments=row.expandable_segments,
    )
    # Inputs the planner gains later (issue 12: lora_dropout) are passed once RunSetup has them.
    names = {f.name for f in dataclasses.fields(RunSetup)}
    if "lora_dropout" in names and "lora_dropout" in s:
        kw["lora_dropout"] = s["lora_dropout"]
    return RunSetup(**kw)


def plan_bytes(setup: RunSetup) -> tuple[int, int]:
    """The plan's tensor peak (everything but the CUDA context and the allocator slack) and the
    part of it allocated once (the allocator's loaded_once share is taken on it)."""
    est = estimate_memory(setup)
    tensors = est.peak_bytes - est.breakdown["cuda_context"] - est.breakdown["allocator"]
    return tensors, est.allocated_once_bytes


def slack(ov: CudaOverheads, once: int, tensors: int, expandable: bool) -> int:
    return sum(ov.allocator_parts(once, tensors - once, expandable).values())


def predict(kind: str, tensors: int, once: int, ov: CudaOverheads, expandable: bool = False) -> int:
    if kind == "allocated":
        return tensors
    if kind == "reserved":
        return tensors + slack(ov, once, tensors, expandable)
    return tensors + slack(ov, once, tensors, expandable) + ov.context_bytes  # device, capacity


# --------------------------------------------------------------------------------------------
# Fitting the CUDA context and the allocator's shares (split: fit sources and allocator_pairs.yaml)


@dataclass(frozen=True)
class OverheadFit:
    context_bytes: int
    once_fraction: float  # the largest load-time share (a bound), rounded up to ONCE_STEP
    churn_fraction: float  # least squares over the pair rows, rounded to 0.01
    expandable_ratio: float  # the largest published bound of slack(on) / slack(off), rounded up
    churn_fraction_expandable: float  # churn_fraction x expandable_ratio, rounded up to 0.01
    context_rows: tuple[str, ...]
    load_rows: tuple[str, ...]
    pair_rows: tuple[str, ...]
    off_on_rows: tuple[str, ...]

    def overheads(self) -> CudaOverheads:
        return CudaOverheads(self.context_bytes, self.once_fraction, self.churn_fraction,
                             self.churn_fraction_expandable)


ONCE_STEP = 0.005
RATIO_STEP = 0.05


def round_up(x: float, step: float) -> float:
    return round(math.ceil(x / step - 1e-9) * step, 4)


def load_allocator_pairs(path: Path = ALLOCATOR_PAIRS) -> dict:
    """allocator_pairs.yaml with its sizes parsed: {"load": [...], "off_on": [...]}."""
    doc = yaml.safe_load(path.read_text())
    sizes = ("allocated", "reserved", "reserved_off", "reserved_on", "allocated_floor")
    return {part: [{k: parse_size(v) if k in sizes else v for k, v in row.items()} for row in doc[part]]
            for part in ("load", "off_on")}


def load_share(row: dict) -> float:
    """reserved - allocated over allocated, read right after loading: the slack on once-allocated bytes."""
    return (row["reserved"] - row["allocated"]) / row["allocated"]


def off_on_bound(row: dict) -> float:
    """Upper bound of slack(on) / slack(off) for one run: (R_on - A) / (R_off - A) falls as the
    unpublished peak allocated A grows, so A's published floor gives the largest value."""
    floor = row["allocated_floor"]
    return (row["reserved_on"] - floor) / (row["reserved_off"] - floor)


def row_once(row: Row) -> int | None:
    """The bytes a run allocated once (weights + optimizer state): stated for a row the planner
    cannot plan, else the plan's."""
    if row.allocated_once is not None:
        return row.allocated_once
    setup = row_setup(row)
    return plan_bytes(setup)[1] if setup is not None else None


def fit_overheads(sources: list[Source], pairs_doc: dict | None = None) -> OverheadFit:
    """context: the median published CUDA context (rows measuring `context`).
    once: the largest reserved - allocated over allocated of the load pairs (a bound, not a mean).
    churn: least squares through the origin of (device - allocated - context - once x W) against
    (allocated - W), W the bytes allocated once, over the fitting rows that measured device and
    allocated in the same run (single GPU, below FIT_CAPACITY_SHARE of the card, expandable
    segments off). The measured allocated bytes are used, not the plan's tensor peak, so the tensor
    model's own error does not leak in (W is the plan's weights and optimizer state).
    churn with expandable segments: churn x the largest published bound of slack(on) / slack(off).
    Rounded up: once to 0.005, the ratio to 0.05, the expandable churn to 0.01; churn to 0.01;
    context to MiB (what setup.cuda_overheads() ships)."""
    pairs_doc = load_allocator_pairs() if pairs_doc is None else pairs_doc
    fit_rows = [r for src in sources if src.split == "fit" for r in src.rows]
    contexts = [r for r in fit_rows if "context" in r.measured and r.score]
    pairs = [r for r in fit_rows if r.overhead_fit and {"device", "allocated"} <= set(r.measured)]
    if not contexts or not pairs or not pairs_doc["load"] or not pairs_doc["off_on"]:
        raise ValueError("the fitting set needs context rows, device/allocated pairs, load pairs and off/on runs")
    for r in pairs:
        if r.settings.get("gpus", 1) != 1:
            raise ValueError(f"{r.key}: overhead pairs must be single-GPU runs")
        if r.gpu_memory and r.measured["device"] > FIT_CAPACITY_SHARE * r.gpu_memory:
            raise ValueError(f"{r.key}: device total above {FIT_CAPACITY_SHARE:.0%} of the card")
        if r.expandable_segments:
            raise ValueError(f"{r.key}: the churn share is fitted on runs without expandable segments")
    context = statistics.median(r.measured["context"] for r in contexts)
    context = round(context / 2**20) * 2**20
    once = round_up(max(load_share(p) for p in pairs_doc["load"] if not p["expandable_segments"]), ONCE_STEP)
    num = den = 0
    for r in pairs:
        m, w = r.measured, row_once(r)
        churn = m["allocated"] - w
        num += churn * (m["device"] - m["allocated"] - context - once * w)
        den += churn * churn
    churn_fraction = round(num / den, 2)
    ratio = round_up(max(off_on_bound(p) for p in pairs_doc["off_on"]), RATIO_STEP)
    return OverheadFit(int(context), once, churn_fraction, ratio, round_up(churn_fraction * ratio, 0.01),
                       tuple(r.key for r in contexts), tuple(p["id"] for p in pairs_doc["load"]),
                       tuple(r.key for r in pairs), tuple(p["id"] for p in pairs_doc["off_on"]))


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


def compare(sources: list[Source], ov: CudaOverheads) -> list[Comparison]:
    out = []
    for src in sources:
        for row in src.rows:
            setup = row_setup(row)
            if setup is None:
                continue
            tensors, once = plan_bytes(setup)
            for kind in KINDS:
                if kind in row.measured:
                    pred = predict(kind, tensors, once, ov, row.expandable_segments)
                    out.append(Comparison(row, kind, pred, row.measured[kind], row.score))
    return out


def overhead_checks(sources: list[Source], ov: CudaOverheads) -> list[tuple[Row, str, float]]:
    """Rows measuring allocated and reserved (or device) in the same run: the overheads alone,
    (predicted from the measured allocated - measured) / measured, whatever the tensor model says
    (the loaded_once share on the row's once-allocated bytes, at most the measured allocated)."""
    out = []
    for src in sources:
        for row in src.rows:
            m = row.measured
            if "allocated" not in m:
                continue
            once = min(row_once(row) or 0, m["allocated"])
            reserved = m["allocated"] + slack(ov, once, m["allocated"], row.expandable_segments)
            if "reserved" in m:
                out.append((row, "reserved", (reserved - m["reserved"]) / m["reserved"]))
            if "device" in m and row.settings.get("gpus", 1) == 1:
                out.append((row, "device", (reserved + ov.context_bytes - m["device"]) / m["device"]))
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


# The allocator term before it had shares (ALLOCATOR_FRACTION, 12% of every tensor, fitted here on
# the same nine runs) and before any fit (0.5 GiB, 5%): the report scores both beside the shipped one.
SINGLE_SHARE = CudaOverheads(300 * 2**20, 0.12, 0.12, 0.12)
BEFORE_FIT = CudaOverheads(512 * 2**20, 0.05, 0.05, 0.05)


def allocator_lines(sources: list[Source], fit: OverheadFit, pairs_doc: dict) -> list[str]:
    """What the allocator's shares rest on: each load pair, each off/on run, each pair row's residual."""
    lines = ["## The allocator slack's shares (bench/gpu_truth/allocator_pairs.yaml, the fitting rows)",
             f"loaded_once = {fit.once_fraction} x (weights + optimizer state): the largest share of "
             f"{len(fit.load_rows)} load pairs, rounded up to {ONCE_STEP}"]
    for p in pairs_doc["load"]:
        lines.append(f"  load  {p['id']:<40} allocated {p['allocated'] / GIB:6.2f} GiB  reserved "
                     f"{p['reserved'] / GIB:6.2f} GiB  share {100 * load_share(p):5.2f}%")
    lines.append(f"churn (expandable segments off) = {fit.churn_fraction} x (tensors - once): least squares "
                 f"over {len(fit.pair_rows)} single-GPU runs (residual: predicted device from the measured "
                 "allocated, vs measured; the single 12% share beside it)")
    ov = fit.overheads()
    fit_rows = {r.key: r for src in sources for r in src.rows}
    for key in fit.pair_rows:
        r = fit_rows[key]
        m, w = r.measured, row_once(r)
        pred = m["allocated"] + slack(ov, w, m["allocated"], False) + ov.context_bytes
        single = m["allocated"] + slack(SINGLE_SHARE, w, m["allocated"], False) + SINGLE_SHARE.context_bytes
        lines.append(f"  pair  {key:<40} once {w / GIB:6.2f} GiB  churn {(m['allocated'] - w) / GIB:6.2f} GiB  "
                     f"{100 * (pred - m['device']) / m['device']:+6.1f}%  (12%: "
                     f"{100 * (single - m['device']) / m['device']:+6.1f}%)")
    lines.append(f"churn (expandable segments on) = {fit.churn_fraction} x {fit.expandable_ratio} = "
                 f"{fit.churn_fraction_expandable} x (tensors - once): the ratio is the largest published "
                 f"upper bound of slack(on) / slack(off), rounded up to {RATIO_STEP}")
    for p in pairs_doc["off_on"]:
        lines.append(f"  off/on {p['id']:<39} reserved {p['reserved_off'] / GIB:6.2f} -> {p['reserved_on'] / GIB:6.2f} "
                     f"GiB, allocated >= {p['allocated_floor'] / GIB:6.2f} GiB: slack(on)/slack(off) <= "
                     f"{off_on_bound(p):.3f}")
    return lines + [""]


def report(sources: list[Source]) -> str:
    pairs_doc = load_allocator_pairs()
    fit = fit_overheads(sources, pairs_doc)
    shipped = cuda_overheads()
    comps = compare(sources, shipped)
    matches = dataclasses.replace(shipped, calibrated=False) == fit.overheads()
    lines = [
        "# lowvram plan vs published GPU measurements (bench/gpu_truth; python bench/published_accuracy.py)",
        "# error = (predicted - measured) / measured; allocated vs the plan's tensors, reserved vs tensors + the",
        "# allocator slack (once x (weights + optimizer state) + churn x the rest), device/capacity vs reserved +",
        "# context. '~' marks information rows (not scored: see 'excluded').",
        "",
        "## CUDA overheads, fitted on the split: fit sources and allocator_pairs.yaml only",
        f"context_bytes = {fit.context_bytes:,} ({fit.context_bytes / 2**20:.0f} MiB): median of "
        f"{len(fit.context_rows)} published CUDA-context readings ({', '.join(fit.context_rows)})",
        f"shipped in lowvram.plan.setup.cuda_overheads(): context_bytes={shipped.context_bytes:,}, "
        f"once_fraction={shipped.once_fraction}, churn_fraction={shipped.churn_fraction}, "
        f"churn_fraction_expandable={shipped.churn_fraction_expandable}"
        + ("" if matches else "  <-- DIFFERS FROM THE FIT"),
        "",
        *allocator_lines(sources, fit, pairs_doc),
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
    checks = overhead_checks(sources, shipped)
    single = {(r.key, k): e for r, k, e in overhead_checks(sources, SINGLE_SHARE)}
    for row, kind, err in checks:
        lines.append(f"  {row.key:<48} {kind:<9} {100 * err:+7.1f}%  (12%: {100 * single[row.key, kind]:+6.1f}%)  "
                     f"({'fitting set' if row.split == 'fit' else 'held out'})")
    for split, label in (("heldout", "held out"), ("fit", "fitting set")):
        lines.append(f"  summary, {label}: {fmt_summary(summarize([e for r, _, e in checks if r.split == split]))}")
        lines.append(f"  the single 12% share, {label}: "
                     f"{fmt_summary(summarize([e for (k, _), e in single.items() if _split(sources, k) == split]))}")
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
    for label, ov in (("held out, the single 12% share", SINGLE_SHARE),
                      ("held out, before the fit (0.5 GiB, 5%)", BEFORE_FIT)):
        lines.append(f"{label:<36} {fmt_summary(headline(compare(sources, ov), 'heldout'))}")
    lines.append(f"{'in sample, the single 12% share':<36} {fmt_summary(headline(compare(sources, SINGLE_SHARE), 'fit'))}")
    return "\n".join(lines) + "\n"


def _split(sources: list[Source], key: str) -> str:
    return next(src.split for src in sources for r in src.rows if r.key == key)


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
