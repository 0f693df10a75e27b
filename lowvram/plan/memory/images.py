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
  Llava's tower returns every layer's hidden state (LlavaModel.get_image_features reads
  ``hidden_states[vision_feature_layer]``), alive beside its projector; Gemma-3's only the last
  one. The projector's output (image features) is scattered into the text
  embeddings (``inputs_embeds.masked_scatter``), which were made before the tower ran, and is
  freed there: the frozen path keeps nothing for the backward.
- Gemma-3 (modeling_gemma3.py Gemma3Model.forward): with token_type_ids (its processor returns them,
  lowvram's ImageCollator passes them) it builds create_masks_for_vision_model's full-attention and
  sliding-window masks, b x 1 x s x s each, so SDPA gets an explicit mask in every layer, as
  packed data does (activations.masked_layers, _checkpointed_mask_bytes).
- Mistral-3's image tokens depend on each image's size (PixtralProcessor resizes to fit
  image_size with the aspect ratio kept, then side x (side + 1) tokens), which the plan does not
  know from the recipe: image data is refused for it with a hint.
- Qwen2.5-VL and Qwen3-VL (dynamic resolution): Qwen2VLImageProcessor resizes each image to a
  multiple of patch * merge within min/max_pixels, so the plan sizes the largest image from
  data.max_pixels (plan/model/image_size.py: PlanRequest sizes model.vision's tokens_per_image);
  their pixel values are one row per patch, and the tower's forward is qwen_tower.py's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lowvram.plan import constants as fitted
from lowvram.plan.memory.qwen_tower import qwen_tower_forward_bytes
from lowvram.plan.model.image_size import pixel_values_bytes
from lowvram.plan.model.vision import QWEN_VL_TOWERS

if TYPE_CHECKING:
    from lowvram.plan.model.models import ModelSpec
    from lowvram.plan.setup import RunSetup

# What a frozen ViT encoder layer's forward holds beside the hidden states kept before it, in
# tensors of n x P x h (n images, P tokens each, h the tower's width), per tower: on the attention
# side the layer norm's output, q, k, v, SDPA's output and its contiguous reshape, the output
# projection (SigLIP 6 alive at once, CLIP 7); on the MLP side the attention block's output (the
# residual) and the norm's output (2) beside the activation's n x P x I tensors (SigLIP's
# gelu_pytorch_tanh: fc1's output and the activation's, 2; CLIP's quick_gelu, x * sigmoid(1.702 x):
# 3). Read off modeling_siglip.py / modeling_clip.py (no tensor is saved without a gradient; each is
# freed when its Python name is) and measured exactly with the live-bytes tracker on 1-3 layer
# towers, fp32 and bf16, SDPA and eager (tests/plan/test_images.py).
ATTENTION_SIDE_TENSORS = {"siglip": 6, "clip": 7}
MLP_SIDE_TENSORS = 2
ACTIVATION_TENSORS = {"siglip": 2, "clip": 3}


def image_problems(spec: ModelSpec, images_per_row: int, seq_len: int, attention: str = "sdpa") -> list[str]:
    """Why image data cannot be planned for this model (each named)."""
    if not images_per_row:
        return []
    v = spec.vision
    if v is None:
        return ["format image_chat needs a model with a vision tower (this model has none)"]
    if v.projector == "mistral3":
        return ["format image_chat with Mistral-3 (Pixtral) is not modelled: its image tokens depend on "
                "each image's size, which the plan does not know"]
    if v.projector == "mllama" and attention == "eager":
        # eager attention's scores over the vision tokens (b x heads x s x V) in every cross layer
        return ["attention eager with Llama-3.2-Vision images is not modelled (its cross-attention "
                "layers' scores over the tiles are not counted)"]
    if images_per_row * v.tokens_per_image >= seq_len:
        sized = " (the largest image data.max_pixels allows)" if v.tower in QWEN_VL_TOWERS else ""
        return [f"data.images_per_row {images_per_row} x {v.tokens_per_image} tokens per image{sized} leave no "
                f"room for text in training.seq_len {seq_len}"]
    return []


IMAGE_HINT = ("use a Gemma-3 (4B+), Llava, Llama-3.2-Vision (attention sdpa), Qwen2.5-VL or Qwen3-VL checkpoint "
              "for images (or train this one on text: format chat, completion or text), raise training.seq_len, "
              "lower data.images_per_row, or (Qwen-VL) lower data.max_pixels")


def bidirectional_image_masks(setup: RunSetup) -> bool:
    """Gemma-3 with images: an explicit b x 1 x s x s mask per attention type, every layer."""
    v = setup.model.vision
    return bool(setup.images_per_row) and v is not None and v.projector == "gemma3"


def images_per_micro_batch(setup: RunSetup) -> int:
    return setup.micro_batch_size * setup.images_per_row


# Batches alive at once through a step: the step's micro-batches, which the Trainer fetches all
# before the first (transformers trainer.py get_batch_samples: ``batch_samples`` holds grad_accum
# of them through the step), and the next one, which accelerate's DataLoaderShard fetches before
# yielding the current one (constants.PREFETCHED_BATCHES); measured: seed 0 of the image draw,
# full bf16-mixed, two micro-batches' pixels beside the plan's one
# (bench/results/plan_fuzz_images*.txt), mllama image seed 1 (b1 x 2 accumulation, full bf16):
# three micro-batches' tiles (+2.81% over a plan with two), and in-sample Qwen2.5-VL image seeds 1,
# 3, 4 (accumulation 2: one fp32 micro-batch of pixel values more than a plan of two, at every
# precision, with or without checkpointing).
def batches_alive(setup: RunSetup) -> int:
    return setup.grad_accum + fitted.PREFETCHED_BATCHES.value


def batches_between_steps(setup: RunSetup) -> int:
    """Batches alive while the Trainer fetches the next step's (constants.STEP_BATCH_LISTS): the
    step before's grad_accum micro-batches (its ``batch_samples``, rebound only when
    get_batch_samples returns), the next step's grad_accum, and the one prefetched after them."""
    return fitted.STEP_BATCH_LISTS.value * setup.grad_accum + fitted.PREFETCHED_BATCHES.value


def micro_batch_pixel_bytes(setup: RunSetup) -> int:
    """One micro-batch's float32 pixel values (a Qwen-VL image: one row of channels x
    temporal_patch_size x patch^2 per patch of the largest image, image_size.pixel_values_bytes);
    Llama-3.2-Vision's every image padded to max_num_tiles tiles (plan/memory/cross_attention.py)."""
    v = setup.model.vision
    if not setup.images_per_row or v is None:
        return 0
    tiles = v.max_num_tiles if v.tower == "mllama" else 1
    return images_per_micro_batch(setup) * tiles * pixel_values_bytes(v)


def cross_mask_bytes(setup: RunSetup) -> int:
    """Llama-3.2-Vision: one micro-batch's int64 cross_attention_mask, b x s x images x T
    (lowvram.train.data.images.ImageCollator, MllamaProcessor's
    convert_sparse_cross_attention_mask_to_dense); 0 for the other families."""
    v = setup.model.vision
    if not setup.images_per_row or v is None or v.tower != "mllama":
        return 0
    return 8 * setup.micro_batch_size * setup.seq_len * setup.images_per_row * v.max_num_tiles


def pixel_bytes(setup: RunSetup) -> int:
    """The pixel values of the step's micro-batches and of the next one (batches_alive), alive
    through the step."""
    return batches_alive(setup) * micro_batch_pixel_bytes(setup)


def text_embedding_bytes(setup: RunSetup, text_bytes: int) -> int:
    """The text embeddings (b x s x h), made before the vision tower runs."""
    return setup.micro_batch_size * setup.seq_len * setup.model.hidden_size * text_bytes


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


def tower_forward_bytes(setup: RunSetup, res_bytes: int, lin_bytes: int) -> int:
    """The largest working set of the frozen vision tower's and projector's forward beyond the
    weights and the pixels: the pixels' cast copy (a 16-bit tower), the last encoder layer's
    temporaries beside the hidden states kept before it (the larger of the attention and MLP
    sides; eager attention: the n x heads x P x P scores); then the projector beside what the
    tower returned, with its two largest outputs (n x T x h_text). ``res_bytes``: bytes per
    element of the tower's residual stream and layer norms (its weights' dtype: autocast runs
    layer_norm in fp32); ``lin_bytes``: of its Linear outputs (16-bit under autocast)."""
    v = setup.model.vision
    n = images_per_micro_batch(setup)
    if not n or v is None:
        return 0
    if v.tower in QWEN_VL_TOWERS:
        return qwen_tower_forward_bytes(setup, res_bytes, lin_bytes)
    tokens = v.patches + (1 if v.tower == "clip" else 0)  # CLIP: + the class token
    state = n * tokens * v.hidden_size  # elements of one hidden state of the tower
    unit = state * res_bytes
    # the patch embedding: the pixels cast to the convolution's dtype beside its output
    embedding = (n * v.num_channels * v.image_size ** 2 * lin_bytes if lin_bytes != 4 else 0) + 2 * unit
    attention = unit + (ATTENTION_SIDE_TENSORS[v.tower] - 1) * state * lin_bytes  # the norm's, then Linears'
    mlp = MLP_SIDE_TENSORS * unit + ACTIVATION_TENSORS[v.tower] * n * tokens * v.intermediate_size * lin_bytes
    side = max(attention, mlp)
    if setup.attention == "eager":  # the scores, softmaxed in place of the product
        side += n * v.num_heads * tokens * tokens * res_bytes
    llava = v.projector == "llava"
    # kept before the last layer: the encoder's input (its caller's name) and the layer's input
    before = min(v.num_layers, 2)
    returned = (v.num_layers + 1) if llava else 1  # Llava asks for every hidden state
    features = n * v.tokens_per_image * v.text_hidden_size * lin_bytes
    return max(embedding, before * unit + side, returned * unit + 2 * features)


def encoder_forward_bytes(setup: RunSetup, res_bytes: int, lin_bytes: int, text_bytes: int) -> int:
    """The vision moment's working set: the text embeddings (made before the tower runs) beside
    the tower's forward (tower_forward_bytes), or beside the image features and the new
    embeddings the scatter makes. ``text_bytes``: the language model's residual stream's."""
    v = setup.model.vision
    n = images_per_micro_batch(setup)
    if not n or v is None:
        return 0
    embeds = setup.micro_batch_size * setup.seq_len * setup.model.hidden_size * text_bytes
    features = n * v.tokens_per_image * v.text_hidden_size * lin_bytes
    return embeds + max(tower_forward_bytes(setup, res_bytes, lin_bytes), features + embeds)
