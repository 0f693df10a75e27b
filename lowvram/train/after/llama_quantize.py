"""K-quants (Q4_K_M, ...) through llama.cpp's own `llama-quantize`, when one is on this machine:
on PATH or given with --llama-quantize. lowvram never downloads or compiles it (gguf-py, the
maintained Python side of llama.cpp, quantizes F16/BF16/Q8_0 and the legacy Q4_0..Q5_1 blocks but
no K-quant: gguf/quants.py has their dequantizers only). The F16 (or BF16) file lowvram writes is
its input; its output is read back and checked like every export.

The type names are llama-quantize's own (tools/quantize/quantize.cpp QUANT_OPTIONS), given in
upper case on its command line: `llama-quantize IN.gguf OUT.gguf Q4_K_M`.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from lowvram.errors import LowvramError

K_QUANTS = ("q2_k", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k",
            "q4_0", "q4_1", "q5_0", "q5_1")


def find_llama_quantize(quantization: str, given: str | Path | None) -> str:
    """The llama-quantize to run for ``quantization`` (a K-quant), or LowvramError saying how to get one."""
    command = f"`llama-quantize MODEL-f16.gguf MODEL-{quantization}.gguf {quantization.upper()}`"
    if given is not None:
        path = Path(given)
        if not path.is_file() or not os.access(path, os.X_OK):
            raise LowvramError(f"--llama-quantize {given}: not an executable file",
                               "give the path of llama.cpp's llama-quantize (built or installed; lowvram builds nothing)")
        return str(path.resolve())
    found = shutil.which("llama-quantize")
    if found is None:
        raise LowvramError(f"--quantization {quantization}: K-quants need llama.cpp's llama-quantize, and none is on "
                           "PATH (lowvram writes f16, bf16 and q8_0 itself; it downloads and compiles nothing)",
                           f"install llama.cpp and pass --llama-quantize PATH, or export f16 and run {command}")
    return found


def run_llama_quantize(binary: str, source: Path, target: Path, quantization: str) -> None:
    """``binary source target TYPE``; LowvramError with the end of its output when it fails or
    writes nothing (``target`` removed)."""
    try:
        done = subprocess.run([binary, str(source), str(target), quantization.upper()],
                              capture_output=True, text=True, check=False)
    except OSError as e:
        raise LowvramError(f"cannot run {binary}: {e.strerror or e}", "check the --llama-quantize path") from None
    if done.returncode != 0 or not target.is_file() or target.stat().st_size == 0:
        target.unlink(missing_ok=True)
        tail = " | ".join((done.stderr or done.stdout or "").strip().splitlines()[-3:]) or "no output"
        what = f"exited with {done.returncode}" if done.returncode else "wrote no file"
        raise LowvramError(f"{binary} {what} while quantizing to {quantization.upper()}: {tail}",
                           "run it by hand on the f16 export to see why (lowvram kept no file)")
