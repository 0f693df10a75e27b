"""The frozen Qwen2.5-VL / Qwen3-VL tower's forward (plan/memory/qwen_tower.py, the moment
vision_encoder_forward) against the live-bytes tracker on 1-2 layer towers at the image size
data.max_pixels gives: attention-, MLP- and embedding-bound, one and two images, fp32, bf16 and
bf16-mixed, SDPA and eager, Qwen3-VL with deepstack mergers."""

from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from lowvram.check.builders import multimodal_config  # noqa: E402
from lowvram.livebytes import LiveBytes  # noqa: E402
from lowvram.plan.memory.images import tower_forward_bytes  # noqa: E402
from lowvram.plan.model.image_size import sized_vision  # noqa: E402
from lowvram.plan.model.readers import spec_from_config  # noqa: E402
from lowvram.plan.model.vision import VisionSpec  # noqa: E402
from lowvram.plan.setup import RunSetup  # noqa: E402


def _config(tower: str, hidden: int, intermediate: int, deepstack: int):
    from transformers import AutoConfig

    text = AutoConfig.for_model("qwen2" if tower == "qwen2_5_vl" else "qwen3", hidden_size=64, intermediate_size=128,
                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                vocab_size=300, max_position_embeddings=1024)
    patch = 14 if tower == "qwen2_5_vl" else 16
    v = VisionSpec(tower=tower, projector=tower, num_layers=2, hidden_size=hidden, intermediate_size=intermediate,
                   num_heads=2, patch_size=patch, image_size=56, num_channels=3, tokens_per_image=4,
                   text_hidden_size=64, merge_size=2, temporal_patch_size=2,
                   position_embeddings=64 if tower == "qwen3_vl" else 0, deepstack_mergers=deepstack)
    return multimodal_config(text, v, False, image_token_id=299), patch


# (tower, hidden, intermediate, grid side in patches, images, dtype, attention, deepstack mergers, tolerance)
CASES = [
    ("qwen2_5_vl", 64, 128, 16, 1, "float32", "sdpa", 0, 0.002),   # the attention side binds
    ("qwen2_5_vl", 64, 512, 16, 2, "float32", "sdpa", 0, 0.002),   # the gated MLP binds
    ("qwen2_5_vl", 64, 128, 16, 1, "float32", "eager", 0, 0.002),  # window chunks: no full block in 2 layers
    ("qwen2_5_vl", 64, 128, 16, 1, "bfloat16", "sdpa", 0, 0.002),  # the pixels' cast, rope's fp32 copies
    ("qwen2_5_vl", 256, 256, 16, 1, "bfloat16", "sdpa", 0, 0.002),
    ("qwen2_5_vl", 64, 128, 16, 1, "bf16-mixed", "sdpa", 0, 0.002),  # the Conv3d's autocast copies bind
    ("qwen2_5_vl", 256, 512, 8, 1, "bf16-mixed", "sdpa", 0, 0.03),   # the merger's autocast weight copy
    ("qwen3_vl", 64, 128, 16, 1, "float32", "sdpa", 2, 0.03),     # + deepstack features (both counted)
    ("qwen3_vl", 64, 512, 8, 2, "float32", "sdpa", 0, 0.015),
    ("qwen3_vl", 256, 256, 8, 1, "float32", "sdpa", 0, 0.002),
    ("qwen3_vl", 64, 128, 16, 1, "float32", "eager", 0, 0.002),   # one image a chunk: its scores
    ("qwen3_vl", 64, 128, 16, 1, "bfloat16", "sdpa", 1, 0.002),
    ("qwen3_vl", 64, 512, 16, 1, "bf16-mixed", "sdpa", 0, 0.002),
]


@pytest.mark.parametrize("tower, hidden, intermediate, side, images, dtype, attention, deepstack, tolerance", CASES)
def test_tower_forward(tower, hidden, intermediate, side, images, dtype, attention, deepstack, tolerance):
    from transformers import AutoModelForImageTextToText

    cfg, patch = _config(tower, hidden, intermediate, deepstack)
    torch.manual_seed(0)
    mixed = dtype == "bf16-mixed"
    model = AutoModelForImageTextToText.from_config(cfg, attn_implementation=attention)
    model = model.to(torch.float32 if mixed else getattr(torch, dtype))
    model.requires_grad_(False)  # frozen, as lowvram trains it (train.build.vision.freeze_vision)
    grid = torch.tensor([[1, side, side]] * images)
    pixels = torch.randn(images * side * side, 3 * 2 * patch * patch)  # float32, as the image processor makes them
    with LiveBytes() as t:
        t.register(model, pixels, grid)
        before = t.current_bytes
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):  # as the Trainer runs bf16-mixed
            model.model.get_image_features(pixel_values=pixels, image_grid_thw=grid)
        measured = t.peak_bytes - before
    spec = spec_from_config(cfg.to_dict(), "tiny")
    max_pixels = (side * patch) ** 2  # the largest image: side x side patches
    spec = replace(spec, vision=sized_vision(spec.vision, max_pixels, None))
    setup = RunSetup(model=spec, micro_batch_size=images, images_per_row=1, seq_len=128, attention=attention,
                     precision={"float32": "fp32", "bfloat16": "bf16"}.get(dtype, dtype), device="cpu")
    res, lin = {"float32": (4, 4), "bfloat16": (2, 2), "bf16-mixed": (4, 2)}[dtype]
    predicted = tower_forward_bytes(setup, res, lin)
    # tolerance: what is not modelled (autocast's per-call bias copies; the deepstack features
    # counted at every block where the last is made after the last block's peak), never under
    assert -tolerance <= measured / predicted - 1 <= 0.002, (measured, predicted)
