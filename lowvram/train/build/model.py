"""Load the model and tokenizer a Plan asks for: local folder, hub id or GGUF file; bitsandbytes
quantization; LoRA adapters (peft). Training never decides techniques: everything comes from
the Plan (what) and the recipe (model location, LoRA shape).

A GGUF file is converted once to a cached safetensors folder (gguf.py); a multimodal checkpoint's
tower and projector are found and frozen by vision.py; library noise is dropped by quiet.py.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowvram.errors import LowvramError, ModelError
from lowvram.hub import HUB_ID
from lowvram.plan.memory.lora_init import is_svd_init
from lowvram.train.build.checkpointing import enable_checkpointing
from lowvram.train.build.custom_code import custom_code_refused, is_custom_code_refusal
from lowvram.train.build.quiet import quiet_libraries
from lowvram.train.build.vision import (
    VISION_MODULES,
    freeze_vision,
    has_vision,
    model_class,
    text_input_grads_only,
    vision_pattern,
)


@dataclass
class LoadedModel:
    model: Any  # PreTrainedModel or PeftModel
    tokenizer: Any
    source: str  # the folder (or hub id) the weights were read from
    load_s: float
    gguf_cache_hit: bool | None = None  # None: not a GGUF model
    trainable_params: int = 0
    total_params: int = 0


# --------------------------------------------------------------------------------------------
# Where the model is


_HUB_HINT = ("check model.name_or_path: a local folder with config.json, or a hub id "
             "(downloads need network; HF_HUB_OFFLINE=1 only reads the local cache)")


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or "\\" in name or name.count("/") > 1 or not HUB_ID.match(name)


def resolve_model_location(recipe) -> str:
    """A local folder (recipe's folder first, then the cwd) or a hub id; else ModelError."""
    name = recipe.model.name_or_path
    p = Path(name).expanduser()
    candidates = [p] if p.is_absolute() else [recipe.base_dir() / p, Path.cwd() / p]
    for c in candidates:
        if c.is_dir():
            return str(c.resolve())
    if _looks_like_path(name) or recipe.model.gguf_file:
        looked = ", ".join(dict.fromkeys(str(c.resolve()) for c in candidates))
        hint = "set model.name_or_path to a folder with config.json (or a hub id like HuggingFaceTB/SmolLM2-135M)"
        if "SmolLM2-135M-Instruct" in name:
            hint = "run `make demo` (or `python -m lowvram.demo`) once: it links the quickstart model into models/"
        raise ModelError(f"model not found: {name} (looked in {looked})", hint)
    return name  # a hub id; from_pretrained reports if it cannot be found


# --------------------------------------------------------------------------------------------
# dtype, quantization, attention from the Plan


def weight_dtype(plan):
    """Storage dtype of the weights: what the plan's precision keeps (a recipe's model.dtype
    already chose the precision, lowvram.planning)."""
    import torch

    from lowvram.vocab import WEIGHT_DTYPE

    return getattr(torch, WEIGHT_DTYPE[plan.mixed_precision])


def precision_compute_dtype(precision: str):
    """The torch dtype a precision computes in (vocab.COMPUTE_DTYPE): a 4-bit base's
    bnb_4bit_compute_dtype, and the autocast dtype of the measured and simulated steps."""
    import torch

    from lowvram.vocab import COMPUTE_DTYPE

    return getattr(torch, COMPUTE_DTYPE[precision])


def compute_dtype(plan):
    return precision_compute_dtype(plan.mixed_precision)


def autocast_dtype(precision: str):
    """The dtype the Trainer's autocast uses for ``precision`` (None for fp32: no autocast)."""
    return None if precision == "fp32" else precision_compute_dtype(precision)


def quantization_config(plan, vision: bool = False):
    """BitsAndBytesConfig for plan.quantization, or None. ``vision``: the tower and projector are
    skipped (bitsandbytes then skips only what it is given, so lm_head is named too)."""
    if plan.quantization == "none":
        return None
    from transformers import BitsAndBytesConfig

    skip = {"llm_int8_skip_modules": ["lm_head", *VISION_MODULES]} if vision else {}
    if plan.quantization == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, **skip)
    # QLoRA + FSDP or ZeRO-3 (peft's "Use PEFT QLoRA and FSDP" and "DeepSpeed" guides, accelerate's
    # QLoRA + ZeRO-3 example): the packed 4-bit weights are stored in the compute dtype so the
    # engine that shards them sees one float dtype across the module it flattens/partitions.
    storage = {"bnb_4bit_quant_storage": compute_dtype(plan)} if shards_parameters(plan) else {}
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="fp4" if plan.quantization == "fp4" else "nf4",
        bnb_4bit_use_double_quant=plan.quantization == "nf4-dq",
        bnb_4bit_compute_dtype=compute_dtype(plan),
        **storage, **skip,
    )


