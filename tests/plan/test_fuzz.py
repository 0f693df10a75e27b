"""The plan against the real run: `lowvram train` itself, two steps on the CPU, exact live bytes.

A fixed-seed handful of lowvram.difftest's random recipes (bench/plan_fuzz.py runs hundreds and
writes the error distribution to bench/results/plan_fuzz.txt). Target (issue 12): no run more
than 3% above its plan, none more than 10% off either way. Seeds that once missed it stay here
as regression cases, with what was wrong.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from lowvram.difftest import (  # noqa: E402
    ANY_LIMIT,
    FIRST_FAMILIES,
    OVER_LIMIT,
    TEN_FAMILIES,
    grpo_case,
    made_generation_bound,
    made_short_pairs,
    preference_case,
    random_case,
    run_case,
    write_data,
    write_model,
)

SEEDS = {
    3: "Qwen2 QLoRA, lora.dropout 0.05, bf16-mixed, checkpointing, Adafactor, eval",
    11: "Phi-3 (fused qkv / gate_up) LoRA, dropout 0.05, fp32, checkpointing, paged 8-bit AdamW",
    13: "Gemma (tied embeddings) LoRA, dropout 0.05, model.dtype float32 -> bf16-mixed",
    14: "Llama LoRA on three targets, dropout, bf16, checkpointing, SGD, packing",
    20: "Qwen3-MoE full fine-tuning, checkpointing, paged 8-bit AdamW, accumulation 2",
    25: "Phi-3 LoRA on the fused layers, dropout 0.1, bf16-mixed, 8-bit AdamW, chunked loss",
}

# Seeds of the ten-family draw (bench/plan_fuzz.py --families all) that missed, and what was wrong.
ALL_FAMILY_SEEDS = {
    100: "Gemma LoRA all-linear, dropout 0.05, bf16-mixed, checkpointing: the dropout masks were "
         "inside the layer backward's share, its fp32 mask-product gradient was not (+3.19%)",
    188: "Phi-3 LoRA fp32 incl. o_proj: o_proj reads a copy of SDPA's output (rotary by cat) (+3.42%)",
    206: "held out (seeds 200-299), Llama LoRA on o/up/v only, fp32, checkpointing: the MLP backward's "
         "t x I gradients with gate and down_proj frozen (+14.53%; plan.backward.mlp_backward_floor_bytes)",
    244: "held out (seeds 200-299), Mixtral full fine-tuning, bf16-mixed, checkpointing: the routed "
         "experts' combine starts the backward with k x t x h gradients (+3.66%; "
         "plan.backward.moe_combine_backward_bytes)",
    349: "held out (seeds 300-499), Mixtral QLoRA, checkpointing: the share covered the routed experts (-12.06%)",
    350: "held out (seeds 300-499), Qwen3-MoE LoRA, checkpointing: the same (-10.84%)",
    420: "held out (seeds 300-499), Llama QLoRA fp32, small vocabulary: the last layer's MLP gradients "
         "and dequantized weight with every activation alive (+3.04%)",
    470: "held out (seeds 300-499), Llama LoRA bf16-mixed, eager, 512 tokens: the last layer's fp32 "
         "softmax gradients (+5.94%)",
    653: "held out (seeds 500-699), Gemma-3 LoRA on gate/down_proj, eager, 512 tokens: layer 0's "
         "attention saves nothing under LoRA with Gemma's four norms too (-19.77%)",
    861: "held out (seeds 700-899), Gemma-3 full fp32, checkpointing, b4 s512, packed: the sliding "
         "bool mask was counted per row, though built once for the batch without real packing "
         "(-12.84%; -7.72% with real packing, whose masks are per row; -4.21% once the share "
         "left out the further norms in pure fp32)",
    1127: "held out (seeds 1100-1299), Gemma-3 full fp32, checkpointing, b4 s128: the recompute's "
          "backward share covered the four norms' and q/k norms' saved tensors (-10.18%)",
    1301: "held out (seeds 1300-1499), Mixtral full fp32, b2 s64: the last layer's expert weight "
          "gradients beside every layer's activations (+3.23%)",
    1397: "held out (seeds 1300-1499), Qwen2 QLoRA on k/down_proj, bf16-mixed, eager, 512 tokens: "
          "layer 0 keeps no 16-bit copy of its probabilities when v is frozen (-11.97%)",
}
# Real packing (several samples per window; the draw's packed recipes had one sample per window
# before lowvram.difftest wrote short rows for them): each once above its plan.
PACKING = {
    6: "SmolLM3 LoRA fp32, b4 s512: SDPA saves the packed block-diagonal mask in every layer "
       "(+21.49%; plan.activations.masked_layers)",
}
# Eager attention with gradient checkpointing (refused as not modelled before the recomputed
# layer's softmax backward and the checkpointed masks were counted): seeds of the ten-family draw
# made eager + checkpointing, each once far above its plan.
EAGER_CHECKPOINTING = {
    14: "Qwen2 LoRA bf16, b2 s512: three fp32 s x s tensors at the softmax backward, a bf16 mask (+13.3%)",
    18: "Gemma LoRA on v_proj, fp32, dropout, b1 s512: the same in fp32, an fp32 mask (+18.2%)",
    96: "Qwen3-MoE LoRA all-linear, fp32, b1 s64: the merged expert weight's gradient (+4.0%; "
        "plan.backward.expert_weight_gradient_bytes)",
    1013: "held out (eager + checkpointing seeds 1000-1099), Gemma-3 full bf16, s256: the softmax "
          "backward of the first layer, with nearly every gradient made (+3.42%)",
}
# Long-context tiled-MLP runs (issue 26: difftest.random_case(tiled=1.0), the dense cases made
# tiled by difftest.made_tiled), the first seeds of bench/results/plan_fuzz_tiled.txt at 512 tokens.
TILED = {
    1: "Gemma full bf16, checkpointing, eager, s512, DeepSpeed's shard rule (+0.16%)",
    3: "Phi-3 QLoRA (fused gate_up), dropout 0.1, bf16-mixed, 16 shards, no checkpointing (-2.79%)",
    5: "SmolLM3 full bf16, checkpointing, s512, 16 shards (+0.09%)",
    12: "Gemma-3 LoRA all-linear, dropout 0.1, bf16, checkpointing, s512: the recomputed layer's SDPA "
        "mask and a shard's fp32 input cast and dropped input at down_proj (+8.46% before, +2.79%)",
    48: "held out (seeds 46-65), OLMo-2 LoRA on q/k/o/gate/down_proj, bf16-mixed, eager, no "
        "checkpointing: layer 0 (tiled, so traced without its MLP: no standard block) was counted "
        "whole, its 16-bit probabilities too, which v frozen keeps none of (-11.15%; -1.73%)",
    50: "held out (seeds 46-65), Gemma-3 LoRA all-linear, bf16-mixed, checkpointing, b2 s1024, 16 shards: "
        "the last layer's recompute counted a sliding-window mask its full-attention layer never makes "
        "(-6.09%; -0.71%)",
    66: "held out (seeds 66-95), Qwen2 LoRA all-linear, bf16, checkpointing, b2 s1024, 4 shards: a shard's "
        "recompute at down_proj's adapter holds the product itself and down_proj's outputs beside "
        "peft's fp32 cast (+10.28%; +2.51%)",
}
# b2 s1024 with checkpointing: ~30 s each (make test-all); and 5, full bf16 fine-tuning with checkpointing
# as 1 is (16 shards as 3)
SLOW_TILED = {5, 50, 66}
# One-adapter recipes the random draw rarely makes (found by varying held-out seed 272's targets,
# precision and method on a 2-layer Llama with checkpointing), each once above its plan.
ADAPTER_OVERRIDES = {
    "lora bf16 down_proj only": (dict(method="lora", precision="bf16", lora_targets=("down_proj",)),
                                 "peft's fp32 cast of the MLP product (+5.32%)"),
    "qlora bf16 up_proj only": (dict(method="qlora", precision="bf16", lora_targets=("up_proj",)),
                                "bnb's cloned result beside lora_B's (+8.00%)"),
    "qlora bf16-mixed q_proj, v_proj": (dict(method="qlora", precision="bf16-mixed",
                                             lora_targets=("q_proj", "v_proj")),
                                        "the MLP product's gradients are fp32 after kbit prep (+6.66%)"),
}
# Layer 0 under LoRA saves only what lies downstream of an adapter (the embedding is frozen).
OVERRIDES = {
    "phi3 down_proj only": (188, dict(lora_targets=("down_proj",))),  # was -15%
    "llama o_proj, up_proj": (188, dict(family="llama", lora_targets=("o_proj", "up_proj"))),
}


def _check(case, tmp_path, why):
    out = run_case(case, tmp_path)
    assert out.error is None, f"{case.label()}: {out.error}"
    assert out.details["peak_memory_kind"] == "live tensor bytes (exact, CPU)"
    assert out.ok, (f"{case.label()} ({why}): measured {out.measured_bytes:,} predicted "
                    f"{out.predicted_bytes:,} ({out.ratio:+.2%}; limits +{OVER_LIMIT:.0%}, "
                    f"+-{ANY_LIMIT:.0%})")
    return out


# 11 runs in make test-all only: 188's recipe (Phi-3 LoRA on the four fused layers, fp32, paged 8-bit
# AdamW) with dropout and checkpointing, each of which runs in make test on other families (3, 14, 206)
SLOW_SEEDS = {11}


@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW_SEEDS else s for s in SEEDS])
def test_run_stays_within_its_plan(seed, tmp_path):
    _check(random_case(seed, families=FIRST_FAMILIES), tmp_path, SEEDS[seed])  # the recipes these seeds were kept for


# seed 100 (~15 s) runs in make test-all only; so does 349 (Mixtral QLoRA, the slowest run of the
# file: its fix, the layer share without the routed experts, is 350's, Qwen3-MoE, in make test);
# every other fixed miss runs in make test
SLOW_FAMILY_SEEDS = {100, 349}


@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW_FAMILY_SEEDS else s
                                  for s in ALL_FAMILY_SEEDS])
def test_ten_family_regressions_stay_within_their_plan(seed, tmp_path):
    _check(random_case(seed, families=TEN_FAMILIES), tmp_path, ALL_FAMILY_SEEDS[seed])


@pytest.mark.parametrize("seed", list(EAGER_CHECKPOINTING))
def test_eager_attention_with_checkpointing_stays_within_its_plan(seed, tmp_path):
    from dataclasses import replace

    case = replace(random_case(seed, families=TEN_FAMILIES), attention="eager", gradient_checkpointing=True)
    _check(case, tmp_path, EAGER_CHECKPOINTING[seed])


@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.slow) if s in SLOW_TILED else s for s in TILED])
def test_tiled_mlp_runs_stay_within_their_plan(seed, tmp_path):
    pytest.importorskip("deepspeed")
    case = random_case(seed, families=TEN_FAMILIES, tiled=1.0)
    assert case.tiled_mlp
    _check(case, tmp_path, TILED[seed])


# The chunked loss's chunk sized to a budget (issue 26 item 2: difftest.random_case(chunk=1.0),
# run_case passes the --vram difftest.chunk_budget finds): bench/results/plan_fuzz_chunk_heldout.txt.
CHUNKED = {2: "Llama LoRA fp32, checkpointing, SGD, b2 s512, the plan takes 256-token chunks (-0.07%)"}


@pytest.mark.slow  # two plans' binary search and a run: ~20 s (make test-all)
@pytest.mark.parametrize("seed", list(CHUNKED))
def test_a_loss_chunk_sized_to_the_budget_runs_as_planned(seed, tmp_path):
    case = random_case(seed, families=TEN_FAMILIES, chunk=1.0)
    assert case.loss == "chunked" and case.loss_chunk_tokens < 1024
    out = _check(case, tmp_path, CHUNKED[seed])
    assert out.details["loss_chunk_tokens"] == case.loss_chunk_tokens  # the plan lowvram train ran took it


# Preference recipes (bench/plan_fuzz.py --preference, issue 28): TRL's trainers on pairs of unequal
# lengths, or (short) on pairs below seq_len compared with the plan at the longest tokenized pair
PREFERENCE = {
    12: ("Gemma-3 ORPO LoRA, checkpointing, b2 s512: the checkpoints keep a bool mask of all four "
         "padded rows per attention type, not one for the batch (+3.36%)", False),
    13: ("Mistral ORPO LoRA bf16-mixed, b1 s128 on 65-token pairs: the plan at the longest pair "
         "(-1.30%; -39% against the plan at seq_len)", True),
}


@pytest.mark.parametrize("seed", [pytest.param(s, marks=pytest.mark.slow) if s == 12 else s for s in PREFERENCE])
def test_preference_recipes_stay_within_their_plan(seed, tmp_path):
    pytest.importorskip("trl")
    why, short = PREFERENCE[seed]
    case = preference_case(seed, TEN_FAMILIES)
    out = _check(made_short_pairs(case) if short else case, tmp_path, why)
    assert bool(out.details["data_longest_tokens"]) == short  # short pairs: predicted at their length


# GRPO/RLOO regressions (bench/plan_fuzz.py --grpo): bench/results/plan_fuzz_grpo_heldout_960-979.txt.
GRPO = {977: "Llama GRPO full fine-tuning bf16-mixed, beta 0.04, checkpointing: -18.10% before the run "
             "registered TRL's reference model (loaded in GRPOTrainer.__init__) with the tracker"}


@pytest.mark.slow  # a generation round and 16 micro-steps: ~1 min of CPU (make test-all)
@pytest.mark.parametrize("seed", list(GRPO))
def test_grpo_recipes_stay_within_their_plan(seed, tmp_path):
    pytest.importorskip("trl")
    _check(grpo_case(seed), tmp_path, GRPO[seed])


# Generation-bound GRPO/RLOO regressions (bench/plan_fuzz.py --grpo --grpo-generation):
# bench/results/plan_fuzz_grpo_gen_heldout_980-989.txt, _990-1039.txt, _1060-1079.txt. The fast checks of the same
# fixes run in make test (tests/train/test_grpo.py the reference adapter, tests/plan/test_grpo.py
# the paged cache against transformers' own).
GRPO_GENERATION = {
    982: "Qwen2 RLOO QLoRA bf16: +5.93% while TRL's RLOOTrainer kept a frozen 'ref' adapter at beta 0",
    1012: "Gemma-3 RLOO QLoRA fp32, paged engine: +10.82% before the paged cache's sectors and the masks of "
          "two attention groups were planned as transformers sizes them",
    1073: "Gemma-3 GRPO full bf16-mixed, 64 + 96 tokens past a window of 128: -8.94% while every layer's cache "
          "was counted at every token (a sliding layer keeps its window)",
}


@pytest.mark.slow  # a generation round of 16 completions and 16 micro-steps each (make test-all)
@pytest.mark.parametrize("seed", list(GRPO_GENERATION))
def test_generation_bound_grpo_recipes_stay_within_their_plan(seed, tmp_path):
    pytest.importorskip("trl")
    _check(made_generation_bound(grpo_case(seed)), tmp_path, GRPO_GENERATION[seed])


# Image + text recipes (issue 29 item 3: difftest.made_images, bench/plan_fuzz.py --families images
# --images): bench/results/plan_fuzz_images_*.txt.
IMAGES = {0: "Llava LoRA bf16-mixed, checkpointing, chunked, b2 s512, eval: +4.17% before the pixels of "
             "accelerate's prefetched batch and peft's embedding leaf were planned (plan/memory/images.py)"}


@pytest.mark.parametrize("seed", list(IMAGES))
def test_image_recipes_stay_within_their_plan(seed, tmp_path):
    from lowvram.difftest import IMAGE_FAMILIES, made_images

    case = made_images(random_case(seed, families=IMAGE_FAMILIES))
    _check(case, tmp_path, IMAGES[seed])


# Llama-3.2-Vision image + text recipes (issue 47: bench/plan_fuzz.py --families mllama --images):
# bench/results/plan_fuzz_mllama_images_*.txt.
MLLAMA_IMAGES = {1: "full bf16, checkpointing, b1 x 2 accumulation: +2.81% while the plan counted two "
                    "micro-batches' tiles; the Trainer holds the step's two and accelerate the next "
                    "(plan/memory/images.py batches_alive)"}


@pytest.mark.parametrize("seed", list(MLLAMA_IMAGES))
def test_mllama_image_recipes_stay_within_their_plan(seed, tmp_path):
    from lowvram.difftest import MLLAMA_FAMILIES, made_images

    case = made_images(random_case(seed, families=MLLAMA_FAMILIES))
    _check(case, tmp_path, MLLAMA_IMAGES[seed])


# A 4/8-bit base with checkpointing at small widths, where the layer backward's terms are large
# beside the activations (plan.backward.quantized_base_backward_bytes, dora.recompute_weight_norm_bytes).
QLORA_RECOMPUTE = {
    "extended 142": ("SmolLM3 QLoRA DoRA on o_proj, bf16, checkpointing, b1 s64: the dequantized weight "
                     "stacked on the layer backward's share, and o_proj's recomputed weight norm beside the "
                     "whole layer's tensors, though the MLP's are not recomputed yet (-17.45%)"),
    "mllama 878": ("held out (mllama seeds 850-879), QLoRA fp32 on down_proj and v_proj, dropout 0.05, "
                   "checkpointing, chunked loss: the fp32 dropout gradient, which takes the place of the "
                   "dropped input lora_A frees, stacked on the MLP product's gradients (-11.09%)"),
}


@pytest.mark.parametrize("name", list(QLORA_RECOMPUTE))
def test_qlora_recompute_at_small_widths_stays_within_its_plan(name, tmp_path):
    from lowvram.difftest import MLLAMA_FAMILIES

    draw, seed = name.split()
    case = (random_case(int(seed), families=TEN_FAMILIES, extended=True) if draw == "extended"
            else random_case(int(seed), families=MLLAMA_FAMILIES))
    _check(case, tmp_path, QLORA_RECOMPUTE[name])


# Layer 0 under LoRA where an adapter leaves part of it without gradients (held out, seeds 1700-1739;
# plan.activations._first_layer_scores_grad, _first_layer_grads on OLMo-2's post-norm block).
LAYER_ZERO = {
    1703: ("OLMo-2 LoRA on up_proj only, fp32, no checkpointing: its layer 0 counted whole, though "
           "its attention, norms and gate save nothing (-11.83%)"),
    1729: ("Llama LoRA on v/o/down_proj, bf16-mixed, eager: layer 0's fp32 softmax output counted, "
           "though its scores need no gradient with q and k frozen (-10.80%)"),
}


@pytest.mark.parametrize("seed", list(LAYER_ZERO))
def test_layer_zero_without_gradients_stays_within_its_plan(seed, tmp_path):
    _check(random_case(seed, families=TEN_FAMILIES), tmp_path, LAYER_ZERO[seed])


@pytest.mark.parametrize("seed", list(PACKING))
def test_packed_recipes_stay_within_their_plan(seed, tmp_path):
    from dataclasses import replace

    _check(replace(random_case(seed, families=TEN_FAMILIES), packing=True), tmp_path, PACKING[seed])


def test_packed_windows_of_one_sample_are_predicted_as_plain_rows(tmp_path):
    """data.packing on data whose samples are as long as seq_len: no window holds two samples, so
    no packed mask is built. The plan (made before the data is read) counts the masks; the
    prediction at the data (metrics predicted_peak_bytes_at_data) does not, and meets the target."""
    from dataclasses import replace

    from typer.testing import CliRunner

    from lowvram.cli import app
    from lowvram.difftest import recipe_text

    case = replace(random_case(6, families=TEN_FAMILIES), packing=True, seq_len=256)
    model = write_model(case, tmp_path / "model")
    data = write_data(replace(case, packing=False), tmp_path / "data.jsonl")  # rows > seq_len
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(recipe_text(case, model, data, tmp_path / "run"))
    result = CliRunner().invoke(app, ["train", str(recipe), "--json", "--overwrite"])
    assert result.exit_code == 0, result.stderr
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["data_windows_one_sample"] and m["data_longest_tokens"] == 256
    assert m["predicted_peak_bytes_at_data"] < m["predicted_peak_bytes"]
    ratio = m["peak_memory_bytes"] / m["predicted_peak_bytes_at_data"] - 1
    assert -ANY_LIMIT <= ratio <= OVER_LIMIT, ratio


def test_packed_rows_fill_their_windows_with_several_samples(tmp_path):
    """The differential test's packed data is what packing is for: four samples of exactly
    seq_len / 4 tokens (with the eos the text format appends) in every window."""
    from dataclasses import replace

    from lowvram.testing import build_tokenizer

    case = replace(random_case(6, families=TEN_FAMILIES), packing=True, seq_len=128)
    tok = build_tokenizer()
    rows = [json.loads(line)["text"] for line in write_data(case, tmp_path / "d.jsonl").read_text().splitlines()]
    assert len(rows) == 96
    assert {len(tok(r, add_special_tokens=False)["input_ids"]) + 1 for r in rows} == {128 // 4}
    assert len(set(rows)) > 90  # random words, not one row repeated


@pytest.mark.parametrize("name", list(ADAPTER_OVERRIDES))
def test_one_adapter_recipes_stay_within_their_plan(name, tmp_path):
    from dataclasses import replace

    changes, why = ADAPTER_OVERRIDES[name]
    _check(replace(random_case(272, families=TEN_FAMILIES), family="llama", **changes), tmp_path, why)


@pytest.mark.parametrize("name", list(OVERRIDES))
def test_layer_zero_under_lora_is_counted_from_the_first_adapter(name, tmp_path):
    from dataclasses import replace

    seed, changes = OVERRIDES[name]
    out = _check(replace(random_case(seed), **changes), tmp_path, name)
    assert abs(out.ratio) <= 0.01  # exact terms: within 1% (was -15% for Phi-3 on down_proj only)


@pytest.mark.parametrize("techniques", ["", "techniques: {lora: on}\n"], ids=["defaults", "lora on"])
def test_a_new_users_recipe_is_predicted_within_10_percent(techniques, tmp_path):
    """Only model, data, seq_len and batch (and `lora: on`), as a new user writes it: every other
    value is lowvram's default (lora.dropout was 0.05 and not modelled: +44% over the plan)."""
    from typer.testing import CliRunner

    from lowvram.cli import app

    case = random_case(0, families=("llama",))
    model = write_model(case, tmp_path / "model")
    data = write_data(case, tmp_path / "data.jsonl")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model: {{name_or_path: {model}}}\n"
        f"data: {{datasets: [{{path: {data}, format: text}}]}}\n"
        f"training: {{seq_len: 256, batch_size: 2, max_steps: 2, output_dir: {tmp_path / 'run'}}}\n"
        + techniques)
    result = CliRunner().invoke(app, ["train", str(recipe), "--json"])
    assert result.exit_code == 0, result.stderr
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    ratio = m["peak_memory_bytes"] / m["predicted_peak_bytes"] - 1
    assert abs(ratio) <= 0.10 and ratio <= OVER_LIMIT, ratio


def test_cases_are_reproducible_and_valid():
    from pathlib import Path

    from lowvram.difftest import recipe_text
    from lowvram.recipe import parse_recipe

    assert random_case(7) == random_case(7) != random_case(8)
    for seed in range(60):
        case = random_case(seed)
        text = recipe_text(case, Path("/m"), Path("/d.jsonl"), Path("/o"))
        recipe = parse_recipe(text)  # every generated recipe is a valid one
        assert recipe.training.seq_len == case.seq_len
        assert (recipe.techniques.lora == "on") == (case.method != "full")
