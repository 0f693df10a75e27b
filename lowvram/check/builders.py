"""The model, optimizer and batch of a RunSetup, built with ``lowvram train``'s own builders
(lowvram.train.build.model, the Trainer's create_optimizer) for the measured step (step.py), the
simulator (simulate.py), tests and benches.

torch and friends are imported inside functions (importing lowvram stays instant).
"""

from __future__ import annotations

import os
from pathlib import Path

from lowvram.plan.model.models import ModelSpec
from lowvram.plan.model.vision import VisionSpec


def hf_config(spec: ModelSpec, attention: str = "sdpa"):
    """A transformers config for a ModelSpec of a family the analytic planner models."""
    from transformers import AutoConfig

    kw = dict(
        hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        vocab_size=spec.vocab_size, tie_word_embeddings=spec.tie_word_embeddings,
        max_position_embeddings=spec.max_position_embeddings,
    )
    if spec.rope_theta:
        kw["rope_theta"] = spec.rope_theta
    kw.update(_moe_config_kwargs(spec))
    if spec.sliding_window:  # Gemma-3: its default layer pattern, the spec's window
        kw["sliding_window"] = spec.sliding_window
    from transformers import CONFIG_MAPPING

    if isinstance(getattr(CONFIG_MAPPING[spec.model_type], "head_dim", None), property):
        kw.pop("head_dim")  # derived, not settable (FalconConfig.head_dim: hidden_size // heads)
    cfg = AutoConfig.for_model(spec.model_type, **kw)
    cfg._attn_implementation = attention
    # the spec's dropout, under whichever names this config class uses
    for name, value in (("resid_pdrop", spec.resid_dropout), ("embd_pdrop", spec.embd_dropout),
                        ("attn_pdrop", spec.attn_dropout), ("attention_dropout", spec.attn_dropout)):
        if hasattr(cfg, name):
            setattr(cfg, name, value)
    if spec.vision is None:
        return cfg
    cfg = multimodal_config(text=cfg, v=spec.vision, tie=spec.tie_word_embeddings,
                            cross_attention_layers=spec.cross_attention_layers)
    cfg._attn_implementation = attention
    return cfg