def _zero3(plan) -> bool:
    from lowvram.plan.memory.sharding import ZERO_OFFLOADS

    return ZERO_OFFLOADS.get(plan.offload, (0,))[0] == 3


def shards_parameters(plan) -> bool:
    """FSDP or DeepSpeed ZeRO-3: the parameters themselves are sharded across the processes."""
    return plan.offload.startswith("fsdp") or _zero3(plan)


def _device_map(plan):
    if _zero3(plan):
        # transformers refuses a device_map under ZeRO-3 (integrations/accelerate.py,
        # check_and_set_device_map); the bnb quantizer then places the base on
        # torch.cuda.current_device() (quantizer_bnb_4bit.update_device_map), which the
        # TrainingArguments' accelerate state has set to this process's LOCAL_RANK.
        return None
    if plan.device == "cpu":
        return {"": "cpu"}
    if plan.device == "cuda":
        return {"": int(os.environ.get("LOCAL_RANK", 0))}
    return None


# --------------------------------------------------------------------------------------------
# Loading


def load_tokenizer(recipe, source: str):
    from transformers import AutoTokenizer

    name = recipe.model.tokenizer
    if name:
        p = recipe.resolve_path(name)
        name = str(p) if p.exists() else name
    try:
        tok = AutoTokenizer.from_pretrained(
            name or source, revision=recipe.model.revision, trust_remote_code=recipe.model.trust_remote_code
        )
    except (OSError, ValueError) as e:
        if is_custom_code_refusal(e):
            raise custom_code_refused(name or source) from None
        if not name and not Path(source).is_dir():  # a hub id that is not there (or not cached)
            raise ModelError(f"model not found: {source} ({_first_line(e)})", _HUB_HINT) from None
        raise ModelError(f"cannot load the tokenizer of {name or source}: {_first_line(e)}",
                         "set model.tokenizer to a folder or hub id with a tokenizer") from None
    if tok.pad_token is None:
        # Padding positions carry label -100 and attention 0, so reusing EOS here is safe.
        tok.pad_token = tok.eos_token
    return tok


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def load_kwargs(plan, vision: bool = False) -> dict:
    """``from_pretrained`` keyword arguments for the plan's weights: dtype, attention kernel, and
    the bitsandbytes config and device map of a quantized base (shared with lowvram.check.builders).
    ``vision``: a checkpoint with a vision tower (has_vision)."""
    kwargs: dict[str, Any] = {"dtype": weight_dtype(plan), "attn_implementation": plan.attention}
    q = quantization_config(plan, vision)
    if q is not None:
        kwargs["quantization_config"] = q
        kwargs["device_map"] = _device_map(plan)
    elif plan.lora and is_svd_init(plan.lora_init) and plan.device == "cuda":
        # lora.init pissa: peft's pissa_init runs its SVD on the weight's device; loaded without
        # a device_map the base would sit on the CPU until the Trainer moves it, so every SVD
        # would run there (hours for a 7-8B model), not on the GPU the lora_init moment is planned
        # on. PiSSA runs on one process with offload none (plan/lora_init.init_conflicts).
        kwargs["device_map"] = _device_map(plan)
    return kwargs


