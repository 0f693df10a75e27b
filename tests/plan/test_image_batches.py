"""The Trainer's image batches in the plan: between two optimizer steps, 2 x grad_accum + 1
micro-batches' pixel values beside the weights and the optimizer state (the moment
next_step_batches, plan/memory/image_moment.py), grad_accum + 1 through the step. Measured through
`lowvram train`: tests/train/test_accumulation_batches.py."""

from dataclasses import replace

import pytest

pytest.importorskip("transformers")

from lowvram.check.builders import tiny_vision_config  # noqa: E402
from lowvram.plan.memory.floor import model_states  # noqa: E402
from lowvram.plan.memory.image_moment import between_steps_bytes, step_kept_bytes  # noqa: E402
from lowvram.plan.memory.images import batches_between_steps, micro_batch_pixel_bytes  # noqa: E402
from lowvram.plan.memory.memory import estimate_memory  # noqa: E402
from lowvram.plan.model.readers import spec_from_config  # noqa: E402
from lowvram.plan.setup import RunSetup  # noqa: E402
from lowvram.testing import build_vision_tokenizer  # noqa: E402


def _setup(family: str, micro: int, accumulation: int, seq_len: int = 480, **kw) -> RunSetup:
    cfg = tiny_vision_config(family, build_vision_tokenizer(family), **kw)
    spec = spec_from_config(cfg.to_dict(), "tiny")
    if family == "qwen2_5_vl":  # a 640 x 480 image at patch 14: 391 tokens, 1564 patches
        spec = replace(spec, vision=replace(spec.vision, tokens_per_image=391))
    # seq_len 480: the image and a short answer (the run's rows are 457 tokens)
    return RunSetup(model=spec, images_per_row=1, micro_batch_size=micro, grad_accum=accumulation, seq_len=seq_len,
                    precision="fp32", optimizer="adamw", device="cpu")


def test_between_steps_holds_two_steps_of_micro_batches_and_the_prefetched_one():
    s = _setup("qwen2_5_vl", 1, 1, patch_size=14)
    assert [batches_between_steps(replace(s, grad_accum=n)) for n in (1, 2, 4)] == [3, 5, 9]


@pytest.mark.parametrize("accumulation, batches", [(2, 5), (4, 9)])
def test_with_large_images_and_accumulation_the_moment_between_steps_binds(accumulation, batches):
    s = _setup("qwen2_5_vl", 1, accumulation, patch_size=14)
    assert micro_batch_pixel_bytes(s) == 1564 * 3 * 2 * 14 * 14 * 4  # one row of C x T x P^2 per patch
    est = estimate_memory(s)
    assert (est.peak_phase, est.peak_moment) == ("between_steps", "next_step_batches")
    st = model_states(s)
    b = est.breakdown
    # no gradient (zero_grad set them to None), no activation: weights, optimizer state, the pixels
    assert (b["weights"], b["optimizer"], b["gradients"], b["logits"]) == (st.weights, st.optimizer, 0, 0)
    assert b["activations"] == batches * micro_batch_pixel_bytes(s) == between_steps_bytes(s)
    assert est.peak_bytes == st.weights + st.optimizer + batches * micro_batch_pixel_bytes(s)


def test_the_optimizer_step_holds_the_steps_micro_batches_and_the_next():
    s = _setup("qwen2_5_vl", 1, 2, patch_size=14)
    assert step_kept_bytes(s) == 3 * micro_batch_pixel_bytes(s)
    assert step_kept_bytes(replace(s, images_per_row=0)) == between_steps_bytes(replace(s, images_per_row=0)) == 0


def test_llama_vision_counts_its_tiles_and_cross_attention_masks_per_micro_batch():
    s = _setup("mllama", 1, 2, image_size=448, patch_size=32)
    from lowvram.plan.memory import cross_attention

    s = cross_attention.active_setup(s)
    tiles = 4 * 3 * 448 * 448 * 4  # every image padded to max_num_tiles float32 tiles
    mask = 8 * 480 * 1 * 4  # int64 b x s x images x tiles
    assert micro_batch_pixel_bytes(s) == tiles
    assert between_steps_bytes(s) == 5 * (tiles + mask) + cross_attention.cross_params_left_bytes(s, 4)
    assert estimate_memory(s).peak_moment == "next_step_batches"
