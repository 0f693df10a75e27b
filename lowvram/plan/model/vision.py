"""The vision tower and projector of a multimodal config (VisionSpec) and their exact
parameter counts (no torch); read from a config.json's ``vision_config`` per family.

Sources (transformers 5):
- SigLIP tower (Gemma-3's ``siglip_vision_model``), modeling_siglip.py: SiglipVisionEmbeddings
  (patch_embedding Conv2d(3, h, patch, patch) with bias; position_embedding
  Embedding((image_size/patch)^2, h)), SiglipEncoderLayer (layer_norm1/2 LayerNorm(h);
  q/k/v/out_proj Linear(h, h) with bias; mlp fc1 Linear(h, I), fc2 Linear(I, h) with bias),
  post_layernorm LayerNorm(h); SiglipMultiheadAttentionPoolingHead when vision_use_head
  (SiglipVisionConfig default True; Gemma-3's config.json sets it false).
- CLIP tower (Llava's ``clip_vision_model``), modeling_clip.py: CLIPVisionEmbeddings
  (class_embedding [h]; patch_embedding Conv2d without bias; position_embedding
  Embedding(patches + 1, h)), pre_layrnorm and post_layernorm LayerNorm(h), the same encoder
  layer as SigLIP.
- Gemma3MultiModalProjector (modeling_gemma3.py): mm_input_projection_weight [h_vision, h_text]
  and mm_soft_emb_norm Gemma3RMSNorm(h_vision); AvgPool2d (no parameters) down to
  mm_tokens_per_image (Gemma3Config default 256) tokens per image.
- LlavaMultiModalProjector (modeling_llava.py): linear_1 Linear(h_vision * feature layers,
  h_text), linear_2 Linear(h_text, h_text), both with multimodal_projector_bias (LlavaConfig
  default True). Image tokens: (image_size/patch)^2, minus the CLS token under
  vision_feature_select_strategy "default" (which drops it; "full" keeps it: +1).
- Pixtral tower (Mistral-3's ``pixtral``), modeling_pixtral.py: patch_conv Conv2d(c, h, patch,
  patch) without bias, ln_pre RMSNorm(h), PixtralAttentionLayer (attention_norm / ffn_norm
  RMSNorm(h); q/k/v/o_proj Linear(h, h) without bias; a gated MLP gate/up Linear(h, I), down
  Linear(I, h) without bias), 2-D rotary positions (no parameters), no final norm.
- Mistral3MultiModalProjector (modeling_mistral3.py): norm RMSNorm(h_vision), patch_merger
  merging_layer Linear(h_vision * merge^2, h_vision) without bias, linear_1 Linear(h_vision *
  feature layers, h_text) and linear_2 Linear(h_text, h_text) with multimodal_projector_bias
  (Mistral3Config default False). Image tokens of the largest image (image_size): side =
  image_size / patch / spatial_merge_size merged patches a side, plus one [IMG_BREAK] per row
  (the last row's is [IMG_END]): side x (side + 1) (PixtralProcessor).
- Qwen2.5-VL tower (``qwen2_5_vl``), modeling_qwen2_5_vl.py Qwen2_5_VisionTransformerPretrainedModel
  (model.visual): patch_embed Conv3d(c, h, (temporal_patch_size, patch, patch)) without bias;
  rotary_pos_emb (axial 2-D rope: buffers inv_freq and original_inv_freq, fp32, head_dim / 4
  each); Qwen2_5_VLVisionBlock (norm1 / norm2 RMSNorm(h); attn qkv Linear(h, 3h) and proj
  Linear(h, h) with bias; a gated MLP gate/up Linear(h, I), down Linear(I, h) with bias), window
  attention in all blocks but fullatt_block_indexes (no parameters); no final norm.
- Qwen2_5_VLPatchMerger (model.visual.merger, the projector): ln_q RMSNorm(h), mlp Linear(h m^2,
  h m^2) and Linear(h m^2, out_hidden_size) with bias (m = spatial_merge_size). Image tokens of
  the largest image: the image processor's default max_pixels 28 * 28 * 1280
  (image_processing_qwen2_vl.py) over (patch * m)^2 pixels a token: 1280.
- Qwen3-VL tower (``qwen3_vl``), modeling_qwen3_vl.py Qwen3VLVisionModel (model.visual):
  patch_embed Conv3d(c, h, (temporal_patch_size, patch, patch)) with bias; pos_embed
  Embedding(num_position_embeddings, h) (a learned grid, bilinearly resampled per image);
  rotary_pos_emb (axial 2-D rope: inv_freq and original_inv_freq, fp32,
  arange(0, head_dim / 2, 2) each; Qwen3VLVisionRotaryEmbedding); Qwen3VLVisionBlock (norm1 /
  norm2 LayerNorm(h); attn qkv Linear(h, 3h) and proj Linear(h, h) with bias; a plain MLP
  linear_fc1 Linear(h, I), linear_fc2 Linear(I, h) with bias); no final norm.
- Qwen3VLVisionPatchMerger (the projector): model.visual.merger (norm LayerNorm(h), linear_fc1
  Linear(h m^2, h m^2), linear_fc2 Linear(h m^2, out_hidden_size), biased) and one deepstack
  merger per deepstack_visual_indexes entry (model.visual.deepstack_merger_list: the same with
  its norm LayerNorm(h m^2) after the shuffle), all projecting into the text width. Their
  features are added to the first language layers' hidden states only when there are images
  (Qwen3VLTextModel._deepstack_process); on text the language model is Qwen3's block. Image
  tokens of the largest image: Qwen2VLImageProcessor's default max_pixels over (patch * m)^2.
- Llama-3.2-Vision tower (``mllama``), modeling_mllama.py MllamaVisionModel (model.vision_model):
  patch_embedding Conv2d(c, h, p) without bias; class_embedding [h]; gated_positional_embedding
  (gate [1], embedding [P + 1, h], tile_embedding Embedding(A + 1, T (P + 1) h)); pre- and
  post_tile_positional_embedding (Embedding(A + 1, T h) and a gate [1] each); layernorm_pre and
  layernorm_post LayerNorm(h); a local ``transformer`` of num_hidden_layers and a
  ``global_transformer`` of num_global_layers MllamaVisionEncoderLayers (LayerNorms, q/k/v/o
  without bias, fc1/fc2 with bias; the global ones gated: gate_attn, gate_ffn [1] each); no
  buffers. P patches a tile, T = max_num_tiles, A = len(supported_aspect_ratios).
  multi_modal_projector Linear(vision_output_dim, h_text) with bias (MllamaModel). Its images
  reach the language model through the cross-attention layers (lowvram.plan.model.models
  ModelSpec.cross_attention_layers), one <|image|> token in the sequence (with images:
  plan/memory/cross_attention.py).
Defaults left out of config.json: SiglipVisionConfig / CLIPVisionConfig class defaults
(configuration_siglip.py, configuration_clip.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from lowvram.errors import ModelError

# configuration_siglip.py SiglipVisionConfig / configuration_clip.py CLIPVisionConfig defaults
_TOWER_DEFAULTS = {
    "siglip": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                   num_attention_heads=12, num_channels=3, image_size=224, patch_size=16,
                   vision_use_head=True),
    "clip": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                 num_attention_heads=12, num_channels=3, image_size=224, patch_size=32,
                 vision_use_head=False),
    # configuration_pixtral.py PixtralVisionConfig
    "pixtral": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                    num_attention_heads=16, num_channels=3, image_size=1024, patch_size=16,
                    vision_use_head=False),
    # configuration_qwen2_5_vl.py Qwen2_5_VLVisionConfig (depth, num_heads, in_channels)
    # configuration_mllama.py MllamaVisionConfig (attention_heads; 8 supported aspect ratios)
    "mllama": dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
                   num_global_layers=8, attention_heads=16, num_channels=3, image_size=448,
                   patch_size=14, max_num_tiles=4, vision_output_dim=7680, vision_use_head=False,
                   supported_aspect_ratios=[[1, 1], [1, 2], [1, 3], [1, 4], [2, 1], [2, 2], [3, 1], [4, 1]]),
    "qwen2_5_vl": dict(depth=32, hidden_size=3584, intermediate_size=3420, num_heads=16,
                       in_channels=3, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                       vision_use_head=False),
    # configuration_qwen3_vl.py Qwen3VLVisionConfig
    "qwen3_vl": dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, in_channels=3,
                     patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                     num_position_embeddings=2304, deepstack_visual_indexes=[8, 16, 24],
                     vision_use_head=False),
}
# Qwen2VLImageProcessor's default longest_edge (max_pixels): 28 * 28 * 1280 pixels an image
_QWEN_MAX_PIXELS = 28 * 28 * 1280
# multimodal model_type -> (tower kind, projector kind)
VISION_FAMILIES = {"gemma3": ("siglip", "gemma3"), "llava": ("clip", "llava"),
                   "mistral3": ("pixtral", "mistral3"), "qwen2_5_vl": ("qwen2_5_vl", "qwen2_5_vl"),
                   "qwen3_vl": ("qwen3_vl", "qwen3_vl"), "mllama": ("mllama", "mllama")}
# The Qwen-VL towers: images of any size (dynamic resolution), a Conv3d patch embedding and a
# patch merger under model.visual
QWEN_VL_TOWERS = ("qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True)
class VisionSpec:
    """A vision tower (ViT encoder) and the projector into the language model's hidden size."""

    tower: str  # "siglip" or "clip"
    projector: str  # "gemma3" or "llava"
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    image_size: int
    num_channels: int
    tokens_per_image: int  # image tokens the language model's sequence gets per image
    text_hidden_size: int
    use_head: bool = False  # SigLIP attention-pooling head (unused by Gemma-3)
    projector_bias: bool = True  # Llava linear_1 / linear_2 bias
    feature_layers: int = 1  # Llava, Mistral-3: len(vision_feature_layer) when it is a list
    merge_size: int = 1  # Mistral-3, Qwen-VL: spatial_merge_size (the patch merger's side)
    temporal_patch_size: int = 1  # Qwen-VL: the Conv3d patch embedding's frames
    position_embeddings: int = 0  # Qwen3-VL: num_position_embeddings (the learned position grid)
    deepstack_mergers: int = 0  # Qwen3-VL: len(deepstack_visual_indexes)
    # Llama-3.2-Vision (mllama): the gated global encoder's layers, the tiles an image is cut
    # into, the supported aspect ratios (tile layouts) and the projector's input width
    global_layers: int = 0
    max_num_tiles: int = 1
    aspect_ratios: int = 0
    output_dim: int = 0

    @property
    def patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2


