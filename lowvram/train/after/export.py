"""`lowvram export RUN --gguf`: the run's model (an adapter merged on the fly, or a full fine-tune)
as one GGUF file for llama.cpp / Ollama / LM Studio, read back and checked, with an Ollama Modelfile.

Planned before anything is loaded (``plan_export``): the host RAM and the disk it needs, refused
with the figures when they do not fit. Everything runs on the CPU (the writer needs the weights in
host memory anyway). Host RAM, the larger of the two phases, + the adapter:
  writing   the merged model in its dtype + the packed file (GGUFWriter holds every tensor until it
            writes them: gguf_writer.py add_tensor / write_tensors_to_file)
  checking  the merged model cast to float32 + the file read back dequantized to float32
            (transformers' GGUF loader), i.e. 8 bytes per parameter, + the file's pages (the
            reader memory-maps it and reads every tensor).
The process itself (Python, torch, transformers: about 0.5 GB) is not counted, as for merge.
Disk: the file (tensor bytes per GGML type, gguf.GGML_QUANT_SIZES, + the vocabulary: at most the
size of tokenizer.json) written as ``NAME.partial`` beside it and renamed, + the Modelfile. A K-quant
(llama_quantize.py): the f16/bf16 file, then llama-quantize's output beside it (no larger).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lowvram.errors import LowvramError
from lowvram.runfiles import EXPORTS
from lowvram.train.after.gguf_family import family_of
from lowvram.train.after.gguf_file import QUANTIZATIONS, planned_tensors, tensor_bytes
from lowvram.train.after.llama_quantize import K_QUANTS
from lowvram.vocab import DTYPE_BYTES

_HEADER_BYTES = 64 * 1024  # GGUF header and the scalar metadata keys


@dataclass(frozen=True)
class ExportPlan:
    run_dir: str
    kind: str  # adapter (merged on the fly) | full
    model_source: str  # the base (adapter) or the run folder (full)
    tokenizer_source: str
    trust_remote_code: bool
    dtype: str
    quantization: str
    out_file: str
    modelfile: str
    parameters: int
    file_bytes: int
    ram_needed_bytes: int
    ram_available_bytes: int
    disk_needed_bytes: int
    disk_free_bytes: int
    prompt_format: str | None
    notes: tuple[str, ...] = ()
    llama_quantize: str | None = None  # K-quants: llama.cpp's binary, run on the file written as ``written_as``
    written_as: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ExportResult:
    out_file: str
    modelfile: str
    file_bytes: int
    seconds: float
    agreement: dict
    ollama_command: str
    modelfile_note: str | None
    plan: ExportPlan

    def to_dict(self) -> dict:
        return asdict(self)


def _quantizer(quantization: str, llama_quantize: str | Path | None) -> str | None:
    """The llama-quantize to run (a K-quant), None (lowvram writes it), or LowvramError."""
    from lowvram.train.after.llama_quantize import find_llama_quantize

    if quantization in QUANTIZATIONS:
        if llama_quantize is not None:
            raise LowvramError(f"--llama-quantize is for K-quants (q4_k_m, ...): lowvram writes {quantization} itself",
                               "leave --llama-quantize out, or ask for a K-quant with --quantization")
        return None
    if quantization in K_QUANTS:
        return find_llama_quantize(quantization, llama_quantize)
    raise LowvramError(f"unknown --quantization {quantization!r}",
                       f"use f16, bf16 or q8_0, or a K-quant with llama.cpp's llama-quantize ({', '.join(K_QUANTS)})")


def _refuse_tokenizer(path: Path) -> None:
    from lowvram.train.after.gguf_vocab import pre_tokenizer_name, tokenizer_kind

    tok_json = json.loads(path.read_text())
    if tokenizer_kind(tok_json) == "gpt2":
        pre_tokenizer_name(tok_json)


def _source(p: Path) -> tuple[str, str, str, str, bool, str, dict, tuple[str, ...]]:
    """(kind, model source, tokenizer source, dtype, trust, run name, config, notes) of a run folder."""
    from lowvram.plan.model.catalog import local_config
    from lowvram.train.after.artifacts import (
        find_base_model,
        merge_dtype,
        read_adapter_run,
        run_trusts_code,
    )

    notes: list[str] = []
    if not (p / "adapter_config.json").is_file() and (p / "config.json").is_file():
        from lowvram.past_runs import read_run

        info = read_run(p)
        config = json.loads((p / "config.json").read_text())
        dtype = str(config.get("dtype") or config.get("torch_dtype") or "float32")
        dtype = dtype if dtype in DTYPE_BYTES else "float32"
        return "full", str(p), str(p), dtype, run_trusts_code(info.recipe), p.name, config, ()
    p, adapter, recipe, plan = read_adapter_run(p)
    base = find_base_model(p, adapter, recipe)
    config = local_config(base.source)
    if config is None:
        raise LowvramError(f"cannot read the base model's config.json ({base.source})",
                           "export needs the base model in a local folder (the one the run trained on)")
    dtype = merge_dtype(recipe, plan)
    if plan.get("quantization", "none") != "none":
        notes.append(f"the run trained on a {plan['quantization']} base: it is merged into the base loaded "
                     f"dequantized in {dtype}")
    tok = str(p) if (p / "tokenizer_config.json").is_file() else base.source
    name = p.parent.name if p.name.startswith("checkpoint-") else p.name
    return "adapter", base.source, tok, dtype, base.trust_remote_code, name, config, tuple(notes)


def plan_export(run_dir: str | Path, quantization: str = "f16", out: str | Path | None = None,
                llama_quantize: str | Path | None = None) -> ExportPlan:
    """Check the request and size it (RAM, disk) before anything is loaded; LowvramError if it cannot work."""
    from lowvram.train.after.artifacts import (
        adapter_bytes,
        run_prompt_format,
    )
    from lowvram.train.after.footprint import Usage, plan_footprint
    from lowvram.units import mem

    binary = _quantizer(quantization, llama_quantize)
    p = Path(run_dir)
    kind, source, tok, dtype, trust, name, config, notes = _source(p)
    written_as = ("bf16" if dtype == "bfloat16" else "f16") if binary else quantization
    if binary:
        notes = (*notes, f"written as {written_as}, then quantized to {quantization.upper()} by {binary} "
                         "(llama.cpp's llama-quantize); the quantized file is checked")
    family_of(config)  # refuses a family or rope scaling the writer cannot write
    if not (Path(tok) / "tokenizer.json").is_file():
        raise LowvramError(f"no tokenizer.json in {tok}: the GGUF writer reads the fast tokenizer's file",
                           "save the tokenizer there with AutoTokenizer.from_pretrained(...).save_pretrained(...)")
    _refuse_tokenizer(Path(tok) / "tokenizer.json")
    out_file = Path(out) if out is not None else p / f"gguf-{quantization}" / f"{name}-{quantization}.gguf"
    if out_file.suffix != ".gguf":
        raise LowvramError(f"--out {out_file} does not end in .gguf", "name the file, e.g. --out exports/model-q8_0.gguf")
    modelfile = out_file.parent / "Modelfile"
    for f in (out_file, modelfile):
        if f.exists():
            raise LowvramError(f"{f} exists", "choose another --out (nothing was overwritten)")
    planned, n = planned_tensors(config, written_as)
    tensors = sum(tensor_bytes(t.shape, t.kind) for t in planned)
    file_bytes = tensors + (Path(tok) / "tokenizer.json").stat().st_size + _HEADER_BYTES
    extra = adapter_bytes(p) if kind == "adapter" else 0
    ram = max(n * DTYPE_BYTES[dtype] + file_bytes, n * 8 + file_bytes) + extra
    # on the CPU: GGUFWriter holds every packed tensor in host memory, so the GPU would save nothing
    fp = plan_footprint("export", None, Usage(0, ram, f"{n:,} parameters: the model in {dtype} + the "
                                                      f"{mem(file_bytes)} file; 8 bytes per parameter + the file while checking"),
                        # a K-quant: the f16 file and the quantized one (no larger) side by side
                        file_bytes * (2 if binary else 1) + 4096, out_file.parent,
                        f"the {written_as} file" + (f" and the {quantization} one made from it" if binary else ""),
                        ram_hint="close other programs, or export on a machine with more RAM",
                        disk_hint="free space there, or write elsewhere with --out PATH.gguf")
    return ExportPlan(str(p), kind, source, tok, trust, dtype, quantization, str(out_file), str(modelfile), n,
                      file_bytes, fp.ram_bytes, fp.ram_available_bytes, fp.disk_bytes, fp.disk_free_bytes,
                      run_prompt_format(p), notes, binary, written_as)


# --------------------------------------------------------------------------------------------
# Exporting


def _load(plan: ExportPlan):
    from lowvram.train.after.artifacts import (
        BaseModel,
        load_adapter,
        load_base,
        load_pretrained,
        load_run_tokenizer,
    )
    from lowvram.train.build.model import quiet_libraries

    quiet_libraries()
    if plan.kind == "adapter":
        base = BaseModel(plan.model_source, "export", trust_remote_code=plan.trust_remote_code)
        model = load_adapter(load_base(base, plan.dtype, "cpu"), Path(plan.run_dir)).merge_and_unload()
    else:
        import torch

        model = load_pretrained(plan.model_source, plan.trust_remote_code, dtype=getattr(torch, plan.dtype),
                                device_map={"": "cpu"})
    return model.eval(), load_run_tokenizer(plan.tokenizer_source, plan.trust_remote_code)


def export_run(plan: ExportPlan) -> ExportResult:
    """Merge (or load), write the GGUF, read it back and compare, write the Modelfile and the record.
    LowvramError (and no file left) when the file read back disagrees beyond the bounds."""
    from lowvram.train.after.gguf_check import compare
    from lowvram.train.after.gguf_file import write_gguf
    from lowvram.train.after.modelfile import modelfile_text

    t0 = time.perf_counter()
    model, tokenizer = _load(plan)
    out = Path(plan.out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    source = out.with_name(f"{out.stem}.{plan.written_as}.gguf.partial") if plan.llama_quantize else partial
    try:
        write_gguf(model, tokenizer, Path(plan.tokenizer_source), source, plan.written_as or plan.quantization, out.stem)
        if plan.llama_quantize:
            from lowvram.train.after.llama_quantize import run_llama_quantize

            run_llama_quantize(plan.llama_quantize, source, partial, plan.quantization)
            source.unlink()
        os.replace(partial, out)
    except OSError as e:
        partial.unlink(missing_ok=True)
        source.unlink(missing_ok=True)
        from lowvram.train.diskfull import is_disk_full

        if is_disk_full(e):
            raise LowvramError(f"disk full while writing {out} (nothing of it was kept)",
                               "free space on that disk, or write elsewhere with --out PATH.gguf") from None
        raise
    except LowvramError:
        partial.unlink(missing_ok=True)
        source.unlink(missing_ok=True)
        raise
    agreement = compare(model, tokenizer, out, plan.quantization)
    if not agreement.ok:
        out.unlink()
        raise LowvramError(
            f"the GGUF read back does not match the model (tokenization same: {agreement.same_tokenization}; "
            f"largest logit difference {agreement.relative_diff:.2%} of the logit scale, bound "
            f"{agreement.tolerance:.2%}; top-1 agreement {agreement.top1_agreement:.1%}, bound "
            f"{agreement.top1_at_least:.0%}"
            + ("; rope_freqs differ from the llama3 rope" if agreement.rope_freqs_match is False else "")
            + "): the file was removed",
            "try --quantization f16; if it persists, report it with the run's config.json")
    text, note = modelfile_text(out.name, tokenizer.chat_template, plan.prompt_format)
    Path(plan.modelfile).write_text(text)
    model_name = out.stem.lower().replace("_", "-")
    command = f"ollama create {model_name} -f {plan.modelfile}"
    result = ExportResult(str(out), plan.modelfile, out.stat().st_size, round(time.perf_counter() - t0, 3),
                          agreement.to_dict(), command, note, plan)
    _record(Path(plan.run_dir), result)
    return result


def _record(run_dir: Path, result: ExportResult) -> None:
    """Append the export to the run's exports.json (a read-only run folder: not recorded)."""
    path = run_dir / EXPORTS
    try:
        rows = json.loads(path.read_text()) if path.is_file() else []
    except (OSError, ValueError):
        rows = []
    rows.append({"file": result.out_file, "quantization": result.plan.quantization, "bytes": result.file_bytes,
                 "modelfile": result.modelfile, "agreement": result.agreement,
                 "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    try:
        path.write_text(json.dumps(rows, indent=2) + "\n")
    except OSError:
        pass