def checkpoint_quant_method(source: str) -> str | None:
    """``quantization_config.quant_method`` of the checkpoint's config.json (a local folder, or a
    hub id whose config.json is cached: ``lowvram train`` fetches it before planning), or None."""
    from lowvram.plan.model.catalog import local_config

    config = local_config(source) or {}
    return (config.get("quantization_config") or {}).get("quant_method") or None


def prequantized_kwargs(plan, source: str) -> dict:
    """from_pretrained arguments for a checkpoint stored quantized by its publisher. gpt-oss ships
    its experts in MXFP4, which transformers runs for inference only: training loads them
    dequantized to bf16 (``Mxfp4Config(dequantize=True)``, as OpenAI's fine-tuning cookbook
    does), which is what the planner counts (lowvram.plan.model.moe: bf16 experts). bitsandbytes on
    top of it is refused."""
    if checkpoint_quant_method(source) != "mxfp4":
        return {}
    if plan.quantization != "none":
        raise ModelError(
            f"{source} is stored in MXFP4 (gpt-oss): lowvram trains it dequantized to bf16, and "
            f"bitsandbytes quantization ({plan.quantization}) on top of that is not supported",
            "set techniques.quantization: none (LoRA trains on the bf16 weights)")
    return mxfp4_dequantized(source)


def mxfp4_dequantized(source: str) -> dict:
    """``quantization_config=Mxfp4Config(dequantize=True)`` for an MXFP4 checkpoint (gpt-oss), {}
    for any other. Every load of a trained run's base goes through it (train, generate, merge):
    without it transformers keeps the experts packed (Mxfp4GptOssExperts, ``*_blocks``/``*_scales``)
    wherever its Triton kernels run (quantizer_mxfp4.validate_environment dequantizes only on a
    CPU or without triton/kernels), so the adapters trained on the bf16 experts would not fit and
    a merge would save packed tensors without their quantization config."""
    if checkpoint_quant_method(source) != "mxfp4":
        return {}
    from transformers import Mxfp4Config

    return {"quantization_config": Mxfp4Config(dequantize=True)}


def load_base_model(recipe, plan, source: str):
    from lowvram.plan.model.catalog import local_config

    vision = has_vision(local_config(source) or {})
    kwargs = {**load_kwargs(plan, vision), **prequantized_kwargs(plan, source),
              "trust_remote_code": recipe.model.trust_remote_code}
    if recipe.model.revision and not Path(source).is_dir():
        kwargs["revision"] = recipe.model.revision
    try:
        return model_class(vision).from_pretrained(source, **kwargs)
    except OSError as e:
        raise ModelError(f"model not found: {recipe.model.name_or_path} ({_first_line(e)})", _HUB_HINT) from None
    except ImportError as e:
        raise ModelError(f"cannot load {recipe.model.name_or_path} with attention={plan.attention} / "
                         f"quantization={plan.quantization}: {_first_line(e)}",
                         "install the missing package, or set techniques.attention: sdpa") from None
    except ValueError as e:
        if is_custom_code_refusal(e):
            raise custom_code_refused(recipe.model.name_or_path) from None
        raise ModelError(f"cannot load {recipe.model.name_or_path}: {_first_line(e)}",
                         "check techniques.attention / quantization against this model and device") from None


def no_kv_cache(model) -> None:
    """Switch the KV cache off: useless in training, it conflicts with recompute, and it disables
    transformers' packed-sequence detection. A multimodal config (Llava, Gemma-3, Mistral-3) keeps
    its own ``use_cache`` on its text config, which the language model reads: the top-level flag
    alone leaves a DynamicCache that copies every layer's keys and values in the forward (issue 29:
    Llava QLoRA packed, seed 110, +3.41% over its plan)."""
    model.config.use_cache = False
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    text.use_cache = False


