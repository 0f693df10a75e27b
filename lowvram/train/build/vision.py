"""A multimodal checkpoint's vision side in training: which modules are the tower, the projector
and Mllama's cross-attention layers, the class that loads such a checkpoint, and how they are kept
out of training (frozen, no LoRA adapters, no input gradients through the tower)."""

from __future__ import annotations

# A multimodal checkpoint's vision tower and projector, as transformers 5 names them
# (Gemma3Model, LlavaModel: model.vision_tower, model.multi_modal_projector). They are frozen and
# kept out of bitsandbytes' quantization (lowvram.plan.memory.states.vision_weight_bytes).
VISION_MODULES = ("model.vision_tower", "model.multi_modal_projector",
                  "model.visual",  # Qwen2_5_VLModel: the tower with its merger (the projector)
                  "model.vision_model")  # MllamaModel's tower


def cross_attention_modules(config) -> tuple[str, ...]:
    """Llama-3.2-Vision's cross-attention decoder layers (MllamaTextModel.layers at
    text_config.cross_attention_layers)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else None
    layers = getattr(text, "cross_attention_layers", None) if getattr(config, "model_type", "") == "mllama" else None
    return tuple(f"model.language_model.layers.{i}" for i in layers or ())


def frozen_modules(config, images: bool = False) -> tuple[str, ...]:
    """What training never updates in a multimodal checkpoint: the vision tower and projector,
    and, on text data (``images`` False), Mllama's cross-attention layers. Without images the
    forward skips them (modeling_mllama.py: ``continue`` when there are no cross_attention_states
    and no cache), so they would get no gradient: lowvram freezes them and gives them no LoRA
    adapters (dead adapters, and trainable parameters DDP would wait for), and leaves them in
    bitsandbytes' 4-bit like the other language-model Linears
    (lowvram.plan.memory.states.cross_attention_weight_bytes). With images (format image_chat) they
    are the language model's only path to the image: trained like the self-attention layers (full
    fine-tuning: their weights; LoRA: adapters on the Linears lora.target_modules names, which
    share the self-attention layers' names, q/k/v/o_proj and the MLP's)."""
    return VISION_MODULES + (() if images else cross_attention_modules(config))


def has_vision(config) -> bool:
    """A config (dict or transformers config) with a vision tower: Gemma-3 4B+, Llava."""
    if isinstance(config, dict):
        return "vision_config" in config
    return getattr(config, "vision_config", None) is not None


def model_class(vision: bool):
    """What loads the checkpoint: AutoModelForImageTextToText for a model with a vision tower
    (Llava has no causal-LM class; Gemma-3's is the same Gemma3ForConditionalGeneration)."""
    if vision:
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM


def freeze_vision(model, images: bool = False) -> None:
    """No gradient for the vision tower and projector (full fine-tuning trains the language
    model; text data never reaches the tower), nor for Mllama's cross-attention layers on text."""
    for name in frozen_modules(model.config, images):
        try:
            model.get_submodule(name).requires_grad_(False)
        except AttributeError:
            continue


def text_input_grads_only(model) -> None:
    """transformers' enable_input_require_grads (peft calls it when it wraps a model, and
    checkpointing calls it again for a peft model, in the Trainer's train() too) hooks every
    sub-model's input embeddings, so the vision tower's patch embedding output would require a
    gradient: the frozen tower's whole forward recorded (and checkpointed, and its backward run)
    for no gradient at all (measured: +64% on a Gemma-3 LoRA image run with checkpointing). This
    model's own enable_input_require_grads hooks the language model's embeddings only."""

    def make_inputs_require_grads(module, args, output):
        output.requires_grad_(True)

    def enable_input_require_grads() -> None:
        for hook in getattr(model, "_require_grads_hooks", None) or []:
            hook.remove()
        hook = model.get_input_embeddings().register_forward_hook(make_inputs_require_grads)
        model._require_grads_hooks = [hook]
        model._require_grads_hook = hook

    model.enable_input_require_grads = enable_input_require_grads


def vision_pattern(config, images: bool = False) -> str:
    """peft's exclude_modules (a regex matched in full against each module name) for
    frozen_modules and everything under them."""
    import re

    return "|".join(r"(.*\.)?" + re.escape(name) + r"(\..*)?" for name in frozen_modules(config, images))
