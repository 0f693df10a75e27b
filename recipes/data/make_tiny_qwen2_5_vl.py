"""Generate models/tiny-qwen2.5-vl/: a randomly initialised Qwen2.5-VL of 0.6M parameters (a
2-layer Qwen2 language model of width 128, a 2-block vision tower of width 64 with 8 px patches
and its 2 x 2 patch merger), its byte-level BPE tokenizer (512 tokens, Qwen's image specials) and
its processor (Qwen2VLImageProcessor: 16 x 16 px a token, no video processor), for
recipes/qwen2.5-vl-tiny-shapes.yaml: the image path of Qwen2.5-VL end to end on a CPU in a minute.
Deterministic (seed 2047), no download: lowvram.check.builders.save_tiny_vision_model.

Usage: python recipes/data/make_tiny_qwen2_5_vl.py [OUT_DIR]    (default: models/tiny-qwen2.5-vl)
"""
import sys
from pathlib import Path

from lowvram.check.builders import save_tiny_vision_model

ROOT = Path(__file__).resolve().parents[2]
SHAPE = dict(hidden=128, layers=2, vision_layers=2, vision_hidden=64, patch_size=8)
SEED = 2047


def make(out: Path) -> Path:
    return save_tiny_vision_model(out, "qwen2_5_vl", seed=SEED, **SHAPE)


if __name__ == "__main__":
    print(make(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "models" / "tiny-qwen2.5-vl"))