def prepare_model(model, plan, seed: int | None = None, images: bool = False):
    """What training does to a loaded base before the Trainer gets it, in the Trainer's order:
    no KV cache, k-bit preparation and LoRA adapters (``seed``: their random init), then gradient
    checkpointing (non-reentrant), which the Trainer also switches on in ``train()``, and the
    tiled MLP (lowvram.train.build.tiled_mlp). The order
    matters: peft registers an input-requires-grad hook on the embedding when it wraps a model
    that is already checkpointing (and not quantized), which changes what the first layer keeps.
    lowvram.check.builders and the simulator prepare their models with this same function.
    ``images``: image + text data (format image_chat): Mllama's cross-attention layers train
    (lowvram.train.build.vision.frozen_modules)."""
    no_kv_cache(model)
    if has_vision(model.config):
        freeze_vision(model, images)
        text_input_grads_only(model)  # before peft's wrapping and checkpointing call it
    if plan.lora:
        if seed is not None:
            from transformers import set_seed

            set_seed(seed)  # the adapters' random init: same seed, same run
        model = apply_lora(model, plan, images)
    if plan.gradient_checkpointing:
        enable_checkpointing(model, plan)
    if getattr(plan, "tiled_mlp", False):
        from lowvram.train.build.tiled_mlp import enable_tiled_mlp

        # DeepSpeed's TiledMLP (lowvram.plan.memory.tiled); several processes without offload: DDP,
        # whose reducer takes each parameter's gradient once per backward (train/build/tiled_mlp.py)
        ddp = plan.offload == "none" and int(os.environ.get("WORLD_SIZE", "1")) > 1
        enable_tiled_mlp(model, plan.tiled_mlp_shards, one_grad_hook=ddp)
    return model


