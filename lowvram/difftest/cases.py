"""The differential test's cases: the limits a run is held to, the model families drawn, and one
random valid recipe per seed (:func:`random_case`), with the forms a bench draws on purpose
(chunked loss, tiled MLP, images, PiSSA, GaLore, APOLLO, LOMO, torchao, preference pairs).
Drawing only: files.py writes a case's model, data and recipe, run.py runs it."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path

from lowvram.plan.memory.preference import REFERENCE_OBJECTIVES

# Targets of the differential test: measured / predicted - 1.
OVER_LIMIT = 0.03  # the run may use at most 3% more than its plan said
ANY_LIMIT = 0.10  # and the plan may be at most 10% off either way

# Families and their transformers config fields (random init; small enough for 2 CPU steps).
# Llama; Qwen2 (q/k/v bias, tied embeddings at small sizes); Gemma (tied embeddings, GeGLU,
# scaled embedding); Phi-3 (fused qkv and gate_up); Mistral; Qwen3-MoE and Mixtral (experts).
# The families of the first fuzz runs: the fixed seeds of tests/plan/test_fuzz.py name recipes
# drawn from these seven (a longer tuple draws other recipes from the same seeds)
FIRST_FAMILIES = ("llama", "qwen2", "gemma", "phi3", "mistral", "qwen3_moe", "mixtral")
# the ten families bench/results/plan_fuzz.txt and the ten-family regression seeds were drawn from
TEN_FAMILIES = FIRST_FAMILIES + ("gemma3_text", "olmo2", "smollm3")
FAMILIES = TEN_FAMILIES + ("gpt_oss",)
MOE_FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")
# multimodal checkpoints (a vision tower loaded with the language model, lowvram.plan.model.vision):
# Gemma-3 (SigLIP, Gemma-3 text), Llava (CLIP, Llama), Mistral-3 (Pixtral, Mistral) and Qwen2.5-VL (its
# window-attention ViT and patch merger, Qwen2 with M-RoPE); text-only recipes (bench/plan_fuzz.py
# --families vision). Llama-3.2-Vision (mllama: its local + gated global ViT, Llama with
# cross-attention layers the text forward skips) is drawn on its own (--families mllama), so the
# seeds of the four keep their recipes.
VISION_FAMILIES = ("gemma3", "llava", "mistral3", "qwen2_5_vl")
# Qwen3-VL (its ViT with learned positions and deepstack mergers, Qwen3 with interleaved M-RoPE),
# drawn on its own (bench/plan_fuzz.py --families qwen3_vl) so the vision seeds keep their recipes
MLLAMA_FAMILIES = ("mllama",)
MULTIMODAL_FAMILIES = VISION_FAMILIES + ("qwen3_vl",) + MLLAMA_FAMILIES
# the ones image + text recipes are drawn for (made_images; Mistral-3's images need torchvision,
# refused): bench/plan_fuzz.py --families images draws Gemma-3 and Llava (the seeds measured before
# keep their recipes), --families mllama --images Llama-3.2-Vision alone
IMAGE_FAMILIES = ("gemma3", "llava")
IMAGE_CASE_FAMILIES = IMAGE_FAMILIES + MLLAMA_FAMILIES
# Qwen2.5-VL and Qwen3-VL with images (dynamic resolution: data.max_pixels sizes them), drawn on
# their own (bench/plan_fuzz.py --families qwen_vl_images --images) so the image seeds above keep
# their recipes
QWEN_VL_IMAGE_FAMILIES = ("qwen2_5_vl", "qwen3_vl")

WORDS = ("the quick brown fox jumps over lazy dog gradient memory adapter train model plan "
         "peak tensor layer token batch sequence answer question").split()


@dataclass(frozen=True)
class Case:
    """One random recipe: the model shape and every recipe value that changes memory."""

    seed: int
    family: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie: bool
    method: str  # full | lora | qlora
    lora_r: int = 8
    lora_targets: tuple[str, ...] | str = "all-linear"
    lora_dropout: float = 0.0
    use_dora: bool = False  # lora.use_dora (drawn by random_case(..., extended=True) only)
    lora_init: str = "default"  # lora.init (random_case(..., pissa=share), made_pissa)
    galore_rank: int = 128  # galore.rank, with a GaLore optimizer (extended draws, made_galore)
    precision: str = "fp32"
    model_dtype: str = "auto"
    gradient_checkpointing: bool = False
    optimizer: str = "adamw"
    loss: str = "standard"
    attention: str = "sdpa"
    seq_len: int = 128
    micro_batch_size: int = 1
    grad_accum: int = 1
    packing: bool = False
    validation: float | None = None
    experts: int = 0
    experts_per_tok: int = 0
    tiled_mlp: bool = False  # techniques.tiled_mlp (lowvram.plan.memory.tiled)
    tiled_mlp_shards: int = 0  # 0: on, ceil(seq_len / hidden_size) shards
    # loss chunked: the chunk the plan sizes to a budget made for it (run_case passes --vram;
    # search.sized_loss_chunk); 1024: the default, no --vram
    loss_chunk_tokens: int = 1024

    # the vision tower of a VISION_FAMILIES case (0: none): layers, width, image side, patch
    vision_layers: int = 0
    vision_hidden: int = 0
    vision_image: int = 0
    vision_patch: int = 0
    cross_layers: int = 0  # mllama: cross-attention layers among the text layers (skipped on text)
    images: int = 0  # format image_chat: images per row (data.images_per_row), made_images
    # Qwen-VL images (made_images): data.max_pixels, (k x patch x merge)^2 + patch x merge, so the
    # processor resizes each (larger, square) image to exactly k x k tokens, the plan's bound
    max_pixels: int = 0
    image_side: int = 0  # the generated images' side (px); 0: the data's own draw

    # training.objective (dpo/orpo/simpo: preference pairs through TRL; preference_case)
    objective: str = "sft"
    loss_type: str = "sigmoid"
    precompute_ref: bool = False
    # preference pairs shorter than seq_len (made_short_pairs): the chosen's tokens (0: longer than
    # seq_len, cut there); the run is compared with the plan at the longest tokenized pair
    pair_tokens: int = 0
    # training.objective grpo/rloo (grpo_case): the grpo section; num_generations 0 for the others
    num_generations: int = 0
    prompt_len: int = 0
    completion_len: int = 0
    steps_per_generation: int = 0
    beta: float = 0.0
    generation: str = "generate"  # grpo.generation: the engine (made_generation_bound draws paged)
    head_dim: int = 0  # 0: hidden // heads (made_generation_bound's full fine-tuning: wider heads)

    def label(self) -> str:
        bits = [f"#{self.seed}", self.family, self.method]
        if self.vision_layers:
            bits.insert(2, f"vit{self.vision_layers}x{self.vision_hidden} {self.vision_image}px/{self.vision_patch}"
                        + (f" {self.images}img" if self.images else "")
                        + (f" max{self.max_pixels}px" if self.max_pixels else "")
                        + (f" xattn{self.cross_layers}" if self.cross_layers else ""))
        if self.num_generations:
            bits.insert(2, f"{self.objective} G{self.num_generations} P{self.prompt_len} C{self.completion_len} "
                        f"spg{self.steps_per_generation}" + (f" beta{self.beta:g}" if self.beta else "")
                        + (f" {self.generation}" if self.generation != "generate" else "")
                        + (f" hd{self.head_dim}" if self.head_dim else ""))
        elif self.objective != "sft":
            bits.insert(2, self.objective + (f" {self.loss_type}" if self.objective == "dpo" else "")
                        + (" precompute" if self.precompute_ref else "")
                        + (f" pairs{self.pair_tokens}t" if self.pair_tokens else ""))
        if self.method != "full":
            t = self.lora_targets if isinstance(self.lora_targets, str) else ",".join(self.lora_targets)
            bits.append(f"r{self.lora_r} {t}" + (f" drop{self.lora_dropout}" if self.lora_dropout else "")
                        + (" dora" if self.use_dora else "")
                        + (f" {self.lora_init}" if self.lora_init != "default" else ""))
        bits += [self.precision] + ([f"dtype {self.model_dtype}"] if self.model_dtype != "auto" else [])
        bits += (["ckpt"] if self.gradient_checkpointing else [])
        bits.append(self.optimizer + (f" r{self.galore_rank}" if self.optimizer.startswith(("galore", "apollo")) else ""))
        bits += ([self.loss] if self.loss != "standard" else []) + ([self.attention] if self.attention != "sdpa" else [])
        bits.append(f"b{self.micro_batch_size}x{self.grad_accum} s{self.seq_len}")
        bits += (["packed"] if self.packing else []) + (["eval"] if self.validation else [])
        if self.tiled_mlp:
            bits.append(f"tiled{self.tiled_mlp_shards or ''}")
        if self.loss_chunk_tokens != 1024:
            bits.append(f"chunk{self.loss_chunk_tokens}")
        return " ".join(bits)


def _targets(family: str, rng: random.Random):
    """all-linear or a random subset of the family's Linear names (as peft matches them)."""
    if family == "phi3":
        names = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    elif family in MOE_FAMILIES:
        names = ["q_proj", "k_proj", "v_proj", "o_proj"]  # attention; experts via all-linear
    else:
        names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    if rng.random() < 0.5:
        return "all-linear"
    return tuple(sorted(rng.sample(names, rng.randint(1, len(names)))))


