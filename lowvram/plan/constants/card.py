"""Fitted constants of what surrounds the tensors: the CUDA context, the caching allocator's slack,
the training process's host RAM, the safety margin a plan leaves and a card's memory as sold and as
CUDA reports it (setup.cuda_overheads, memory.estimate_memory's host RAM, request.Budget,
cards.read_vram). Entries of the one table (lowvram/plan/constants/__init__.py)."""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from lowvram.plan.constants.entry import FittedConstant

# --------------------------------------------------------------------------------------------
# CUDA overheads (setup.cuda_overheads)

CUDA_CONTEXT_BYTES = FittedConstant(
    "CUDA_CONTEXT_BYTES", 300 * 2**20, "300 MiB",
    "device memory of the CUDA context (libraries, kernels) beyond every tensor",
    "setup.cuda_overheads().context_bytes",
    "median of 3 published nvidia-smi readings right after CUDA init with lazy module loading "
    "(~300 MB in pytorch/pytorch#107667, ~400 MB in #109888, 256 MiB in invoke-ai/InvokeAI#9413; "
    "bench/gpu_truth/cuda_context.yaml)",
    "readings 256-400 MiB",
    "no held-out nvidia-smi row is scored; Unsloth's longest-context-per-card rows (information "
    "only, settings assumed) come out -10% to +1%")

ALLOCATOR_ONCE_FRACTION = FittedConstant(
    "ALLOCATOR_ONCE_FRACTION", 0.015, "0.015 x (weights + optimizer state)",
    "the caching allocator's slack (reserved - allocated) on the bytes allocated once and kept: "
    "the weights loaded at start, the optimizer state made at the first step",
    "setup.cuda_overheads().allocator_parts: loaded_once",
    "a stated bound, not a mean: the largest share of reserved - allocated over allocated in 4 "
    "published pairs read right after the model was loaded, before any step (1.46%, rounded up; "
    "torchtune's own loaders, bf16 and NF4 quantized on the GPU, expandable segments off; "
    "bench/gpu_truth/allocator_pairs.yaml). No such pair is published for transformers + "
    "bitsandbytes or with expandable segments on: both are taken at the same bound",
    "load pairs: 0.14% to 1.46% (least squares 0.9%)",
    "as ALLOCATOR_CHURN_FRACTION (the two are scored together)")

ALLOCATOR_CHURN_FRACTION = FittedConstant(
    "ALLOCATOR_CHURN_FRACTION", 0.23, "0.23 x (tensors - once)",
    "the caching allocator's slack on what churns (activations, logits, gradients, "
    "temporaries: freed and allocated again every step) and the kernels training loads beyond the "
    "initial context, with expandable segments off (a PYTORCH_CUDA_ALLOC_CONF the user set "
    "without them)",
    "setup.cuda_overheads().allocator_parts: churn",
    "least-squares slope, through the origin, of (nvidia-smi peak - peak allocated - context - "
    "ALLOCATOR_ONCE_FRACTION x once) over (peak allocated - once) in 9 single-GPU Hugging Face "
    "Trainer runs of the fms-acceleration benchmark (expandable segments off; once = the plan's "
    "weights and optimizer state, or stated arithmetic for the 4 runs the planner cannot plan; "
    "bench/gpu_truth/fms_acceleration.yaml)",
    "device from the measured allocated: median |error| 4.6%, worst -19.7% / +4.6% (the old single "
    "12% of all tensors: 6.4%, -18.4% / +6.4%)",
    "see bench/results/published_accuracy.txt (held-out reserved rows and overhead checks)")

ALLOCATOR_CHURN_FRACTION_EXPANDABLE = FittedConstant(
    "ALLOCATOR_CHURN_FRACTION_EXPANDABLE", 0.13, "0.13 x (tensors - once)",
    "ALLOCATOR_CHURN_FRACTION with PyTorch's expandable segments on (what `lowvram train` sets "
    "unless PYTORCH_CUDA_ALLOC_CONF is set)",
    "setup.cuda_overheads().allocator_parts: churn",
    "ALLOCATOR_CHURN_FRACTION x 0.55, rounded up: 0.55 is the larger of two published upper bounds "
    "of slack(on) / slack(off) for one run measured both ways, (reserved on - allocated floor) / "
    "(reserved off - allocated floor): 0.455 for torchtune's Llama-3-8B QLoRA "
    "(meta-pytorch/torchtune#1185: 16.39 -> 10.83 GiB reserved, >= 6.19 GiB allocated), 0.54 for "
    "a 2-GPU Qwen2.5-7B run (nvidia-cosmos/cosmos-rl#388: 126.97 -> 96.61 GB, >= 60.81 GB). No "
    "published run gives reserved and peak allocated with expandable segments on",
    "a bound: both runs' slack fell by at least 45%",
    "not scored: every published row with a measured slack ran without expandable segments")


# --------------------------------------------------------------------------------------------
# Host RAM (setup.PROCESS_HOST_BYTES, memory.estimate_memory)

