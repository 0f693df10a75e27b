"""Step-time factors of the optimizers beyond AdamW's forms (techniques.OPTIMIZER_SLOWDOWN, the
search's speed key): not memory, but numbers set from measurements like the memory model's, kept in
the same way, each with the setup it was measured on and how its ratio to AdamW comes out
(docs/constants.md's last section)."""

from __future__ import annotations

from dataclasses import dataclass

# --------------------------------------------------------------------------------------------
# Step-time factors of the optimizers beyond AdamW's forms (techniques.OPTIMIZER_SLOWDOWN, the
# search's speed key): not memory, but numbers set from measurements like the ones above, so kept
# in the same way: each with the setup it was measured on and how its ratio to AdamW comes out.


@dataclass(frozen=True)
class StepTimeFactor:
    """One optimizer's step time over plain AdamW's, same model, same batch: from a published
    measurement of both where one exists, else an estimate that says so."""

    optimizer: str  # the plan optimizer (lowvram.vocab.OPTIMIZERS)
    value: float  # step time with it / with AdamW (techniques.setup_slowdown multiplies it in)
    measured_on: str  # the published setup: model, batch, hardware, the numbers read
    derived: str  # how the ratio to AdamW comes out of them (or why it is an estimate)
    source: str  # the paper table / README the numbers are read from


def apollo_table7_ratio(step_s: float, adamw_step_s: float, backward_s: float) -> float:
    """A step's time over AdamW's from APOLLO's Table 7 (optimizer step and backward seconds on one
    A100): forward + backward + optimizer step, the forward taken as half the backward (one matmul
    per weight against the backward's two; Kaplan et al. 2020's 2N and 4N FLOPs per token)."""
    fwd_bwd = 1.5 * backward_s
    return (fwd_bwd + step_s) / (fwd_bwd + adamw_step_s)


_APOLLO_T7 = ("APOLLO's Table 7 (Zhu et al. 2025, MLSys, arXiv:2412.05270): optimizer step time on one "
              "A100-80GB at seq_len 1024, LLaMA-1B at batch 16 and LLaMA-7B at batch 4 (the largest AdamW "
              "fits), the mean of 400 steps after 100 of warm-up, projections renewed every 200 steps: "
              "backward 1.069 / 0.712 s; step AdamW 0.036 / 0.173, APOLLO 0.051 / 0.159, GaLore 0.371 / "
              "2.874 s (1B / 7B)")
_APOLLO_SRC = "APOLLO paper Table 7 (sec. 5.3, 'Negligible Optimizer Step Overhead')"
_GALORE_T11 = ("GaLore's Table 11 (Zhao et al. 2024, ICML, arXiv:2403.03507, App. E): pre-training "
               "LLaMA-1B at a token batch of 256, tokens/s with the whole step / per layer: AdamW 1256.98 / "
               "1354.37, 8-bit Adam 1569.89 / 1205.31, 8-bit GaLore 1109.38 / 1019.63")
_GALORE_SRC = "GaLore paper Table 11 and sec. 5 ('Throughput overhead of GaLore')"
_IN_BACKWARD = ("torchtune's README 'Optimization flags' table (pytorch/torchtune bd2a0fc7c): Llama 3.2 3B, "
                "full_finetune_single_device, batch 2 of packed 4096-token sequences, bf16, one A100, with "
                "compile, chunked cross-entropy and activation checkpointing: 7210 tokens/s, 7309 once the "
                "AdamW step is fused into the backward")
_APOLLO_T7_AGAIN = "APOLLO's Table 7 (the setup under apollo_adamw)"
_GALORE_7B = apollo_table7_ratio(2.874, 0.173, 0.712)  # 3.18: SVD renewals dominate at 7B
# bitsandbytes' 8-bit step over the 32-bit one: adamw_8bit's factor (techniques.OPTIMIZER_8BIT)
_BNB_8BIT = 1.03
_GALORE_PER_LAYER = 1109.38 / 1019.63  # 8-bit GaLore's per-layer form, GaLore's Table 11: 1.088
_LOMO_ESTIMATE = (
    "no published step time of both at one batch was found: LOMO's paper sets its throughput against "
    "AdamW and SGD run under ZeRO-3 over RTX 3090s (about 11x for 7B, from the communication LOMO does "
    "without: OpenLMLab/LOMO#2), and AdaLomo's paper (arXiv:2310.10195) was not read here. An estimate: ")
_LOMO_WALK = (
    "; each parameter's hook walks model.named_parameters() (lomo_optim 0.1.1): 291 x 291 checks per "
    "backward for Llama-3.1-8B, 0.23 s on this project's CPU, host work the GPU's queued kernels hide "
    "when the step is GPU-bound; bench/results/optimizer_step_time.txt is the CPU cross-check")

