"""Image + text data (format image_chat) in the plan: the images' pixel values in the batch, the
vision encoder's forward as a moment of its own, the image tokens in the language model's
sequence, and Gemma-3's bidirectional mask over them. No torch.

``RunSetup.images_per_row`` is the recipe's data.images_per_row (the most images a row holds;
lowvram.train.data.images refuses a row with more), 0 for text data. The image tokens are part of
the language model's seq_len tokens (a row is cut at seq_len, never inside an image: the same
module refuses that), so the language model's terms are the text plan's at seq_len.

Sources (transformers 5.25):
- pixel values: the processor's image processor resizes every image to the tower's image_size
  (Gemma3ImageProcessor size, CLIPImageProcessor crop_size) and returns float32
  ``(images, 3, image_size, image_size)`` (image_processing_utils BatchFeature); lowvram's
  ImageCollator puts all the micro-batch's images in one tensor, alive through the step (the
  Trainer's inputs dict).
- the frozen tower's forward (modeling_siglip.py, modeling_clip.py): no parameter or input needs a
  gradient, so autograd saves nothing and each layer's temporaries are freed as it goes; the
  embeddings cast the pixels to the patch embedding's dtype (``pixel_values.to(dtype=target_dtype)``).
  Llava asks the tower for every layer's hidden state (LlavaModel.get_image_features,
  ``output_hidden_states=True``), so they are all alive at the tower's last layer; Gemma-3 takes
  only the last one. The projector's output (image features) is scattered into the text
  embeddings (``inputs_embeds.masked_scatter``), which were made before the tower ran, and is
  freed there: the frozen path keeps nothing for the backward.
- Gemma-3 (modeling_gemma3.py Gemma3Model.forward): with token_type_ids (its processor returns them,
  lowvram's ImageCollator passes them) it builds create_masks_for_vision_model's full-attention and
  sliding-window masks, b x 1 x s x s each, so SDPA gets an explicit mask in every layer, as
  packed data does (activations.masked_layers, _checkpointed_mask_bytes).
- Mistral-3's image tokens depend on each image's size (PixtralProcessor resizes to fit
  image_size with the aspect ratio kept, then side x (side + 1) tokens), which the plan does not
  know from the recipe: image data is refused for it with a hint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from lowvram.plan.models import ModelSpec
    from lowvram.plan.setup import RunSetup

# Elements alive in a frozen ViT encoder layer's forward, in units of n x P x h (n images, P
# tokens each, h the tower's width), beside the layer's input: the attention side holds the
# layer norm's output, q, k and v, the attention output and its projection (6); the MLP side the
# norm's output and the output beside fc1's and the activation's n x P x I each (2, + 2 I / h).
# Read off SiglipEncoderLayer / CLIPEncoderLayer forward (modeling_siglip.py, modeling_clip.py).
ATTENTION_SIDE_TENSORS = 6
MLP_SIDE_TENSORS = 2


def image_problems(spec: ModelSpec, images_per_row: int, seq_len: int) -> list[str]:
    """Why image data cannot be planned for this model (each named)."""
    if not images_per_row:
        return []
    v = spec.vision
    if v is None:
        return ["format image_chat needs a model with a vision tower (this model has none)"]
    if v.projector == "mistral3":
        return ["format image_chat with Mistral-3 (Pixtral) is not modelled: its image tokens depend on "
                "each image's size, which the plan does not know"]
    if images_per_row * v.tokens_per_image >= seq_len:
        return [f"data.images_per_row {images_per_row} x {v.tokens_per_image} tokens per image leave no "
                f"room for text in training.seq_len {seq_len}"]
    return []


IMAGE_HINT = ("use a Gemma-3 (4B+) or Llava checkpoint for images, raise training.seq_len, or lower "
              "data.images_per_row")


def bidirectional_image_masks(setup: RunSetup) -> bool:
    """Gemma-3 with images: an explicit b x 1 x s x s mask per attention type, every layer."""
    v = setup.model.vision
    return bool(setup.images_per_row) and v is not None and v.projector == "gemma3"


def images_per_micro_batch(setup: RunSetup) -> int:
    return setup.micro_batch_size * setup.images_per_row


# Batches alive at once: the one trained on and the next, which accelerate's DataLoaderShard
# fetches before yielding the current one (accelerate data_loader.py DataLoaderShard.__iter__,
# to know the last batch); measured: seed 0 of the image draw, full bf16-mixed, two micro-batches'
# pixels beside the plan's one (bench/results/plan_fuzz_images*.txt).
BATCHES_ALIVE = 2


def pixel_bytes(setup: RunSetup) -> int:
    """The pixel values of the micro-batch and of the next one (BATCHES_ALIVE), float32, alive
    through the step."""
    v = setup.model.vision
    if not setup.images_per_row or v is None:
        return 0
    return BATCHES_ALIVE * 4 * images_per_micro_batch(setup) * v.num_channels * v.image_size ** 2


def image_outputs_bytes(setup: RunSetup, tower_bytes: int, text_bytes: int) -> int:
    """What the model's output keeps of the vision forward until the loss is computed: its
    ``image_outputs`` (Gemma3ModelOutputWithPast / LlavaModelOutputWithPast) hold the tower's
    last hidden state (Llava: every layer's, ``hidden_states``) and the projected image features
    (``pooler_output``, in the text embeddings' dtype after the cast for the scatter)."""
    v = setup.model.vision
    n = images_per_micro_batch(setup)
    if not n or v is None:
        return 0
    tokens = v.patches + (1 if v.tower == "clip" else 0)
    states = (v.num_layers + 1) if v.projector == "llava" else 1
    return states * n * tokens * v.hidden_size * tower_bytes + n * v.tokens_per_image * v.text_hidden_size * text_bytes


def scattered_embedding_bytes(setup: RunSetup, text_bytes: int) -> int:
    """LoRA with checkpointing: peft's enable_input_require_grads makes the embedding output a leaf
    that requires grad, and its AccumulateGrad node keeps it alive beside the copy the image
    features are scattered into (``inputs_embeds.masked_scatter``), the first layer's input: one
    more b x s x h. (Full fine-tuning: the embedding's output has a grad_fn, nothing keeps it;
    LoRA without checkpointing: nothing needs its gradient.) Measured: seed 0 of the image draw,
    LoRA fp32 and bf16-mixed with checkpointing."""
    if not setup.images_per_row or not setup.lora or not setup.gradient_checkpointing:
        return 0
    return setup.micro_batch_size * setup.seq_len * setup.model.hidden_size * text_bytes


def encoder_forward_bytes(setup: RunSetup, tower_bytes: int, text_bytes: int) -> int:
    """The largest working set of the frozen vision tower's and projector's forward, beside the
    text embeddings (made first) and the pixels: the pixels' cast copy, the encoder layer's
    temporaries (its input beside the larger of its attention and MLP sides; eager attention: the
    n x heads x P x P scores and their softmax), Llava's kept hidden states, then the projector
    with its output. ``tower_bytes``: bytes per element of the tower's activations (its weights'
    dtype, 16-bit under autocast); ``text_bytes``: the language model's residual stream's."""
    v = setup.model.vision
    n = images_per_micro_batch(setup)
    if not n or v is None:
        return 0
    e = tower_bytes
    tokens = v.patches + (1 if v.tower == "clip" else 0)  # CLIP: + the class token
    npt = n * tokens
    cast = n * v.num_channels * v.image_size ** 2 * e if e != 4 else 0
    side = max(ATTENTION_SIDE_TENSORS * v.hidden_size,
               MLP_SIDE_TENSORS * v.hidden_size + 2 * v.intermediate_size)
    layer = npt * (v.hidden_size + side) * e
    if setup.attention == "eager":
        layer += 2 * n * v.num_heads * tokens * tokens * e
    kept = (v.num_layers + 1) * npt * v.hidden_size * e if v.projector == "llava" else 0
    t = setup.micro_batch_size * setup.seq_len
    embeds = t * setup.model.hidden_size * text_bytes
    # the projector: Llava linear_1, its activation and linear_2 (three n x T x h_text); Gemma-3
    # its pooled, normed and projected outputs (smaller: T is patches / pooling); then the
    # scatter's new embeddings beside the old
    features = n * v.tokens_per_image * v.text_hidden_size * e
    projector = 3 * features + (npt * v.hidden_size * e)
    scatter = features + embeds
    return embeds + max(cast + layer + kept, projector, scatter)