def prepare_kbit_model(model, gradient_checkpointing: bool, plan=None):
    """k-bit preparation without peft's fp32 upcast.

    peft's prepare_model_for_kbit_training casts every non-quantized param (embeddings, lm_head,
    norms) to fp32: about 2 GB on Llama-3-8B, and an fp32 residual stream. Like torchtune and
    Unsloth we keep them in the compute dtype; the loss is still computed in fp32 (transformers'
    ForCausalLMLoss and lowvram.train.build.loss upcast the logits) and the LoRA adapters stay fp32
    (peft autocast_adapter_dtype). The rest of peft's preparation, done here: freeze the base,
    and gradient checkpointing with use_reentrant=False (which needs no input require-grads hook:
    peft adds that only for the reentrant variant). The planner models exactly this
    (RunSetup.kbit_prepare=False)."""
    for param in model.parameters():
        param.requires_grad_(False)
    if gradient_checkpointing:
        if plan is not None:
            enable_checkpointing(model, plan)
        else:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def apply_lora(model, plan, images: bool = False):
    """k-bit preparation (if quantized) and LoRA adapters with the plan's lora settings."""
    from peft import LoraConfig

    from lowvram.plan.memory.lora_init import peft_init_lora_weights

    if plan.quantization != "none":
        model = prepare_kbit_model(model, plan.gradient_checkpointing, plan)
    targets = plan.lora_targets
    config = LoraConfig(
        r=plan.lora_r,
        lora_alpha=plan.lora_alpha,
        lora_dropout=plan.lora_dropout,
        use_dora=plan.lora_use_dora,
        use_rslora=plan.lora_use_rslora,
        init_lora_weights=peft_init_lora_weights(plan.lora_init),  # lowvram.plan.memory.lora_init
        target_modules=targets[0] if targets == ("all-linear",) else list(targets),
        # the language model's Linears only: the tower's q_proj/fc1 share their names
        exclude_modules=vision_pattern(model.config, images) if has_vision(model.config) else None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return _with_adapters(model, config, plan)
    except ValueError as e:
        raise LowvramError(f"lora.target_modules: {_first_line(e)}",
                           "use all-linear, or names of Linear modules in this model (e.g. [q_proj, v_proj])") from None


def _with_adapters(model, config, plan):
    """get_peft_model; under lora.init pissa on a CPU, inside lowvram.livebytes' tracker, so that
    the SVD's moment at model build (lowvram.plan.memory.lora_init) is part of the run's measured peak
    (``INIT_PEAK_ATTRIBUTE`` on the returned model; train.run reads it)."""
    from peft import get_peft_model

    if not is_svd_init(plan.lora_init):
        return get_peft_model(model, config)
    if plan.device != "cpu":
        out = get_peft_model(model, config)
    else:
        from lowvram.livebytes import LiveBytes

        tracker = LiveBytes()
        tracker.register(model)  # the loaded weights exist before the mode starts counting
        with tracker:
            out = get_peft_model(model, config)
        setattr(out, INIT_PEAK_ATTRIBUTE, int(tracker.peak_bytes))
    _keep_initial_adapter(out)
    return out


INIT_PEAK_ATTRIBUTE = "_lowvram_init_peak_bytes"
INITIAL_ADAPTER_ATTRIBUTE = "_lowvram_initial_adapter"


def _keep_initial_adapter(model) -> None:
    """Write the PiSSA-initialised adapters (lora_A, lora_B before any step) to a temporary folder
    on disk (not memory: the plan does not hold them), as peft's conversion reads them (their
    config with init_lora_weights True, so that loading them does not decompose the residual
    again), for the final save to turn the trained adapter into a plain LoRA (train.run
    _as_plain_lora; peft's ``path_initial_model_for_weight_conversion``): the PiSSA adapter only
    fits the residual base peft made at build, and with a fast SVD (pissa_niter_N, a random
    sketch) reloading it onto the original model would make a slightly different residual."""
    import atexit
    import copy
    import shutil
    import tempfile

    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    folder = Path(tempfile.mkdtemp(prefix="lowvram-initial-adapter-"))
    atexit.register(shutil.rmtree, folder, True)
    path = folder / "initial_adapter"
    path.mkdir()
    config = copy.deepcopy(model.peft_config["default"])
    config.init_lora_weights = True
    config.save_pretrained(str(path))
    state = {k: v.detach().to("cpu").contiguous() for k, v in get_peft_model_state_dict(model).items()}
    save_file(state, str(path / "adapter_model.safetensors"))
    setattr(model, INITIAL_ADAPTER_ATTRIBUTE, str(path))


def _weights_in(p) -> int:
    """How many model weights a parameter holds. A quantized bitsandbytes Params4bit packs two
    4-bit values per byte of its storage dtype (bnb_4bit_quant_storage: uint8 by default, the
    compute dtype under FSDP, where one bf16 element holds four); its quant_state keeps the
    unpacked shape (bitsandbytes/functional.py quantize_4bit: QuantState(shape=input_shape);
    nn/modules.py Params4bit._quantize). Not yet quantized (bnb_quantized False), it holds the
    weights themselves."""
    if p.__class__.__name__ != "Params4bit" or not getattr(p, "bnb_quantized", True):
        return p.numel()
    state = getattr(p, "quant_state", None)
    if state is not None and getattr(state, "shape", None) is not None:
        return math.prod(state.shape)
    return p.numel() * p.element_size() * 2  # two 4-bit values per byte of storage


def count_params(model) -> tuple[int, int]:
    trainable = total = 0
    for p in model.parameters():
        n = _weights_in(p)
        total += n
        if p.requires_grad:
            trainable += n
    return trainable, total


def load_model(recipe, plan) -> LoadedModel:
    """Model (with adapters when plan.lora) and tokenizer, ready for the Trainer."""
    quiet_libraries()
    t0 = time.perf_counter()
    source = resolve_model_location(recipe)
    cache_hit = None
    if recipe.model.gguf_file:
        from lowvram.train.build.gguf import gguf_folder

        folder, cache_hit = gguf_folder(source, recipe.model.gguf_file, recipe.model.trust_remote_code)
        source = str(folder)
    tokenizer = load_tokenizer(recipe, source)
    images = any(d.format == "image_chat" for d in recipe.data.datasets)
    model = prepare_model(load_base_model(recipe, plan, source), plan, seed=recipe.training.seed, images=images)
    trainable, total = count_params(model)
    return LoadedModel(model, tokenizer, source, time.perf_counter() - t0, cache_hit, trainable, total)
