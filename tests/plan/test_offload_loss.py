"""Activation offloading and Liger's fused loss in the planner: what each moves or keeps, when the
search takes them, and the long-context answer on a 12 GB card. Pure: no torch."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lowvram.errors import LowvramError
from lowvram.plan.choose import techniques as tq
from lowvram.plan.choose.choose import choose_plan
from lowvram.plan.choose.request import Budget, PlanRequest
from lowvram.plan.memory import activations, backward
from lowvram.plan.memory.memory import estimate_memory
from lowvram.plan.model.catalog import resolve_model
from lowvram.plan.serialize import choice_to_dict
from lowvram.plan.setup import RunSetup

GB = 10**9
NO_EXTRAS = ("liger", "deepspeed")  # as on the development machine


@pytest.fixture(scope="module")
def llama8b():
    return resolve_model("llama-3.1-8b")


def _qlora(spec, **kw) -> RunSetup:
    base = dict(model=spec, quantization="nf4-dq", lora=True, gradient_checkpointing=True, loss="chunked",
                seq_len=16384)
    return RunSetup(**{**base, **kw})


def test_offload_moves_exactly_the_layer_inputs_to_host_ram(llama8b):
    """32 layers x t x h x 2 bytes leave the GPU and land in pinned host RAM; one comes back for
    the recomputed layer."""
    on, off = _qlora(llama8b, activation_offload=True), _qlora(llama8b)
    per_layer = 2 * 16384 * 4096
    assert activations.offloaded_layer_input_bytes(on) == per_layer == 134_217_728
    assert estimate_memory(on).cpu_ram_bytes - estimate_memory(off).cpu_ram_bytes == 32 * per_layer
    # pinned blocks are rounded up to a power of two (PyTorch's CachingHostAllocator)
    odd = replace(on, seq_len=10429)
    assert activations.offloaded_layer_input_bytes(odd) == 2 * 10429 * 4096 == 85_434_368
    assert activations.activation_offload_host_bytes(odd) == 32 * 2**27
    assert activations.activation_bytes(off) - activations.activation_bytes(on) == 32 * per_layer
    e_on, e_off = estimate_memory(on), estimate_memory(off)
    assert sum(e_on.breakdown.values()) == e_on.peak_bytes
    # the peak is a layer's backward: one layer's input + its recompute, not 32 inputs
    recompute = backward.recompute_bytes(on)
    assert e_on.breakdown["activations"] == per_layer + recompute
    assert e_off.breakdown["activations"] == 32 * per_layer + recompute
    assert e_off.breakdown["activations"] - e_on.breakdown["activations"] == 31 * per_layer


def test_offload_claims_nothing_on_a_cpu(llama8b):
    """Host RAM is the device memory on a CPU: the same bytes, the same peak (the live-bytes
    tracker sees the same tensors)."""
    small = replace(resolve_model("llama-3.2-1b"))
    on = RunSetup(small, gradient_checkpointing=True, activation_offload=True, device="cpu", precision="fp32")
    off = replace(on, activation_offload=False)
    assert estimate_memory(on) == estimate_memory(off)
    assert activations.activation_offload_host_bytes(on) == 0


def test_offload_needs_checkpointing(llama8b):
    with pytest.raises(LowvramError, match="needs gradient_checkpointing"):
        estimate_memory(_qlora(llama8b, gradient_checkpointing=False, activation_offload=True))
    with pytest.raises(LowvramError, match="needs gradient_checkpointing"):
        choose_plan(PlanRequest(llama8b, lora=True, activation_offload=True, gradient_checkpointing=False),
                    Budget(12 * GB))


def test_search_takes_offload_only_when_it_is_the_cheapest_way_to_fit(llama8b):
    budget = Budget(12 * GB, missing_extras=NO_EXTRAS)

    def chosen(seq):
        c = choose_plan(PlanRequest(llama8b, seq_len=seq, batch_size=1, lora=True, quantization="nf4-dq",
                                    offload="none"), budget)
        return c.chosen.setup, c.plan.reasons["activation_offload"]

    s, why = chosen(4096)
    assert s.gradient_checkpointing and not s.activation_offload and why.startswith("off: the checkpoints")
    s, why = chosen(8192)  # checkpointing plus 8-bit AdamW does not fit; offloading does
    assert s.activation_offload and why.startswith("on: without it the peak would be 11.46 GiB > budget")
    assert "2.00 GiB of checkpointed layer inputs in pinned host RAM" in why
    assert tq.setup_slowdown(s, 1) == pytest.approx(1.25 * 1.1 * 1.35 * 0.8 * 1.02)


def test_never_offered_on_a_cpu():
    spec = resolve_model("llama-3.2-1b")
    c = choose_plan(PlanRequest(spec, seq_len=512, batch_size=1, activation_offload=True),
                    Budget(4 * GB, device="cpu", bf16=False))
    assert not c.chosen.setup.activation_offload and not c.plan.activation_offload
    assert c.plan.reasons["activation_offload"].startswith("off (asked for, ignored): a CPU run")
    assert all(r.technique != "activation_offload" for r in c.ladder)


def test_long_context_on_a_12gb_card(llama8b):
    """Llama-3.1-8B QLoRA on a 12 GB card, nothing but activations offloaded: 12,009 tokens
    (7,312 without activation offload; torchao's 4-bit AdamW on the adapters). The binding term at 16k is one decoder layer's backward
    (its recomputed activations, 3.32 GiB, and its working memory, 2.06 GiB), not the loss:
    Liger's fused loss reaches the same length. With ZeRO-3 offloading the weights too: 22,071.
    With the tiled MLP (lowvram.plan.memory.tiled) on auto: 23,484 without offloading any weight (torchao's
    4-bit AdamW on the adapters)."""
    budget = Budget(12 * GB, missing_extras=NO_EXTRAS)
    tiled = PlanRequest(llama8b, seq_len=2048, batch_size=1, lora=True, quantization="nf4-dq", offload="none")
    n, s = choose_plan(tiled, budget).longest
    assert n == 23484 and s.tiled_mlp and s.activation_offload and s.offload == "none"
    req = replace(tiled, tiled_mlp=False)
    n, s = choose_plan(req, budget).longest
    assert n == 12009 and s.activation_offload and s.loss == "chunked" and s.optimizer == "adamw_torch_4bit"
    est = estimate_memory(s)
    assert est.peak_bytes <= budget.usable_bytes < estimate_memory(replace(s, seq_len=n + 1)).peak_bytes
    assert sum(est.breakdown.values()) == est.peak_bytes
    no_offload = choose_plan(replace(req, activation_offload=False), budget).longest
    assert no_offload[0] == 7312
    with_liger = choose_plan(req, replace(budget, missing_extras=("deepspeed",))).longest
    assert with_liger[0] == 12009 and with_liger[1].loss == "fused"
    at16k = estimate_memory(replace(s, seq_len=16384))
    assert at16k.breakdown["activations"] == (activations.offloaded_layer_input_bytes(replace(s, seq_len=16384))
                                              + backward.recompute_bytes(replace(s, seq_len=16384)))
    anything = choose_plan(replace(req, offload=None), budget)
    assert anything.longest[0] == 22071 and anything.longest[1].offload == "full"
    assert choice_to_dict(anything)["longest_seq_len"] == 22071


# --------------------------------------------------------------------------------------------
# Liger Kernel's fused linear cross-entropy (loss: fused)


def test_fused_loss_bytes_from_liger_source(llama8b):
    """chunk = next_power_of_2(ceil(t / ceil(V / h))): 512 rows at 16k tokens for V = 128,256."""
    s = _qlora(llama8b, loss="fused")
    assert backward.fused_loss_chunk_tokens(s) == 512
    t, h, v = 16384, 4096, 128256
    assert backward.logits_bytes(s) == 2 * t * h + 2 * 512 * v + 2 * 512 * h + 13 * t
    assert backward.logits_bytes(s) < backward.logits_bytes(replace(s, loss="chunked")) // 6
    short = replace(s, seq_len=100)  # ceil(100 / 32) = 4 rows
    assert backward.fused_loss_chunk_tokens(short) == 4
    # full fine-tuning: grad_weight (bf16) plus torch.mm(...).float() temporaries (bf16 and fp32)
    full = replace(s, lora=False, quantization="none")
    assert backward.logits_bytes(full) - backward.logits_bytes(s) == (2 + 2 + 4) * v * h


@pytest.mark.parametrize("budget, why", [
    (Budget(4 * GB, device="cpu", bf16=False), "needs CUDA"),
    (Budget(12 * GB, missing_extras=("liger",)), "pip install 'lowvram[liger]'"),
])
def test_fused_asked_falls_back_to_chunked_with_the_reason(budget, why):
    spec = resolve_model("llama-3.2-1b")
    c = choose_plan(PlanRequest(spec, seq_len=2048, batch_size=1, loss="fused",
                                sources={"loss": "--loss fused"}), budget)
    assert c.chosen.setup.loss == "chunked" and c.plan.loss == "chunked"
    reason = c.plan.reasons["loss"]
    assert reason.startswith("chunked: --loss fused asked for fused, but") and why in reason


def test_fused_offered_only_where_it_runs():
    llama, gpt2 = resolve_model("llama-3.2-1b"), resolve_model("gpt2")
    assert tq.fused_loss_unavailable(Budget(GB), llama) is None
    assert tq.fused_loss_unavailable(Budget(GB), gpt2) == "Liger Kernel does not patch gpt2 models"
    big = PlanRequest(llama, seq_len=8192, batch_size=1, lora=True)
    assert choose_plan(big, Budget(12 * GB)).chosen.setup.loss == "fused"
    assert choose_plan(big, Budget(12 * GB, missing_extras=("liger",))).chosen.setup.loss == "chunked"
