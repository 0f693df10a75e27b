"""`lowvram generate` on a QLoRA run (issue 24 item 5): the base loads as it trained (4-bit, the
run's BitsAndBytesConfig, through train/build/model.py's builder; bitsandbytes 0.50 runs 4-bit on the
CPU), and the weights are checked against the free memory before anything is loaded (merge's
check, shared through train/after/artifacts.py)."""

from __future__ import annotations

import json

import pytest

from lowvram.hardware import Device, Hardware
from lowvram.train.after.artifacts import BaseModel, dense_size, trained_size
from lowvram.train.after.generate import check_fits
from tests.train.test_after_training import assert_user_error, cli
from tests.train.test_e2e import write_recipe


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("qlora")
    recipe = write_recipe(tmp, tiny_model_dir, steps=2, techniques="lora: on, quantization: nf4-dq")
    result = cli("train", str(recipe))
    assert result.exit_code == 0, result.output
    return tmp / "out"


def _stored_bytes(model) -> int:
    """Bytes of every parameter and buffer, and of each 4-bit weight's quantization state
    (absmax, the code and, double-quantized, their own state)."""
    import torch

    seen, total = set(), 0

    def add(t):
        nonlocal total
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()

    for p in model.parameters():
        add(p)
        qs = getattr(p, "quant_state", None)
        while qs is not None:
            add(qs.absmax)
            add(qs.code)
            add(getattr(qs, "offset", None))
            qs = getattr(qs, "state2", None)
    for b in model.buffers():
        add(b)
    return total


def test_generate_loads_a_qlora_base_in_4bit_as_trained(qlora_run):
    import torch

    from lowvram.train.after.generate import load_generator

    gen = load_generator(qlora_run)
    linears4 = [m for m in gen.model.modules() if type(m).__name__ == "Linear4bit"]
    assert linears4, "the QLoRA base was loaded dequantized"
    q = gen.model.base_model.model.config.quantization_config
    assert (q.bnb_4bit_quant_type, q.bnb_4bit_use_double_quant, q.bnb_4bit_compute_dtype) == ("nf4", True, torch.float32)
    # The size checked before loading is what the model holds: the planner's exact weight bytes
    # (the rotary inv_freq buffer, 64 bytes, is not a weight).
    plan = json.loads((qlora_run / "plan.json").read_text())
    size = trained_size(BaseModel(gen.source.split(" + ")[0], "test"), plan)
    assert 0 <= _stored_bytes(gen.model) - size.needed_bytes <= 1024, (size, _stored_bytes(gen.model))

    result = cli("generate", str(qlora_run), "--prompt", "Add 2 and 3.", "--greedy", "--max-new-tokens", "4")
    assert result.exit_code == 0, result.output


def test_generate_refuses_what_host_ram_cannot_hold(qlora_run, monkeypatch):
    import lowvram.hardware

    monkeypatch.setattr(lowvram.hardware, "host_memory", lambda: (2**30, 100 * 2**10))  # 100 KiB free
    result = cli("generate", str(qlora_run), "--prompt", "hi", "--cpu")
    assert_user_error(result, "generate needs", "of host RAM", "nf4-dq as trained", "0.1 MiB available")


QLORA_13B = {"mixed_precision": "bf16", "quantization": "nf4-dq", "lora_r": 16, "lora_targets": ["all-linear"]}


def _card(free_gib: float) -> Hardware:
    return Hardware("cuda", (Device(0, "16 GB card", 16 * 2**30, int(free_gib * 2**30), (8, 9), True),),
                    host_total_bytes=64 * 2**30, host_available_bytes=48 * 2**30, context_in_free=True)


def test_a_13b_qlora_run_fits_a_16gb_card_in_4bit_not_dequantized(tmp_path):
    base = BaseModel("llama-2-13b", "test")
    four_bit = trained_size(base, QLORA_13B)
    assert four_bit.needed_bytes == 7_452_071_520  # 6.9 GiB: 13.0B parameters, the linears in nf4-dq
    check_fits(four_bit, "cuda", _card(15.5))  # fits: no error

    from lowvram.errors import LowvramError

    with pytest.raises(LowvramError) as dense:  # dequantized in bf16, as generate loaded it before
        check_fits(dense_size(base, "bfloat16", tmp_path), "cuda", _card(15.5))
    assert "generate needs 24.24 GiB of GPU memory on 16 GB card" in dense.value.message
    assert "--cpu" in dense.value.hint and "48.00 GiB of host RAM available" in dense.value.hint
    with pytest.raises(LowvramError) as small:  # another process holds most of the card
        check_fits(four_bit, "cuda", _card(4))
    assert "4.00 GiB available" in small.value.message and "--cpu" in small.value.hint


def test_generate_checks_a_full_model_folder_too(tiny_model_dir, monkeypatch):
    """A merged folder or a full fine-tune: its parameters x config.json's dtype."""
    import lowvram.hardware
    from lowvram.plan.model.catalog import resolve_model
    from lowvram.plan.model.models import count_parameters

    n = count_parameters(resolve_model(str(tiny_model_dir)))
    monkeypatch.setattr(lowvram.hardware, "host_memory", lambda: (2**30, 100 * 2**10))
    result = cli("generate", str(tiny_model_dir), "--prompt", "hi")
    assert_user_error(result, f"generate needs {n * 4 / 2**20:.1f} MiB of host RAM", f"{n:,} parameters x 4 bytes (float32)")