def random_case(seed: int, families: tuple[str, ...] = FAMILIES, tiled: float = 0.0,
                extended: bool = False, chunk: float = 0.0) -> Case:
    """A random valid recipe (same seed, same case). ``tiled``: the share of dense-MLP cases made
    long-context tiled-MLP runs (:func:`made_tiled`), drawn from a stream of their own;
    ``extended``: also the options of issue 27 (lora.use_dora, optimizer galore_adamw), drawn from
    another generator; so every seed's recipe without them stays as it was. (A tiled case draws
    no DoRA: the two together are refused as not modelled.) ``chunk``: the share of cases made
    chunked-loss runs whose chunk the plan sizes below 1024 tokens (:func:`made_chunked`), from a
    stream of their own too."""
    rng = random.Random(seed)
    family = rng.choice(families)
    heads = rng.choice([2, 4])
    head_dim = rng.choice([16, 32])
    hidden = heads * head_dim
    moe = family in MOE_FAMILIES
    method = rng.choice(["full", "lora", "lora", "qlora"])
    precision = rng.choice(["fp32", "bf16", "bf16-mixed"])
    if method == "full" and precision == "bf16" and rng.random() < 0.3:
        precision = "bf16-mixed"
    dtype = "auto"
    if rng.random() < 0.15:  # model.dtype set: the precision must agree
        dtype = {"bf16": "bfloat16", "bf16-mixed": "float32", "fp32": "float32"}[precision]
    optimizer = rng.choice(["adamw", "adamw", "adamw_8bit", "paged_adamw_8bit", "adafactor", "sgd"])
    seq_len = rng.choice([64, 128, 256, 512])
    micro = rng.choice([1, 2, 4])
    loss = "chunked" if seq_len * micro > 1024 and rng.random() < 0.7 else rng.choice(["standard", "standard", "chunked"])
    case = Case(
        seed=seed, family=family, hidden=hidden, layers=rng.choice([2, 3]), heads=heads,
        kv_heads=rng.choice([h for h in (1, 2, heads) if heads % h == 0]),
        intermediate=rng.choice([2, 3, 4]) * hidden, vocab=rng.choice([512, 1024, 2048]),
        tie=family in ("gemma", "gemma3_text", "smollm3", "gemma3")
        or (family in ("qwen2", "qwen2_5_vl", "qwen3_vl") and rng.random() < 0.5),
        method=method, lora_r=rng.choice([4, 8, 16]), lora_targets=_targets(family, rng),
        lora_dropout=0.0 if moe or rng.random() < 0.5 else rng.choice([0.05, 0.1]),
        precision=precision, model_dtype=dtype, gradient_checkpointing=rng.random() < 0.4,
        optimizer=optimizer, loss=loss, attention="eager" if rng.random() < 0.15 else "sdpa",
        seq_len=seq_len, micro_batch_size=micro, grad_accum=rng.choice([1, 1, 2]),
        packing=rng.random() < 0.3, validation=0.2 if rng.random() < 0.25 else None,
        experts=rng.choice([4, 8]) if moe else 0, experts_per_tok=2 if moe else 0,
    )
    if family in MULTIMODAL_FAMILIES:
        case = _with_vision(case, random.Random(f"vision-{seed}"))
    if family == "qwen2_5_vl":  # packing refused (vision.packing_problem)
        case = replace(case, packing=False)
    if extended:
        case = _extend(case, random.Random(f"issue27-{seed}"))
    if family == "gpt_oss":
        # transformers trains gpt-oss with eager attention only (no SDPA path for its sinks)
        case = replace(case, attention="eager")
    if method == "qlora" and case.validation:
        # Evaluation runs bitsandbytes' CPU 4-bit inference kernel, which needs each Linear's
        # output width divisible by 32 and more than 32 inputs (functional.py
        # _convert_weight_packed_for_cpu, block_n=32): every real model's are, the tiny shapes
        # drawn above not always (kv width 16). Heads of 32, two kv heads at least; nothing
        # more is drawn, so every other seed keeps its recipe.
        kv = max(case.kv_heads, 2)
        heads = max(case.heads, kv)
        hidden = heads * 32
        case = replace(case, heads=heads, kv_heads=kv, hidden=hidden,
                       intermediate=case.intermediate // case.hidden * hidden)
    if tiled and family not in MOE_FAMILIES + MULTIMODAL_FAMILIES and random.Random(f"tiled-{seed}").random() < tiled:
        case = made_tiled(replace(case, use_dora=False))  # DoRA with a tiled MLP: refused, not modelled
    if chunk and case.objective == "sft" and random.Random(f"chunk-{seed}").random() < chunk:
        case = made_chunked(case)
    return case


def made_chunked(case: Case) -> Case:
    """The case with the chunked loss and a chunk of 128, 256 or 512 tokens below its tokens per
    micro-batch (at least 1024 of them), which run_case makes the plan choose by budget. A vocabulary
    of 8,192 makes the chunk's logits a large share of the peak, as in a real model's (and the
    budget that sizes it clear of the CUDA-context floor check_card refuses below)."""
    rng = random.Random(f"chunk-shape-{case.seed}")
    micro = max(case.micro_batch_size, 2)
    seq_len = max(case.seq_len, 1024 // micro)
    return replace(case, loss="chunked", micro_batch_size=micro, seq_len=seq_len, vocab=8192,
                   loss_chunk_tokens=rng.choice([128, 256, 512]), packing=False)


def chunk_budget(recipe: Path, chunk: int) -> int:
    """The smallest --vram (bytes) under which the recipe's plan fits with its chunked loss sized
    to ``chunk`` tokens or more (binary search over lowvram's own planning; at that budget the
    plan takes ``chunk`` itself, the peak growing with the chunk)."""
    from lowvram.errors import LowvramError
    from lowvram.planning.entry import plan_for_recipe
    from lowvram.recipe import load_recipe

    r = load_recipe(recipe)

    def enough(vram: int) -> bool:
        try:
            plan = plan_for_recipe(r, vram=str(vram))
        except LowvramError:  # a budget no larger than the CUDA context (planning.budget.check_card)
            return False
        return bool(plan.fits) and plan.loss_chunk_tokens >= chunk

    lo, hi = 2**28, 2**28 + 2**32  # the margin's 256 MiB floor, + 4 GiB
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


def made_tiled(case: Case) -> Case:
    """The case as a long-context tiled-MLP run: seq_len 512 or 1024 (per-token terms dominate),
    the shards on DeepSpeed's rule or fixed (drawn from the seed's own tiled stream)."""
    rng = random.Random(f"tiled-shape-{case.seed}")
    seq_len = rng.choice([512, 1024])
    micro = min(case.micro_batch_size, 2)
    loss = "chunked" if seq_len * micro > 1024 else case.loss
    return replace(case, tiled_mlp=True, tiled_mlp_shards=rng.choice([0, 0, 4, 16]), seq_len=seq_len,
                   micro_batch_size=micro, loss=loss, packing=False)


def _with_vision(case: Case, rng: random.Random) -> Case:
    """A vision tower for a MULTIMODAL_FAMILIES case, from a stream of its own: 1-2 layers, 32-64
    wide, 32 or 64 px images in 8 or 16 px patches."""
    heads = 2
    case = replace(case, vision_layers=rng.choice([1, 2]), vision_hidden=heads * rng.choice([16, 32]),
                   vision_image=rng.choice([32, 64]), vision_patch=rng.choice([8, 16]))
    if case.family == "mllama":  # drawn after the others: their towers keep their draws
        case = replace(case, cross_layers=rng.choice([1, 2]))
    return case


def image_tokens(case: Case) -> int:
    """Tokens per image of a case's tower in the language model's sequence (as _multimodal sizes
    it, lowvram.plan.model.vision): Llama-3.2-Vision's one <|image|> token; a Qwen-VL image case's
    the largest image data.max_pixels allows."""
    if case.family == "mllama":
        return 1
    if case.max_pixels:
        return case.max_pixels // (2 * case.vision_patch) ** 2
    patches = (case.vision_image // case.vision_patch) ** 2
    return max(1, patches // 4) if case.family in ("gemma3", "qwen2_5_vl", "qwen3_vl") else patches


def made_images(case: Case) -> Case:
    """The case as an image + text run (format image_chat): one or two images a row, drawn from a
    stream of its own; seq_len raised to hold the images' tokens and at least 32 of text; no
    packing (refused with images). None-free: every IMAGE_CASE_FAMILIES and QWEN_VL_IMAGE_FAMILIES
    case can be made one."""
    if case.family not in IMAGE_CASE_FAMILIES + QWEN_VL_IMAGE_FAMILIES:
        raise ValueError(f"image recipes are drawn for {', '.join(IMAGE_CASE_FAMILIES + QWEN_VL_IMAGE_FAMILIES)}, "
                         f"not {case.family}")
    rng = random.Random(f"images-{case.seed}")
    images = rng.choice([1, 1, 2])
    if case.family in QWEN_VL_IMAGE_FAMILIES:  # k x k tokens an image, from larger square images
        unit = case.vision_patch * 2  # spatial_merge_size 2
        k = rng.choice([2, 3, 4, 6])
        case = replace(case, max_pixels=(k * unit) ** 2 + unit, image_side=k * unit * rng.choice([2, 3]))
    seq_len = case.seq_len
    while seq_len < images * image_tokens(case) + 64:
        seq_len *= 2
    # Llama-3.2-Vision: SDPA (eager attention over its tiles is refused, plan/memory/images.py)
    attention = "sdpa" if case.family == "mllama" else case.attention
    return replace(case, images=images, seq_len=seq_len, packing=False, attention=attention)


def _extend(case: Case, rng: random.Random) -> Case:
    """DoRA on half the adapter recipes (not on fused MoE experts: peft refuses it), GaLore on
    half the dense full fine-tuning ones, at a rank below the model's widths."""
    moe = case.family in MOE_FAMILIES
    if case.method != "full" and rng.random() < 0.5 and not (moe and case.lora_targets == "all-linear"):
        case = replace(case, use_dora=True)
    if case.method == "full" and not moe and not case.vision_layers and rng.random() < 0.5:
        case = replace(case, optimizer="galore_adamw", galore_rank=rng.choice([4, 8, 16, 32]))
    return case


def made_pissa(case: Case) -> Case | None:
    """An adapter recipe made a lora.init PiSSA run (plan/memory/lora_init.py), full or fast SVD drawn from
    a stream of its own: QLoRA made LoRA (PiSSA needs a float base), no DoRA; None for full
    fine-tuning, fused MoE experts and an r above the narrowest adapted Linear (refused)."""
    if case.method == "full" or (case.family in MOE_FAMILIES and case.lora_targets == "all-linear"):
        return None
    rng = random.Random(f"pissa-{case.seed}")
    init = rng.choice(["pissa", "pissa", "pissa_niter_1", "pissa_niter_4"])
    widths = [case.hidden, case.kv_heads * case.hidden // case.heads, case.intermediate]
    r = min(case.lora_r, min(widths))
    return replace(case, method="lora", use_dora=False, lora_init=init, lora_r=r)


def made_galore(case: Case, layerwise: bool = False, eight_bit: bool = False) -> Case | None:
    """The case as a GaLore full fine-tuning run (bench/plan_fuzz.py --galore): optimizer
    galore_adamw, or galore_adamw_layerwise with gradient accumulation 1 (the batch in one
    micro-batch: transformers refuses accumulation for it), at a rank drawn from the seed's own
    stream. None for an MoE family (GaLore is refused there: its experts are no nn.Linear).
    ``eight_bit`` (--galore 8bit): galore_adamw_8bit or galore_adamw_8bit_layerwise, the form
    drawn from the seed's stream too (``layerwise`` ignored); its step runs on the CPU through
    lowvram.train.build.galore_cpu."""
    if case.family in MOE_FAMILIES:
        return None
    rng = random.Random(f"galore-{case.seed}")
    rank = rng.choice([4, 8, 16, 32])
    if eight_bit:
        layerwise = rng.random() < 0.5
    optimizer = "galore_adamw" + ("_8bit" if eight_bit else "") + ("_layerwise" if layerwise else "")
    out = replace(case, method="full", use_dora=False, lora_dropout=0.0, galore_rank=rank, optimizer=optimizer)
    return replace(out, grad_accum=1) if layerwise else out


def made_apollo(case: Case, layerwise: bool = False) -> Case | None:
    """The case as an APOLLO full fine-tuning run (bench/plan_fuzz.py --apollo): as made_galore,
    optimizer apollo_adamw or apollo_adamw_layerwise (accumulation 1), at a rank drawn from the
    seed's own stream; None for an MoE family."""
    if case.family in MOE_FAMILIES:
        return None
    rng = random.Random(f"apollo-{case.seed}")
    out = replace(case, method="full", use_dora=False, lora_dropout=0.0, galore_rank=rng.choice([4, 8, 16, 32, 128]),
                  optimizer="apollo_adamw_layerwise" if layerwise else "apollo_adamw")
    return replace(out, grad_accum=1) if layerwise else out


def made_in_backward(case: Case) -> Case:
    """The case as a full fine-tuning run with AdamW stepped in the backward (bench/plan_fuzz.py
    --in-backward): optimizer adamw_in_backward at gradient accumulation 1 (lowvram.train.build.in_backward)."""
    return replace(case, method="full", use_dora=False, lora_dropout=0.0, optimizer="adamw_in_backward", grad_accum=1)


def made_lomo(case: Case) -> Case:
    """The case as a LOMO full fine-tuning run (bench/plan_fuzz.py --lomo): optimizer lomo with
    gradient accumulation 1 (the batch in one micro-batch: LOMO steps in every backward); the
    draw has no fp16, which LOMO refuses. AdaLomo is not drawn: it makes its state with .cuda()."""
    return replace(case, method="full", use_dora=False, lora_dropout=0.0, optimizer="lomo", grad_accum=1)


def made_torchao(case: Case) -> Case:
    """The case with torchao's 8-bit or 4-bit AdamW (bench/plan_fuzz.py --torchao), drawn from the
    seed's own stream; its method (full, LoRA, QLoRA) and every other technique as random_case
    drew them. The step runs compiled (torch.compile, inductor's C++ backend), as it does under
    ``lowvram train``; the live-bytes tracker follows the compiled code's buffers."""
    rng = random.Random(f"torchao-{case.seed}")
    return replace(case, optimizer=rng.choice(["adamw_torch_8bit", "adamw_torch_4bit"]))


def preference_case(seed: int, families: tuple[str, ...] = FAMILIES, kto: bool = False) -> Case:
    """A random preference recipe: random_case's model and techniques (the same seed draws the
    same ones), then an objective, DPO's loss type and precompute; TRL's own loss (no chunked or
    fused), no packing (TRL pads each pair) and no hold-out. A second generator, so every SFT
    seed of random_case keeps its recipe. ``kto``: the objective is kto (on the pairs, which TRL
    unpairs), a micro-batch of at least 2 (TRL's KL term), precompute drawn as for DPO."""
    base = random_case(seed, families)
    rng = random.Random(f"preference-{seed}")
    objective = rng.choice(["dpo", "dpo", "orpo", "simpo"])
    if kto:
        objective = "kto"
        base = replace(base, micro_batch_size=max(2, base.micro_batch_size))
    return replace(base, objective=objective, loss="standard", packing=False, validation=None,
                   loss_type=rng.choice(["sigmoid", "sigmoid", "ipo", "hinge"]) if objective == "dpo" else "sigmoid",
                   precompute_ref=objective in REFERENCE_OBJECTIVES and rng.random() < 0.3)


# the families grpo_case draws: dense, text (the generation terms count a dense MLP's no-grad
# forward; mixtures of experts and vision towers are not drawn)
GRPO_FAMILIES = ("llama", "qwen2", "gemma", "phi3", "mistral", "gemma3_text", "olmo2", "smollm3")


def grpo_case(seed: int, families: tuple[str, ...] = GRPO_FAMILIES) -> Case:
    """A random grpo/rloo recipe: random_case's model and techniques (the same seed draws the same
    ones; no tiled MLP, DoRA, packing or hold-out), then from a stream of its own the objective,
    num_generations, a batch of whole groups, its micro-batch and a generation batch that divides
    it (steps_per_generation), the prompt and completion lengths and beta. Prompts are exactly
    max_prompt_length tokens (write_data); the built-in length reward."""
    base = random_case(seed, families)
    rng = random.Random(f"grpo-{seed}")
    ng = rng.choice([2, 4, 4, 8])
    batch = ng * rng.choice([1, 2])
    micro = min(base.micro_batch_size, batch)
    while batch % micro:
        micro //= 2
    accumulation = batch // micro
    ks = [k for k in range(1, accumulation + 1) if accumulation % k == 0 and (micro * k) % ng == 0]
    prompt, completion = rng.choice([16, 32, 64]), rng.choice([16, 32, 64])
    return replace(base, objective=rng.choice(["grpo", "grpo", "rloo"]), loss="standard", packing=False,
                   validation=None, use_dora=False, tiled_mlp=False, micro_batch_size=micro,
                   grad_accum=accumulation, num_generations=ng, steps_per_generation=rng.choice(ks),
                   prompt_len=prompt, completion_len=completion, seq_len=prompt + completion,
                   beta=rng.choice([0.0, 0.0, 0.04]))


def made_generation_bound(case: Case) -> Case:
    """The grpo case made one whose generation phase binds (bench/plan_fuzz.py --grpo-generation):
    one completion per micro-step and a generation batch of the whole step (16 rows of
    num_generations 16), so the cache of 16 x (prompt + completion) tokens outgrows the training
    forward's fused-head tile (4,096 x 32,768 entries at most, a tiny model's largest tensor).
    LoRA and QLoRA: four layers of wide keys and values (8 kv heads of 64) on all linears. Full
    fine-tuning, whose gradients are alive through the training phase: eight layers of 8 kv heads
    of 64 on a hidden size of 64 (wide heads: head_dim beside hidden_size, as Gemma and Qwen3 have
    it), so the cache outgrows the gradients (Phi-3 sets its head_dim from the hidden size: its
    full cases become LoRA). The engine: transformers' paged (continuous batching) in a third of
    the fp32 cases (TRL 1.16 runs it in fp32 only: plan.memory.grpo.paged_precision_problem;
    bf16 full fine-tuning was drawn paged before held-out seed 908 showed it fails), else
    generate. Family, precision, optimizer,
    checkpointing, objective and beta as drawn."""
    rng = random.Random(f"grpo-generation-{case.seed}")
    prompt, completion = rng.choice([32, 64]), rng.choice([32, 64, 96])
    more = random.Random(f"grpo-generation-engine-{case.seed}")
    full = case.method == "full" and case.family != "phi3"
    shape = (dict(hidden=64, heads=8, kv_heads=8, head_dim=64, layers=8, intermediate=128) if full
             else dict(hidden=512, heads=8, kv_heads=8, layers=4, intermediate=1024))
    paged_ok = case.precision == "fp32"  # TRL 1.16's paged engine runs in fp32 only (plan.memory.grpo.paged_precision_problem)
    engine = "paged" if paged_ok and more.random() < 1 / 3 else "generate"
    return replace(case, method=case.method if full or case.method == "qlora" else "lora", **shape,
                   micro_batch_size=1, grad_accum=16, num_generations=16, steps_per_generation=16,
                   prompt_len=prompt, completion_len=completion, seq_len=prompt + completion,
                   lora_targets="all-linear", generation=engine)


def made_paged(case: Case) -> Case:
    """made_generation_bound's case on transformers' paged engine (bench/plan_fuzz.py --grpo-paged):
    the draw otherwise reaches it in a third of its fp32 cases only. fp32 (TRL 1.16 runs it in fp32
    only: plan.memory.grpo.paged_precision_problem; model.dtype as drawn where it agrees) and SDPA
    (paged with eager attention is refused: grpo_request_problem)."""
    dtype = case.model_dtype if case.model_dtype in ("auto", "float32") else "float32"
    return replace(made_generation_bound(replace(case, precision="fp32", model_dtype=dtype)), generation="paged",
                   attention="sdpa")


def made_short_pairs(case: Case) -> Case:
    """The preference case on pairs shorter than seq_len (bench/plan_fuzz.py --short-pairs): every
    prompt 8 tokens, every chosen 30-70% of seq_len tokens (drawn from the seed's own stream), every
    rejected a quarter of that, exactly (lowvram.testing.texts_of_exact_length), so every batch
    reaches the data's longest pair. TRL pads each batch to its longest row, so the run is
    compared with the plan at the longest tokenized pair (train.run: predicted_peak_bytes_at_data)."""
    rng = random.Random(f"short-pairs-{case.seed}")
    return replace(case, pair_tokens=max(8, int(case.seq_len * rng.uniform(0.3, 0.7))))