PROCESS_HOST_BYTES = FittedConstant(
    "PROCESS_HOST_BYTES", 2 * 2**30, "2 GiB",
    "host RAM of one training process before any tensor of the run (torch + CUDA libraries)",
    "setup.PROCESS_HOST_BYTES (memory.estimate_memory, check.simulate)",
    "RSS of an idle `import torch` process", "--", "not measured")

CHECKPOINT_SHARD_BYTES = FittedConstant(
    "CHECKPOINT_SHARD_BYTES", 5 * 10**9, "5 GB",
    "host RAM of one checkpoint shard staged while loading (at most the whole model)",
    "memory.estimate_memory (cpu_ram_bytes)",
    "not fitted: transformers' default max_shard_size (5GB) for the shards a hub checkpoint is "
    "saved in", "--", "not measured")


# --------------------------------------------------------------------------------------------
# The budget (request.Budget): chosen, not fitted

SAFETY_MARGIN_FRACTION = FittedConstant(
    "SAFETY_MARGIN_FRACTION", 0.05, "5% of the card",
    "memory a plan leaves unused for what the model does not see (other processes on the card, "
    "fragmentation spikes, the first-step warm-up)",
    "request.MARGIN_FRACTION (Budget, vram_needed_bytes)",
    "chosen, not fitted: a judgement", "--", "not measured")

SAFETY_MARGIN_MIN_BYTES = FittedConstant(
    "SAFETY_MARGIN_MIN_BYTES", 256 * 2**20, "at least 256 MiB",
    "the safety margin's floor on a real card", "request.MIN_MARGIN_BYTES",
    "chosen, not fitted: a judgement", "--", "not measured")


@dataclass(frozen=True)
class CardReading:
    """A card's total memory as CUDA reports it on Linux (torch.cuda.mem_get_info's total, the
    "total capacity" of PyTorch's out-of-memory message, deviceQuery's global memory), published."""

    card: str
    sold_gib: int  # the size it is sold as ("12 GB" is 12 GiB of memory chips)
    reported_bytes: int
    source: str  # where the reading was published

    @property
    def fraction(self) -> float:
        return self.reported_bytes / (self.sold_gib * 2**30)


def _gib_shown(gib: float) -> int:
    """A reading shown as "23.65 GiB": the bytes it stands for, rounded down."""
    return int(gib * 2**30)


# Linux readings: Windows (WDDM) shows the size as sold (24.00 GiB for a Titan RTX in
# lllyasviel/FramePack#79, 12.00 GiB for an RTX 3060 in ToTheBeginning/PuLID#13), Linux a little
# less: the driver keeps the rest. nvidia-smi's total is the size as sold on consumer cards
# (12288MiB for an RTX 3060 in geerlingguy/raspberry-pi-pcie-devices#790, 24576MiB for an RTX 3090
# in noonghunna/club-3090#390) and is not what CUDA lets a process allocate.
CARD_READINGS: tuple[CardReading, ...] = (
    CardReading("GeForce RTX 3080 10 GB", 10, _gib_shown(9.78), "zai-org/CogVideo#34 (OOM message)"),
    CardReading("GeForce RTX 3060 12 GB", 12, _gib_shown(11.75), "Kunhao-Liu/StyleGaussian#12 (OOM message)"),
    CardReading("RTX A4000 16 GB", 16, _gib_shown(15.61), "DengKaiCQ/VGGT-Long#6 (OOM message)"),
    CardReading("GeForce RTX 3090 24 GB", 24, _gib_shown(23.70),
                "GaoLii/DSP#10, xiaoxiangAQ/GAS-Net#7 (OOM messages)"),
    CardReading("GeForce RTX 4090 24 GB", 24, _gib_shown(23.61),
                "pinokiofactory/flux-webui#11 (23.61 GiB; 23.64-23.68 in ali-vilab/VGen#104, "
                "MotrixLab/AiOS#29, zai-org/CogVideo#36)"),
    CardReading("GeForce RTX 5090 32 GB", 32, 33_677_180_928,
                "aikitoria/open-gpu-kernel-modules#1 (deviceQuery: 32117 MBytes)"),
    CardReading("A100-SXM4-40GB", 40, 42_298_834_944,
                "bottlerocket-os/bottlerocket#3873 (deviceQuery: 40339 MBytes; nvidia-smi 40960MiB)"),
)

CARD_REPORTED_FRACTION = FittedConstant(
    "CARD_REPORTED_FRACTION", Fraction(39, 40), "97.5% of the size as sold",
    "the share of a card's memory (as sold: --vram 12GB is a 12 GiB card) that CUDA reports as the "
    "card's total on Linux; the budget of --vram NGB",
    "cards.read_vram (Budget.vram_bytes)",
    "the lowest of the published readings in the card table below (RTX A4000: 15.61 of 16 GiB, "
    "97.6%), rounded down",
    "every reading at or above it (97.6%-98.8%)", "--")