def _layer_numel(v: VisionSpec) -> int:
    h, i = v.hidden_size, v.intermediate_size
    return 2 * (2 * h) + 4 * (h * h + h) + (h * i + i) + (i * h + h)


def tower_numel(v: VisionSpec) -> int:
    """Exact parameter count of the vision tower (``sum(p.numel())`` of model.vision_tower)."""
    h, c, p = v.hidden_size, v.num_channels, v.patch_size
    if v.tower == "qwen3_vl":  # biased Conv3d, learned positions, LayerNorms, plain biased MLP
        i = v.intermediate_size
        layer = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)
        return c * v.temporal_patch_size * p * p * h + h + v.position_embeddings * h + v.num_layers * layer
    if v.tower == "mllama":
        return _mllama_tower_numel(v)
    if v.tower == "qwen2_5_vl":  # RMSNorms, biased qkv/proj and gated MLP, no final norm
        i = v.intermediate_size
        layer = 2 * h + (3 * h * h + 3 * h) + (h * h + h) + 2 * (h * i + i) + (i * h + h)
        return c * v.temporal_patch_size * p * p * h + v.num_layers * layer
    if v.tower == "pixtral":  # RMSNorms, no biases, a gated MLP, no final norm
        layer = 2 * h + 4 * h * h + 3 * h * v.intermediate_size
        return c * p * p * h + h + v.num_layers * layer
    n = v.num_layers * _layer_numel(v) + 2 * h  # encoder layers + post_layernorm
    if v.tower == "siglip":
        n += c * p * p * h + h + v.patches * h
        if v.use_head:  # probe [1,1,h], nn.MultiheadAttention (in_proj 3h x h + bias, out_proj),
            # LayerNorm, SiglipMLP (modeling_siglip.py SiglipMultiheadAttentionPoolingHead)
            i = v.intermediate_size
            n += h + (3 * h * h + 3 * h) + (h * h + h) + 2 * h + (h * i + i) + (i * h + h)
    else:  # clip
        n += h + c * p * p * h + (v.patches + 1) * h + 2 * h  # class emb, patch, pos, pre_layrnorm
    return n


