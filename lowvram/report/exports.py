"""Printing `lowvram export`: the plan (before loading), the file, its agreement with the model, the
Ollama command; and a run's exports for `show`."""

from __future__ import annotations

from lowvram.report.console import console, print_json
from lowvram.units import mem


def show_export_plan(ep) -> None:
    """On stderr, before anything is loaded: what is exported, and the RAM and disk it needs."""
    c = console(stderr=True)
    what = "adapter merged into " + ep.model_source if ep.kind == "adapter" else "full model"
    c.print(f"export: {ep.run_dir} ({what}) -> {ep.out_file} ({ep.quantization})", markup=False)
    c.print(f"needs {mem(ep.ram_needed_bytes)} of host RAM ({ep.parameters:,} parameters, {ep.dtype}; "
            f"{mem(ep.ram_available_bytes)} available) and {mem(ep.disk_needed_bytes)} of disk "
            f"({mem(ep.disk_free_bytes)} free); on the CPU", markup=False)
    for note in ep.notes:
        c.print(f"note: {note}", markup=False)


def agreement_line(a: dict) -> str:
    same = "same tokenization" if a["same_tokenization"] else "DIFFERENT tokenization"
    return (f"{same} on {a['prompts']} prompts ({a['tokens']} tokens); largest logit difference "
            f"{a['max_abs_diff']:.4g} on logits up to {a['logit_scale']:.4g} ({a['relative_diff']:.3%}, "
            f"bound {a['tolerance']:.2%}); top-1 agreement {a['top1_agreement']:.1%} (bound {a['top1_at_least']:.0%})"
            + ({True: "; rope_freqs match transformers' llama3 rope", False: "; rope_freqs DIFFER from the llama3 rope"}
               .get(a.get("rope_freqs_match"), "")))


def show_export_result(result, as_json: bool = False) -> None:
    if as_json:
        print_json(result.to_dict())
        return
    c = console()
    c.print(f"[green]exported[/green] {result.out_file} ({mem(result.file_bytes)}) in {result.seconds:.1f} s")
    by = {"gguf": "gguf's reader and dequantizers (transformers cannot load this architecture)"}.get(
        result.agreement.get("read_back_by"), "transformers' GGUF loader")
    c.print(f"read back with {by}: " + agreement_line(result.agreement), markup=False)
    c.print(f"Modelfile: {result.modelfile}", markup=False)
    if result.modelfile_note:
        c.print(f"note: {result.modelfile_note}", markup=False)
    c.print(f"Ollama: {result.ollama_command}", markup=False)
    c.print(f"llama.cpp: llama-cli -m {result.out_file}", markup=False)


def export_rows(exports: list[dict]) -> list[str]:
    """One line per export of a run (show)."""
    out = []
    for e in exports:
        a = e.get("agreement") or {}
        check = (f"checked: top-1 {a['top1_agreement']:.1%}, logit diff {a['relative_diff']:.3%}"
                 if "top1_agreement" in a else "not checked")
        out.append(f"{e.get('file')} ({e.get('quantization')}, {mem(e.get('bytes'))}; {check})")
    return out