OPTIMIZER_STEP_TIMES: tuple[StepTimeFactor, ...] = (
    StepTimeFactor(
        "adamw_in_backward", round(7210 / 7309, 2), _IN_BACKWARD,
        "7210 / 7309 = 0.986: the per-parameter fused AdamW in the backward is no slower; GaLore's Table 11 "
        "agrees (AdamW per layer 1256.98 / 1354.37 = 0.93 on LLaMA-1B at 256 tokens)",
        "torchtune README ('+ Fuse optimizer step into backward' row)"),
    StepTimeFactor(
        "apollo_adamw", 1.0, _APOLLO_T7,
        f"{apollo_table7_ratio(0.051, 0.036, 1.069):.3f} at 1B, {apollo_table7_ratio(0.159, 0.173, 0.712):.3f} "
        "at 7B (apollo_table7_ratio; without any forward at most 1.014): taken as AdamW's step time",
        _APOLLO_SRC),
    StepTimeFactor(
        "apollo_adamw_layerwise", 1.0, _APOLLO_T7_AGAIN,
        "as apollo_adamw: the same 32-bit step one parameter at a time in the backward, which costs AdamW "
        "nothing (adamw_in_backward); APOLLO's per-layer form itself is not measured",
        _APOLLO_SRC),
    StepTimeFactor(
        "galore_adamw", round(_GALORE_7B, 2), _APOLLO_T7_AGAIN,
        f"{_GALORE_7B:.2f} at 7B (apollo_table7_ratio), where the SVD of every projected matrix each 200 "
        f"steps (about ten minutes at 7B, APOLLO sec. 5.4) dominates; "
        f"{apollo_table7_ratio(0.371, 0.036, 1.069):.2f} at 1B, and GaLore's own Table 11 gives 8-bit "
        "GaLore 1256.98 / 1109.38 = 1.13 at 1B. Taken at 7B: lowvram reaches for GaLore only past what "
        "AdamW's forms fit (3B and up on 24 GB); a larger galore.update_proj_gap renews less often (not "
        "modelled)", _APOLLO_SRC + "; " + _GALORE_SRC),
    StepTimeFactor(
        "galore_adamw_layerwise", round(_GALORE_7B, 2), _APOLLO_T7_AGAIN,
        "as galore_adamw: galore_torch's 32-bit step already runs one parameter at a time; the per-layer "
        "form moves it into the backward, which costs a 32-bit step nothing (adamw_in_backward)",
        _APOLLO_SRC),
    StepTimeFactor(
        "galore_adamw_8bit", round(_GALORE_7B * _BNB_8BIT, 2), _APOLLO_T7_AGAIN,
        "galore_adamw x 1.03 (bitsandbytes' 8-bit step, adamw_8bit's factor): no table measures GaLore "
        "with both moment widths; GaLore's Table 11 (under galore_adamw_8bit_layerwise) has 8-bit GaLore at "
        "1.13 x AdamW on LLaMA-1B",
        _APOLLO_SRC + "; " + _GALORE_SRC),
    StepTimeFactor(
        "galore_adamw_8bit_layerwise", round(_GALORE_7B * _BNB_8BIT * _GALORE_PER_LAYER, 2), _GALORE_T11,
        f"galore_adamw_8bit x {_GALORE_PER_LAYER:.3f}: 8-bit GaLore 1109.38 tokens/s with the whole step, "
        "1019.63 per layer (GaLore sec. 5: 'improving the throughput by 8.8%' without per-layer updates); "
        "bitsandbytes' per-parameter steps cost its 8-bit Adam more (1569.89 / 1205.31 = 1.30)",
        _GALORE_SRC),
    StepTimeFactor(
        "lomo", 1.05, "not measured at one batch against AdamW",
        _LOMO_ESTIMATE + "an SGD step per parameter on fp32 copies inside the backward (AdamW's in-backward "
        "form costs nothing: adamw_in_backward)" + _LOMO_WALK,
        "estimate (lomo_optim's source); OpenLMLab/LOMO#2"),
    StepTimeFactor(
        "adalomo", 1.1, "not measured at one batch against AdamW",
        _LOMO_ESTIMATE + "LOMO's hook with Adafactor's factored second moment and a norm per update "
        "(AdaLomo's step), taken at twice LOMO's cost; GaLore's Table 11 measured transformers' "
        "Adafactor at 2.2 x AdamW (1256.98 / 581.02) at 256 tokens, where the step weighs most"
        + _LOMO_WALK.replace("is the CPU cross-check", "cannot cross-check it (AdaLomo needs CUDA)"),
        "estimate (lomo_optim's source); GaLore paper Table 11"),
    StepTimeFactor(
        "adamw_torch_8bit", round(3200 / 2900, 2),
        "torchao's Llama-2-7B full-bf16 fine-tune on one A100 with torchtune 52d1b838: 3200 tokens/s with "
        "fused AdamW, 2900 with ao's 8-bit AdamW", "3200 / 2900 = 1.10; the first step's compiles (once "
        "per shape) are not in the factor", "pytorch/ao torchao/optim/README.md"),
    StepTimeFactor(
        "adamw_torch_4bit", round(3200 / 2900, 2),
        "the same benchmark: 2900 tokens/s with ao's 4-bit AdamW", "3200 / 2900 = 1.10, as adamw_torch_8bit",
        "pytorch/ao torchao/optim/README.md"),
)