def _mllama_tower_numel(v: VisionSpec) -> int:
    """MllamaVisionModel (see the module docstring): its encoder layers are _layer_numel's less
    the four attention biases; the global ones add two gates each."""
    h, positions, rows = v.hidden_size, v.patches + 1, v.aspect_ratios + 1
    layer = _layer_numel(v) - 4 * h
    embeddings = (v.num_channels * v.patch_size ** 2 * h + h  # patch embedding, class embedding
                  + 1 + positions * h + rows * v.max_num_tiles * positions * h  # gated positions
                  + 2 * (rows * v.max_num_tiles * h + 1))  # pre/post tile embeddings + gates
    return embeddings + 2 * 2 * h + v.num_layers * layer + v.global_layers * (layer + 2)


def tower_buffer_bytes(v: VisionSpec) -> int:
    """The tower's buffers: SigLIP's and CLIP's position_ids (int64 arange of the positions,
    expanded without a copy), Pixtral's inv_freq and original_inv_freq (fp32, head_dim / 2 each;
    modeling_pixtral.py PixtralVisionRotaryEmbedding), Qwen2.5-VL's inv_freq and original_inv_freq
    (fp32, arange(0, head_dim / 2, 2) each; Qwen2_5_VLVisionRotaryEmbedding), Qwen3-VL's alike
    (Qwen3VLVisionRotaryEmbedding)."""
    if v.tower == "mllama":  # MllamaVisionModel registers none
        return 0
    if v.tower in QWEN_VL_TOWERS:
        return 2 * 4 * len(range(0, v.hidden_size // v.num_heads // 2, 2))
    if v.tower == "pixtral":
        return 2 * 4 * (v.hidden_size // v.num_heads // 2)
    return 8 * (v.patches + (1 if v.tower == "clip" else 0))


def projector_numel(v: VisionSpec) -> int:
    """Exact parameter count of the projector (model.multi_modal_projector; the Qwen-VL
    mergers under model.visual)."""
    if v.projector == "gemma3":
        return v.hidden_size * v.text_hidden_size + v.hidden_size
    if v.projector == "mllama":  # one biased Linear(vision_output_dim, h_text)
        return v.output_dim * v.text_hidden_size + v.text_hidden_size
    if v.projector == "qwen2_5_vl":  # model.visual.merger: ln_q + two biased Linears
        m = v.hidden_size * v.merge_size ** 2
        return v.hidden_size + (m * m + m) + (m * v.text_hidden_size + v.text_hidden_size)
    if v.projector == "qwen3_vl":  # merger (LayerNorm(h)) + deepstack mergers (LayerNorm(h m^2))
        m = v.hidden_size * v.merge_size ** 2
        mlp = (m * m + m) + (m * v.text_hidden_size + v.text_hidden_size)
        return 2 * v.hidden_size + mlp + v.deepstack_mergers * (2 * m + mlp)
    d_in, d = v.hidden_size * v.feature_layers, v.text_hidden_size
    b = d if v.projector_bias else 0
    n = d_in * d + b + d * d + b
    if v.projector == "mistral3":  # + norm and the patch merger
        h = v.hidden_size
        n += h + h * v.merge_size ** 2 * h
    return n


def vision_spec_from_config(cfg: dict, name: str, text_hidden_size: int) -> VisionSpec:
    """The VisionSpec of a multimodal config.json (model_type gemma3 or llava); other
    multimodal families are refused with what is missing."""
    mt = cfg.get("model_type")
    if mt == "qwen3_vl_moe":  # the Qwen3-VL tower over Qwen3-MoE's sparse block: not read, not measured
        raise ModelError(
            f"{name}: the analytic planner does not model Qwen3-VL-MoE (model_type 'qwen3_vl_moe'): its "
            "mixture-of-experts text model (Qwen3VLMoeTextSparseMoeBlock) with the Qwen3-VL tower is not "
            "modelled; the dense Qwen3-VL (qwen3_vl) is",
            "`lowvram plan --model DIR --simulate` runs the real training step of the config")
    if mt not in VISION_FAMILIES:
        raise ModelError(
            f"{name}: the analytic planner does not model the vision tower of model_type '{mt}' "
            f"(modelled: {', '.join(sorted(VISION_FAMILIES))})",
            "`lowvram plan --model DIR --simulate` runs the real training step of the config")
    tower, projector = VISION_FAMILIES[mt]
    vc = dict(_TOWER_DEFAULTS[tower])
    vc.update({k: v for k, v in (cfg.get("vision_config") or {}).items() if v is not None})
    if tower in QWEN_VL_TOWERS:
        return _qwen_vl_spec(tower, vc)
    if tower == "mllama":
        return _mllama_spec(vc)
    for key in ("image_size", "patch_size"):
        if isinstance(vc[key], (list, tuple)):
            vc[key] = int(vc[key][0])
    patches = (vc["image_size"] // vc["patch_size"]) ** 2
    feature_layers, merge = 1, 1
    if projector == "gemma3":
        tokens = int(cfg.get("mm_tokens_per_image") or 256)  # Gemma3Config default
        bias = False
    elif projector == "mistral3":
        merge = int(cfg.get("spatial_merge_size") or 2)  # Mistral3Config default
        side = vc["image_size"] // vc["patch_size"] // merge
        tokens = side * (side + 1)
        layer = cfg.get("vision_feature_layer", -1)
        feature_layers = len(layer) if isinstance(layer, list) else 1
        bias = bool(cfg.get("multimodal_projector_bias", False))
    else:
        strategy = cfg.get("vision_feature_select_strategy", "default")
        tokens = patches if strategy == "default" else patches + 1
        layer = cfg.get("vision_feature_layer", -2)
        feature_layers = len(layer) if isinstance(layer, list) else 1
        bias = bool(cfg.get("multimodal_projector_bias", True))
    return VisionSpec(
        tower=tower, projector=projector, num_layers=int(vc["num_hidden_layers"]),
        hidden_size=int(vc["hidden_size"]), intermediate_size=int(vc["intermediate_size"]),
        num_heads=int(vc["num_attention_heads"]), patch_size=int(vc["patch_size"]),
        image_size=int(vc["image_size"]), num_channels=int(vc["num_channels"]),
        tokens_per_image=tokens, text_hidden_size=int(text_hidden_size),
        use_head=bool(vc["vision_use_head"]) if tower == "siglip" else False,
        projector_bias=bias, feature_layers=feature_layers, merge_size=merge)


def _qwen_vl_spec(tower: str, vc: dict) -> VisionSpec:
    """A Qwen-VL tower from its vision_config (Qwen2_5_VLVisionConfig's / Qwen3VLVisionConfig's
    key names). Images have no fixed size (the processor resizes them to a multiple of
    patch * merge within max_pixels): image_size is the largest square side the default
    max_pixels allows, tokens_per_image the most tokens an image gets (Qwen2.5-VL: 1280)."""
    patch, merge = int(vc["patch_size"]), int(vc["spatial_merge_size"])
    unit = patch * merge
    side = int(_QWEN_MAX_PIXELS ** 0.5) // unit * unit
    qwen3 = tower == "qwen3_vl"
    return VisionSpec(
        tower=tower, projector=tower, num_layers=int(vc["depth"]),
        hidden_size=int(vc["hidden_size"]), intermediate_size=int(vc["intermediate_size"]),
        num_heads=int(vc["num_heads"]), patch_size=patch, image_size=side,
        num_channels=int(vc["in_channels"]), tokens_per_image=_QWEN_MAX_PIXELS // unit ** 2,
        text_hidden_size=0, projector_bias=True, merge_size=merge,
        temporal_patch_size=int(vc["temporal_patch_size"]),
        position_embeddings=int(vc["num_position_embeddings"]) if qwen3 else 0,
        deepstack_mergers=len(vc["deepstack_visual_indexes"]) if qwen3 else 0)


def _mllama_spec(vc: dict) -> VisionSpec:
    """Llama-3.2-Vision's tower from its vision_config (MllamaVisionConfig's key names). Its
    language model's sequence holds one <|image|> token an image (processing_mllama.py); the
    tiles reach it through cross-attention (plan/memory/cross_attention.py)."""
    return VisionSpec(
        tower="mllama", projector="mllama", num_layers=int(vc["num_hidden_layers"]),
        hidden_size=int(vc["hidden_size"]), intermediate_size=int(vc["intermediate_size"]),
        num_heads=int(vc["attention_heads"]), patch_size=int(vc["patch_size"]),
        image_size=int(vc["image_size"]), num_channels=int(vc["num_channels"]), tokens_per_image=1,
        text_hidden_size=0, projector_bias=True, global_layers=int(vc["num_global_layers"]),
        max_num_tiles=int(vc["max_num_tiles"]), aspect_ratios=len(vc["supported_aspect_ratios"]),
        output_dim=int(vc["vision_output_dim"]))


def vision_problems(vision: VisionSpec | None, offload: str | None, objective: str,
                    optimizer: str | None, tiled_mlp: bool | None) -> list[str]:
    """What is not modelled with a vision tower loaded (each named, none guessed): DeepSpeed and
    FSDP (their wrapping and sharding of the tower is not counted), preference objectives (TRL's
    trainers on a multimodal model), GaLore (its target modules match the tower's attention and
    MLP Linears by name), LOMO and AdaLomo (their in-backward steps not measured with a tower) and
    the tiled MLP (DeepSpeed's TiledMLP patched into the tower's MLP
    too)."""
    if vision is None:
        return []
    what = []
    if offload not in (None, "none"):
        what.append(f"offload {offload}")
    if objective != "sft":
        what.append(f"objective {objective}")
    if optimizer and (optimizer.startswith(("galore", "apollo")) or optimizer in ("lomo", "adalomo")):
        what.append(f"optimizer {optimizer}")
    if tiled_mlp:
        what.append("tiled_mlp")
    return [f"{w} with a vision tower loaded ({vision.tower} + {vision.projector} projector) is not "
            "modelled" for w in what]


def packing_problem(vision: VisionSpec | None, packing: bool) -> str | None:
    """Packed windows on Qwen2.5-VL: lowvram's packing sends 1-row position_ids that restart per
    sample and no attention_mask, from which Qwen2's text model builds a block-diagonal mask
    (masking_utils find_packed_sequence_indices); Qwen2_5_VLTextModel expands them to its three
    M-RoPE rows and builds its mask without them (it reads boundaries only from a fourth, text
    row: modeling_qwen2_5_vl.py), so packed samples would attend to each other. Refused."""
    if vision is None or vision.tower != "qwen2_5_vl" or not packing:
        return None
    return ("data.packing with Qwen2.5-VL is not modelled: its text model reads no sample boundaries "
            "from packed position_ids (Qwen2_5_VLTextModel), so packed samples would attend to each other")


PACKING_HINT = "set data.packing: false (each sample is padded to its batch instead)"


VISION_HINT = ("train it with offload none, objective sft, another optimizer and tiled_mlp off, or "
               "plan the language model alone: save its text_config as a config.json and pass that "
               "folder")
