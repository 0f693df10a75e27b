"""The frozen vision tower's forward (plan/memory/images.py tower_forward_bytes, the moment
vision_encoder_forward) against the live-bytes tracker on tiny Gemma-3 (SigLIP) and Llava (CLIP)
towers: exact, attention- and MLP-bound, 1-4 layers, fp32 and bf16, SDPA and eager."""

import pytest

torch = pytest.importorskip("torch")

from lowvram.check.builders import tiny_vision_config  # noqa: E402
from lowvram.livebytes import LiveBytes  # noqa: E402
from lowvram.plan.memory.images import tower_forward_bytes  # noqa: E402
from lowvram.plan.model.readers import spec_from_config  # noqa: E402
from lowvram.plan.setup import RunSetup  # noqa: E402
from lowvram.testing import build_vision_tokenizer  # noqa: E402


@pytest.mark.parametrize("family", ["gemma3", "llava"])
@pytest.mark.parametrize("layers, hidden, intermediate, attention, dtype", [
    (3, 128, 256, "sdpa", "float32"),   # the attention side binds
    (3, 128, 256, "eager", "float32"),  # + the n x heads x P x P scores
    (1, 64, 512, "sdpa", "float32"),    # the MLP side binds
    (4, 64, 512, "sdpa", "bfloat16"),   # a 16-bit tower: the pixels cast at its embedding
    (3, 128, 256, "sdpa", "bf16-mixed"),  # fp32 weights under autocast: fp32 residual, bf16 Linears
    (3, 64, 512, "sdpa", "bf16-mixed"),
])
def test_tower_forward_is_exact(family, layers, hidden, intermediate, attention, dtype):
    from transformers import AutoModelForImageTextToText

    tok = build_vision_tokenizer(family)
    cfg = tiny_vision_config(family, tok, vision_layers=layers, vision_hidden=hidden, image_size=64, patch_size=8)
    cfg.vision_config.intermediate_size = intermediate
    torch.manual_seed(0)
    mixed = dtype == "bf16-mixed"
    model = AutoModelForImageTextToText.from_config(cfg, attn_implementation=attention)
    model = model.to(torch.float32 if mixed else getattr(torch, dtype))
    model.requires_grad_(False)  # frozen, as lowvram trains it (train.build.vision.freeze_vision)
    images = 4
    pixels = torch.randn(images, 3, 64, 64)  # float32, as the image processor makes them
    with LiveBytes() as t:
        t.register(model, pixels)
        before = t.current_bytes
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):  # as the Trainer runs bf16-mixed
            model.model.get_image_features(pixel_values=pixels)
        measured = t.peak_bytes - before
    setup = RunSetup(model=spec_from_config(cfg.to_dict(), "tiny"), micro_batch_size=images, images_per_row=1,
                     seq_len=128, precision={"float32": "fp32", "bfloat16": "bf16"}.get(dtype, dtype),
                     attention=attention, device="cpu")
    res, lin = {"float32": (4, 4), "bfloat16": (2, 2), "bf16-mixed": (4, 2)}[dtype]
    predicted = tower_forward_bytes(setup, res, lin)
    if mixed:  # + autocast's bf16 copies of a Linear's bias, made per call (512 bytes at h = 128)
        assert 0 <= measured - predicted <= 4 * 2 * cfg.vision_config.hidden_size
    else:
        assert measured == predicted


def test_simulate_keeps_an_image_plans_images():
    """--simulate no longer swaps images for text rows (issue 47 item 5): simulable leaves an image +
    text setup as it is and adds no note (tests/check/test_simulate_images.py runs the step)."""
    from lowvram.check.simulate import simulable

    cfg = tiny_vision_config("llava", build_vision_tokenizer("llava"))
    setup = RunSetup(model=spec_from_config(cfg.to_dict(), "tiny"), images_per_row=2, seq_len=128, device="cpu")
    simulated, notes = simulable(setup)
    assert simulated == setup and simulated.images_per_row == 2
    assert notes == ()