def multimodal_config(text, v: VisionSpec, tie: bool, cross_attention_layers: tuple[int, ...] = (), **extra):
    """The Gemma3Config / Mistral3Config / LlavaConfig / MllamaConfig around the text config
    ``text``, the tower from ``v`` (lowvram.plan.model.vision); ``extra``: more top-level keys (e.g.
    image_token_index); ``cross_attention_layers``: Mllama's (ModelSpec.cross_attention_layers)."""
    from transformers import AutoConfig

    if v.tower == "mllama":
        cfg = AutoConfig.for_model("mllama", text_config=mllama_text(text, cross_attention_layers),
                                   vision_config=mllama_vision(v), **extra)
        cfg.tie_word_embeddings = tie
        return cfg
    vision = dict(hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                  num_hidden_layers=v.num_layers, num_attention_heads=v.num_heads,
                  num_channels=v.num_channels, image_size=v.image_size, patch_size=v.patch_size)
    if v.tower == "pixtral":
        layer = [-1] * v.feature_layers if v.feature_layers > 1 else -1
        cfg = AutoConfig.for_model(
            "mistral3", text_config=text.to_dict(), **extra, spatial_merge_size=v.merge_size,
            multimodal_projector_bias=v.projector_bias, vision_feature_layer=layer,
            vision_config=dict(model_type="pixtral", head_dim=v.hidden_size // v.num_heads, **vision))
    elif v.tower == "qwen2_5_vl":
        cfg = AutoConfig.for_model(
            "qwen2_5_vl", text_config=qwen2_5_vl_text(text), **extra, vision_config=dict(
                depth=v.num_layers, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                num_heads=v.num_heads, in_channels=v.num_channels, patch_size=v.patch_size,
                spatial_merge_size=v.merge_size, temporal_patch_size=v.temporal_patch_size,
                out_hidden_size=v.text_hidden_size))
    elif v.tower == "qwen3_vl":
        layers = list(range(v.deepstack_mergers))  # which tower layers feed them: no parameters
        cfg = AutoConfig.for_model(
            "qwen3_vl", text_config=qwen3_vl_text(text), **extra, vision_config=dict(
                depth=v.num_layers, hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                num_heads=v.num_heads, in_channels=v.num_channels, patch_size=v.patch_size,
                spatial_merge_size=v.merge_size, temporal_patch_size=v.temporal_patch_size,
                out_hidden_size=v.text_hidden_size, num_position_embeddings=v.position_embeddings,
                deepstack_visual_indexes=layers))
    elif v.tower == "siglip":
        cfg = AutoConfig.for_model(
            "gemma3", text_config=text.to_dict(), **extra, mm_tokens_per_image=v.tokens_per_image,
            vision_config=dict(model_type="siglip_vision_model", vision_use_head=v.use_head, **vision))
    else:
        cfg = AutoConfig.for_model(
            "llava", text_config=text.to_dict(), **extra, multimodal_projector_bias=v.projector_bias,
            vision_feature_layer=[-2] * v.feature_layers if v.feature_layers > 1 else -2,
            vision_feature_select_strategy="default" if v.tokens_per_image == v.patches else "full",
            vision_config=dict(model_type="clip_vision_model", **vision))
    cfg.tie_word_embeddings = tie
    return cfg


def tiny_vision_config(family: str, tokenizer, hidden: int = 64, layers: int = 2, vision_layers: int = 1,
                       vision_hidden: int = 32, image_size: int = 32, patch_size: int = 8):
    """A tiny Gemma3Config (SigLIP tower, mm_tokens_per_image a quarter of the patches),
    LlavaConfig (CLIP tower, Llama text), MllamaConfig (its tower of four tiles, one gated global
    layer; Llama text with one cross-attention layer after the first) or Qwen2_5_VLConfig /
    Qwen3VLConfig (their towers, Qwen2 / Qwen3 text) whose image tokens are the tokenizer's."""
    from transformers import AutoConfig

    from lowvram.testing import QWEN_VL_FAMILIES, image_token_config

    text_type = {"gemma3": "gemma3_text", "qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3"}.get(family, "llama")
    text = AutoConfig.for_model(
        text_type, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2,
        vocab_size=len(tokenizer), max_position_embeddings=1024, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    patches = (image_size // patch_size) ** 2
    if family in QWEN_VL_FAMILIES:  # a Qwen-VL tower (the image size is the processor's, per image)
        v = VisionSpec(tower=family, projector=family, num_layers=vision_layers, hidden_size=vision_hidden,
                       intermediate_size=2 * vision_hidden, num_heads=2, patch_size=patch_size,
                       image_size=image_size, num_channels=3, tokens_per_image=max(1, patches // 4),
                       text_hidden_size=hidden, merge_size=2, temporal_patch_size=2,
                       position_embeddings=patches if family == "qwen3_vl" else 0,
                       deepstack_mergers=vision_layers if family == "qwen3_vl" else 0)
        return multimodal_config(text, v, False, **image_token_config(family, tokenizer))
    if family == "mllama":
        v = VisionSpec(tower="mllama", projector="mllama", num_layers=vision_layers, hidden_size=vision_hidden,
                       intermediate_size=2 * vision_hidden, num_heads=2, patch_size=patch_size,
                       image_size=image_size, num_channels=3, tokens_per_image=1, text_hidden_size=hidden,
                       global_layers=1, max_num_tiles=4, aspect_ratios=8, output_dim=2 * vision_hidden)
        return multimodal_config(text, v, False, cross_attention_layers=(1,), **image_token_config(family, tokenizer))
    v = VisionSpec(tower="siglip" if family == "gemma3" else "clip", projector=family, num_layers=vision_layers,
                   hidden_size=vision_hidden, intermediate_size=2 * vision_hidden, num_heads=2,
                   patch_size=patch_size, image_size=image_size, num_channels=3,
                   tokens_per_image=max(1, patches // 4) if family == "gemma3" else patches,
                   text_hidden_size=hidden)
    return multimodal_config(text, v, family == "gemma3", **image_token_config(family, tokenizer))


def save_tiny_vision_model(out_dir: str | Path, family: str = "gemma3", seed: int = 0, **config_kwargs) -> Path:
    """A random-init tiny multimodal model (``family`` gemma3 or llava), its tokenizer and its
    processor (build_processor) as a from_pretrained / AutoProcessor folder."""
    import torch
    from transformers import AutoModelForImageTextToText

    from lowvram.testing import build_processor, build_vision_tokenizer

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_vision_tokenizer(family)
    config = tiny_vision_config(family, tokenizer, **config_kwargs)
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(config).save_pretrained(out)
    build_processor(config, tokenizer).save_pretrained(out)
    return out


def qwen3_vl_text(text) -> dict:
    """A Qwen3 text config as Qwen3-VL's text_config (Qwen3VLTextConfig): its interleaved M-RoPE
    sections split head_dim / 2 as Qwen3-VL's published [24, 20, 20] splits 64 (Qwen3VLTextRotary
    Embedding interleaves height and width into every third frequency, the rest is time)."""
    t = text.to_dict()
    half = t["head_dim"] // 2
    height = half * 20 // 64
    rope = dict(t.get("rope_parameters") or {"rope_theta": 5_000_000.0})
    rope.update(rope_type="default", mrope_interleaved=True,
                mrope_section=[half - 2 * height, height, height])
    t.update(model_type="qwen3_vl_text", rope_parameters=rope, attention_bias=False)
    return t


def mllama_text(text, cross_attention_layers: tuple[int, ...]) -> dict:
    """A Llama text config (the self-attention layers) as Mllama's text_config (MllamaTextConfig):
    the cross-attention layers added at their indices."""
    t = text.to_dict()
    if t.get("bos_token_id") is None:  # MllamaTextConfig's bos_token_id is an int (128000)
        t.pop("bos_token_id", None)
    t.setdefault("pad_token_id", None)  # not MllamaTextConfig's 128004, beyond a small vocabulary
    t.update(model_type="mllama_text_model", cross_attention_layers=list(cross_attention_layers),
             num_hidden_layers=t["num_hidden_layers"] + len(cross_attention_layers))
    return t


def mllama_vision(v: VisionSpec) -> dict:
    """MllamaVisionConfig's keys for ``v``: the supported aspect ratios every tile layout of at
    most max_num_tiles tiles (the image processor's get_all_supported_aspect_ratios order, which
    gives the published default list for 4 tiles); the intermediate layers the projector's input
    concatenates, as many as output_dim asks (vision_output_dim = h x (1 + their count))."""
    tiles = v.max_num_tiles
    ratios = [[w, h] for w in range(1, tiles + 1) for h in range(1, tiles + 1) if w * h <= tiles]
    if len(ratios) != v.aspect_ratios:
        raise ValueError(f"{v.aspect_ratios} aspect ratios for {tiles} tiles: not the processor's layouts")
    extra = v.output_dim // v.hidden_size - 1
    return dict(hidden_size=v.hidden_size, intermediate_size=v.intermediate_size,
                num_hidden_layers=v.num_layers, num_global_layers=v.global_layers,
                attention_heads=v.num_heads, num_channels=v.num_channels, image_size=v.image_size,
                patch_size=v.patch_size, max_num_tiles=tiles, supported_aspect_ratios=ratios,
                vision_output_dim=v.output_dim,
                intermediate_layers_indices=[i % v.num_layers for i in range(extra)])


def qwen2_5_vl_text(text) -> dict:
    """A Qwen2 text config as Qwen2.5-VL's text_config (Qwen2_5_VLTextConfig): its M-RoPE
    sections split head_dim / 2 as Qwen2.5-VL's published [16, 24, 24] splits 64 (a quarter for
    time, the rest halved between height and width; Qwen2_5_VLRotaryEmbedding needs them to sum
    to head_dim / 2)."""
    t = text.to_dict()
    half = t["hidden_size"] // t["num_attention_heads"] // 2
    time = half // 4
    height = (half - time) // 2
    rope = dict(t.get("rope_parameters") or {"rope_theta": 1_000_000.0})
    rope.update(rope_type="default", mrope_section=[time, height, half - time - height])
    t.update(model_type="qwen2_5_vl_text", rope_parameters=rope)
    return t


def _moe_config_kwargs(spec: ModelSpec) -> dict:
    """The MoE fields of a spec under its config class's names (see lowvram.plan.model.readers._MOE_ARCH)."""
    if not spec.is_moe:
        return {}
    if spec.model_type in ("mixtral", "olmoe", "gpt_oss"):
        return dict(num_local_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                    intermediate_size=spec.moe_intermediate_size)
    kw = dict(num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
              moe_intermediate_size=spec.moe_intermediate_size, mlp_only_layers=[],
              decoder_sparse_step=1)
    if spec.model_type == "qwen2_moe":
        kw.update(shared_expert_intermediate_size=spec.shared_expert_intermediate_size,
                  qkv_bias=spec.qkv_bias)
    return kw


def setup_plan(setup, device: str = "cpu"):
    """The Plan ``lowvram train`` runs a RunSetup with: what train's builders read (alpha 2r)."""
    from lowvram.plan.choose.search import plan_for_setup

    return plan_for_setup(setup, device, 2 * setup.lora_r)


def build_model(setup, workdir: str | None = None, seed: int = 0, device: str = "cpu",
                saved_dir: str | None = None, in_memory: bool = False):
    """The model a RunSetup trains, random init, on ``device``, loaded and prepared by the
    functions ``lowvram train`` uses (lowvram.train.build.model: ``load_kwargs`` for dtype, attention
    and bitsandbytes, ``prepare_model`` for k-bit preparation, adapters and checkpointing).

    Unquantized models are built from their config on ``device`` directly (what
    ``from_pretrained`` of a random checkpoint gives, without writing one: a 7B model on a GPU
    in seconds). Quantized ones go through ``from_pretrained`` (bitsandbytes quantizes while
    loading) from a random-init checkpoint: saved to ``saved_dir`` once and reused when it
    already holds one, else to a temporary folder; or, ``in_memory``, from the random model's
    state dict on ``device`` (from_pretrained's ``state_dict=``, the same quantizing load with no
    file written: bench/gpu_check.py, whose machine has 64 GiB of disk).
    """
    import tempfile

    import torch

    from lowvram.train.build.model import load_kwargs, model_class, prepare_model

    torch.manual_seed(seed)
    plan = setup_plan(setup, device)
    vision = setup.model.vision is not None
    kwargs = load_kwargs(plan, vision)
    cfg = hf_config(setup.model, setup.attention)
    cls = model_class(vision)
    if setup.quantization == "none":
        with torch.device(device):
            model = cls.from_config(cfg, dtype=kwargs["dtype"])
        return prepare_model(model, plan, seed)

    def load(d):
        if not os.path.exists(os.path.join(d, "config.json")):
            with torch.device(device):
                cls.from_config(cfg, dtype=kwargs["dtype"]).save_pretrained(d)
        return cls.from_pretrained(d, **kwargs)

    if in_memory:
        with torch.device(device):
            state = cls.from_config(cfg, dtype=kwargs["dtype"]).state_dict()
        model = _load_state(cls, cfg, state, kwargs)
        del state
    elif saved_dir is not None:
        model = load(saved_dir)
    else:
        with tempfile.TemporaryDirectory(dir=workdir) as d:
            model = load(d)
    return prepare_model(model, plan, seed)


def _load_state(cls, cfg, state: dict, kwargs: dict):
    """from_pretrained of an in-memory state dict (transformers 5: no folder, ``state_dict=``);
    the auto classes want a name, so the config's own model class loads it."""
    model_cls = cls._model_mapping[type(cfg)] if hasattr(cls, "_model_mapping") else cls
    return model_cls.from_pretrained(None, config=cfg, state_dict=state, **kwargs)


class _OptimizerOf:
    """What ``transformers.Trainer.create_optimizer`` reads of its Trainer: that method builds
    the optimizer here, so the optimizer measured is the one a run gets (param groups, the
    8-bit embedding override, fused AdamW), also on fake tensors where no Trainer can be made."""

    optimizer = None
    optimizer_cls_and_kwargs = None

    def __init__(self, model, args) -> None:
        from transformers import Trainer

        self.model, self.args = model, args
        self.get_decay_parameter_names = Trainer.get_decay_parameter_names.__get__(self)
        self.get_optimizer_cls_and_kwargs = Trainer.get_optimizer_cls_and_kwargs


def build_optimizer(model, name: str, lr: float = 1e-4):
    """The optimizer ``lowvram train`` makes for the plan optimizer ``name``: the Trainer's own
    ``create_optimizer`` over ``lowvram.vocab.TRAINER_OPTIMIZERS`` (adamw -> adamw_torch_fused)."""
    import tempfile

    from transformers import Trainer, TrainingArguments

    from lowvram.vocab import FUSED_BACKWARD_OPTIMIZERS, TRAINER_OPTIMIZERS

    device = next(model.parameters()).device.type
    args = TrainingArguments(output_dir=tempfile.gettempdir(), optim=TRAINER_OPTIMIZERS[name], learning_rate=lr,
                             report_to=[], use_cpu=device == "cpu")
    if name in FUSED_BACKWARD_OPTIMIZERS:  # the per-parameter optimizers and their hooks (train.in_backward)
        from lowvram.train.build.in_backward import install_optimizer_in_backward

        return install_optimizer_in_backward(_OptimizerOf(model, args), model)
    return Trainer.create_optimizer(_OptimizerOf(model, args))


def make_batch(setup, seed: int = 0, device: str = "cpu") -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, setup.model.vocab_size, (setup.micro_batch_size, setup.seq_len), generator=g)
    batch = {"input_ids": ids.to(device), "labels": ids.to(device)}
    if setup.packing:
        # data.packing: four samples to a window, position_ids restarting at each (as
        # lowvram.train.data.collate.pack makes them), so transformers builds the packed mask
        positions = torch.arange(setup.seq_len) % max(1, setup.seq_len // 4)
        batch["position_ids"] = positions.expand(setup.micro_batch_size, -1).to(device)
        if setup.attention == "flash_attention_2":  # the collator's varlen kwargs (collate.py)
            from lowvram.train.data.collate import flash_varlen_kwargs

            batch.update(flash_varlen_kwargs(batch["position_ids"]))
    return batch


def autocast_dtype(setup):
    """The dtype the Trainer's autocast uses for a setup's precision (None for fp32; the rule is
    train/build/model.py's)."""
    from lowvram.train.build.model import autocast_dtype as for_precision

    return for_precision(setup.precision)


def write_one_image_rows(root: str | Path, size: tuple[int, int], rows: int) -> Path:
    """A tiny Qwen2.5-VL (patches of 14 px) in ``root/model`` and ``root/big.jsonl``: ``rows`` rows,
    each the same ``size`` (width, height) image of one colour, a question and a short answer, for
    runs whose peak the image's pixels decide. Returns ``root``."""
    import json

    from PIL import Image

    root = Path(root)
    save_tiny_vision_model(root / "model", "qwen2_5_vl", patch_size=14)
    (root / "images").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, (40, 100, 200)).save(root / "images" / "big.png")
    row = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]},
                        {"role": "assistant", "content": "A big thing. " * 5}], "images": ["images/big.png"]}
    (root / "big.jsonl").write_text((json.dumps(row) + "\n") * rows)
    return root
