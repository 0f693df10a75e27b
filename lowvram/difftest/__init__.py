"""Differential test of the plan against the real run: random valid recipes, tiny random-init
models of several families, `lowvram train` itself for two steps on the CPU with the exact
live-bytes tracker, and the measured peak compared with the plan's prediction.

Nothing here is a copy of the training path: each case writes a model folder (config, random
weights, a tokenizer trained here), a data file and a recipe with only the keys a user would
write, and runs the `lowvram train` command in this process (Typer's runner over the real CLI).
The run records ``peak_memory_bytes`` (live tensor bytes, exact on a CPU) and
``predicted_peak_bytes`` (the plan it printed) in ``metrics.json``.

Drawing a case (cases.py) is apart from writing its files (files.py) and running it (run.py); every
name is read from here. Used by tests/plan/test_fuzz.py (a fixed-seed handful) and
bench/plan_fuzz.py (hundreds).
Target (issue 12): no run more than 3% above its plan, none more than 10% off either way.
"""

from __future__ import annotations

from lowvram.difftest.cases import (
    ANY_LIMIT,
    FAMILIES,
    FIRST_FAMILIES,
    GRPO_FAMILIES,
    IMAGE_CASE_FAMILIES,
    IMAGE_FAMILIES,
    MLLAMA_FAMILIES,
    MULTIMODAL_FAMILIES,
    OVER_LIMIT,
    QWEN_VL_IMAGE_FAMILIES,
    TEN_FAMILIES,
    VISION_FAMILIES,
    Case,
    chunk_budget,
    grpo_case,
    made_apollo,
    made_chunked,
    made_galore,
    made_generation_bound,
    made_images,
    made_in_backward,
    made_lomo,
    made_paged,
    made_pissa,
    made_short_pairs,
    made_tiled,
    made_torchao,
    preference_case,
    random_case,
)
from lowvram.difftest.files import (
    mllama_cross_layers,
    recipe_text,
    write_data,
    write_model,
)
from lowvram.difftest.run import (
    Outcome,
    run_case,
)

__all__ = ["ANY_LIMIT", "Case", "FAMILIES", "FIRST_FAMILIES", "IMAGE_CASE_FAMILIES", "IMAGE_FAMILIES",
           "QWEN_VL_IMAGE_FAMILIES", "MLLAMA_FAMILIES",
           "MULTIMODAL_FAMILIES", "TEN_FAMILIES", "VISION_FAMILIES", "OVER_LIMIT", "Outcome", "chunk_budget",
           "made_apollo", "made_chunked", "made_galore", "made_images", "made_in_backward", "made_lomo",
           "made_pissa", "mllama_cross_layers", "grpo_case", "GRPO_FAMILIES", "made_generation_bound", "made_paged", "made_short_pairs", "made_tiled", "made_torchao",
           "preference_case",
           "random_case", "recipe_text",
           "run_case", "write_data", "write_model"]
