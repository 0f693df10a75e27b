"""The memory model: exact numbers where the math is exact (no torch needed)."""

from __future__ import annotations

import pytest

from lowvram.errors import LowvramError
from lowvram.plan.memory.memory import estimate_memory
from lowvram.plan.memory.sharding import layer_weight_bytes, root_weight_bytes
from lowvram.plan.memory.states import (
    lora_parameters,
    optimizer_bytes,
    quantized_bytes,
    weight_bytes,
)
from lowvram.plan.model.catalog import resolve_model
from lowvram.plan.model.models import count_parameters
from lowvram.plan.setup import BREAKDOWN_KEYS, RunSetup, cuda_overheads
from tests.conftest import published_cuda_context_bytes

LLAMA7 = resolve_model("llama-2-7b")
P7 = 6_738_415_616


def test_lora_parameter_counts_match_peft():
    # peft print_trainable_parameters for Llama-2-7B: r8 q,v -> 4,194,304; r16 all-linear -> 39,976,960
    assert lora_parameters(RunSetup(LLAMA7, lora=True, lora_r=8, lora_targets=("q_proj", "v_proj"))) == 4_194_304
    assert lora_parameters(RunSetup(LLAMA7, lora=True, lora_r=16)) == 39_976_960
    est = estimate_memory(RunSetup(LLAMA7, lora=True, lora_r=16))
    assert est.trainable_parameters == 39_976_960
    assert est.parameters == P7 + 39_976_960


def test_nf4_bytes_of_one_matrix():
    # 4096 x 4096: 8,388,608 packed bytes + 262,144 fp32 absmax + a 16-entry fp32 code
    assert quantized_bytes(4096 * 4096, "nf4", 4096) == 8_388_608 + 1_048_576 + 64
    # double quantization: uint8 absmax + fp32 absmax per 256 blocks + 256-entry code + offset
    assert quantized_bytes(4096 * 4096, "nf4-dq", 4096) == 8_388_608 + 262_144 + 4096 + 1024 + 4 + 64
    assert quantized_bytes(4096 * 4096, "int8", 4096) == 4096 * 4096 + 4 * 4096


def test_qlora_weights_unquantized_rest_at_load_dtype_or_fp32_after_kbit_prepare():
    s = RunSetup(LLAMA7, lora=True, quantization="nf4-dq", lora_targets=("q_proj", "v_proj"), lora_r=8)
    # Each layer: q, k, v, o (4096 x 4096), gate and up (4096 -> 11008), down (11008 -> 4096).
    q = 32 * (4 * quantized_bytes(4096 * 4096, "nf4-dq", 4096) + 2 * quantized_bytes(4096 * 11008, "nf4-dq", 11008)
              + quantized_bytes(11008 * 4096, "nf4-dq", 4096))
    # embed + lm_head (2 x 32000 x 4096) and norms stay unquantized: bf16 as loaded (lowvram's
    # QLoRA), fp32 after peft's prepare_model_for_kbit_training; the r8 q,v adapters in fp32.
    rest = 2 * 32000 * 4096 + (2 * 32 + 1) * 4096
    assert weight_bytes(s) == q + 2 * rest + 4 * 4_194_304
    assert weight_bytes(RunSetup(**{**s.__dict__, "kbit_prepare": True})) == q + 4 * rest + 4 * 4_194_304
    assert weight_bytes(s) < weight_bytes(RunSetup(LLAMA7, lora=True, quantization="nf4"))


def test_full_fp32_adamw_is_16_bytes_per_param_at_the_step():
    # ZeRO paper / accelerate estimate-memory: weights 4 + grads 4 + Adam 8
    est = estimate_memory(RunSetup(LLAMA7, precision="fp32", device="cpu"))
    assert est.peak_phase == "optimizer_step"
    assert est.peak_bytes == 16 * P7
    assert est.persistent_bytes == 12 * P7
    assert est.breakdown == dict(weights=4 * P7, gradients=4 * P7, optimizer=8 * P7, activations=0,
                                 logits=0, cuda_context=0, allocator=0)


def test_pure_bf16_adamw_state_in_bf16():
    assert optimizer_bytes(RunSetup(LLAMA7, precision="bf16")) == 4 * P7
    assert optimizer_bytes(RunSetup(LLAMA7, precision="bf16-mixed")) == 8 * P7


def test_breakdown_keys_sum_and_cuda_overheads():
    for kw in [dict(), dict(lora=True, quantization="nf4-dq", gradient_checkpointing=True, seq_len=2048),
               dict(optimizer="adamw_8bit", micro_batch_size=4), dict(offload="zero3", gpus=4)]:
        est = estimate_memory(RunSetup(LLAMA7, **kw))
        assert tuple(est.breakdown) == BREAKDOWN_KEYS
        assert sum(est.breakdown.values()) == est.peak_bytes
        assert est.breakdown["cuda_context"] == published_cuda_context_bytes() == 300 * 2**20
    assert not cuda_overheads().calibrated


def test_logits_scale_with_vocab_and_chunking_helps():
    l3 = resolve_model("llama-3-8b")
    s = RunSetup(l3, lora=True, quantization="nf4-dq", gradient_checkpointing=True, seq_len=4096, device="cpu")
    est = estimate_memory(s)
    assert est.breakdown["logits"] == 12 * 4096 * 128_256  # fp32 log-softmax, its grad, input grad
    chunked = estimate_memory(RunSetup(**{**s.__dict__, "loss": "chunked"}))
    assert chunked.peak_bytes < est.peak_bytes


def test_techniques_lower_the_peak_in_the_expected_order():
    base = dict(model=LLAMA7, seq_len=2048)
    full = estimate_memory(RunSetup(**base)).peak_bytes
    lora = estimate_memory(RunSetup(**base, lora=True)).peak_bytes
    lora_gc = estimate_memory(RunSetup(**base, lora=True, gradient_checkpointing=True)).peak_bytes
    qlora_gc = estimate_memory(RunSetup(**base, lora=True, quantization="nf4-dq", gradient_checkpointing=True)).peak_bytes
    assert full > lora > lora_gc > qlora_gc
    assert 4 * 2**30 < qlora_gc < 9 * 2**30  # QLoRA 7B at 2k tokens fits an 8-12 GB card


def test_accumulation_keeps_gradients_and_offload_moves_state_to_host():
    s = RunSetup(LLAMA7, grad_accum=4, device="cpu")
    est = estimate_memory(s)
    assert est.breakdown["gradients"] == 2 * P7
    off = estimate_memory(RunSetup(LLAMA7, offload="optimizer"))
    assert off.breakdown["optimizer"] == 0 and off.cpu_ram_bytes > 4 * P7


PROCESS = 2 * 2**30  # the process itself (torch + CUDA libraries), in every cpu_ram_bytes


def _host(**kw) -> int:
    """cpu_ram_bytes less the process and the checkpoint shard staged while loading."""
    est = estimate_memory(RunSetup(LLAMA7, **kw))
    return est.cpu_ram_bytes - PROCESS - min(weight_bytes(RunSetup(LLAMA7, **kw)), 5 * 10**9)


def test_deepspeed_optimizer_offload_holds_16_bytes_per_trained_parameter_in_ram():
    # ZeRO-Offload: fp32 master copy + fp32 Adam m, v + fp32 gradient, whatever the GPU dtype
    assert _host(offload="optimizer") == 16 * P7
    assert _host(offload="optimizer", lora=True) == 16 * 39_976_960
    assert _host(offload="zero2-offload", gpus=4) == 16 * P7 // 4  # each rank its partition
    # ZeRO-3 parameter offload adds every 16-bit weight (frozen ones too)
    assert _host(offload="full") == 16 * P7 + 2 * P7
    assert _host(offload="zero3-offload", gpus=2) == (16 * P7 + 2 * P7) // 2


def test_fsdp_offload_moves_weights_gradients_and_state_to_ram():
    # FSDP2 CPUOffloadPolicy: sharded params, grads and the torch optimizer's state at the
    # param dtype (bf16: 2 + 2 + 4 bytes per parameter), 1/N per rank; none of it on the GPU.
    est = estimate_memory(RunSetup(LLAMA7, offload="fsdp-offload", gpus=2))
    assert _host(offload="fsdp-offload", gpus=2) == (2 + 2 + 4) * P7 // 2
    assert est.breakdown["optimizer"] == 0
    s = RunSetup(LLAMA7, offload="fsdp-offload", gpus=2)
    # only the units gathered for compute: the root (embeddings, norm, lm_head) + two layers
    assert est.breakdown["weights"] == root_weight_bytes(s) + 2 * layer_weight_bytes(s)


def test_offloads_that_run_deepspeeds_cpu_adam_refuse_other_optimizers():
    for offload in ("optimizer", "full", "zero2-offload", "zero3-offload"):
        with pytest.raises(LowvramError, match="DeepSpeed's CPU Adam"):
            estimate_memory(RunSetup(LLAMA7, offload=offload, optimizer="adamw_8bit"))
    # FSDP2 keeps the Trainer's optimizer (its step on the CPU), a torch one: bitsandbytes' fail
    estimate_memory(RunSetup(LLAMA7, offload="fsdp-offload", gpus=2, optimizer="adafactor"))
    with pytest.raises(LowvramError, match="no DTensor support"):
        estimate_memory(RunSetup(LLAMA7, offload="fsdp-offload", gpus=2, optimizer="adamw_8bit"))


def test_eager_attention_costs_the_s_squared_scores():
    from lowvram.plan.memory.activations import layer_activation_bytes
    from lowvram.plan.memory.backward import eager_softmax_backward_bytes, logits_bytes

    eager = RunSetup(LLAMA7, lora=True, seq_len=2048, attention="eager", device="cpu")
    sdpa = RunSetup(LLAMA7, lora=True, seq_len=2048, device="cpu")
    a, b = estimate_memory(eager), estimate_memory(sdpa)
    scores = 32 * (4 + 2) * 32 * 2048**2  # L x (fp32 + bf16) x a x s^2, saved
    # the last layer's softmax backward (two fp32 s x s per head, less the freed bf16 copy: 6 x
    # a x s^2) and the two hidden-state gradients, the last layer's MLP and o_proj done by then
    # (their saved tensors freed): here that is below the loss's logits, so both peak at the
    # start of the backward and differ by the saved scores alone
    done = layer_activation_bytes(eager) - layer_activation_bytes(eager, attention_side=True)
    last = eager_softmax_backward_bytes(eager) + 2 * 2 * 2048 * 4096 - done
    assert eager_softmax_backward_bytes(eager) == 6 * 32 * 2048**2
    assert last < logits_bytes(sdpa)
    assert a.peak_bytes - b.peak_bytes == scores
    # with the chunked loss's small logits the softmax backward binds
    chunked = [estimate_memory(RunSetup(LLAMA7, lora=True, seq_len=2048, attention=att, device="cpu",
                                        loss="chunked")) for att in ("eager", "sdpa")]
    assert chunked[0].peak_bytes - chunked[1].peak_bytes > scores


def test_invalid_setup_names_every_problem():
    with pytest.raises(LowvramError) as e:
        estimate_memory(RunSetup(LLAMA7, precision="int3", optimizer="lion", quantization="nf4"))
    assert "precision 'int3'" in e.value.message and "optimizer 'lion'" in e.value.message
    assert "needs lora: a quantized base cannot be trained directly" in e.value.message


def test_every_catalog_model_estimates():
    from lowvram.plan.model.catalog import catalog_names
    from lowvram.plan.model.moe import default_attention

    for name in catalog_names():
        spec = resolve_model(name)
        est = estimate_memory(RunSetup(spec, lora=True, quantization="nf4-dq",
                                       attention=default_attention(spec)))  # gpt-oss: eager
        assert est.peak_bytes > count_parameters(spec) // 2


LORA7 = 39_976_960  # r=16 all-linear adapters of llama-2-7b (test_lora_parameter_counts_match_peft)


def test_zero3_offload_keeps_live_parameters_prefetch_persistent_and_bucket_on_the_gpu():
    # DeepSpeed's defaults (lowvram's config sets no bucket key): 1e9 live parameters, a 5e7
    # prefetch bucket, parameters under 1e5 elements persistent, a 5e8-element reduce bucket.
    est = estimate_memory(RunSetup(LLAMA7, lora=True, gradient_checkpointing=True, offload="full",
                                   seq_len=2048))
    per_elt = (2 * P7 + 4 * LORA7) / (P7 + LORA7)
    norms = 65 * 4096 * 2  # 2 per layer + the final one, bf16
    # LoRA A (16 x 4096) on q,k,v,o,gate,up and B (4096 x 16) on q,k,v,o,down: 11 per layer, fp32
    adapters = 11 * 16 * 4096 * 32 * 4
    assert est.breakdown["weights"] == int(10**9 * per_elt) + int(5 * 10**7 * per_elt) + norms + adapters
    assert est.breakdown["gradients"] == 5 * 10**8 * 2  # the bf16 reduce bucket; grads on the CPU
    assert est.breakdown["optimizer"] == 0


def test_zero2_shards_fp32_master_and_adam_and_holds_its_reduce_bucket():
    est = estimate_memory(RunSetup(LLAMA7, offload="zero2", gpus=4))
    assert est.breakdown["optimizer"] == (4 + 8) * P7 // 4  # fp32 master + fp32 m, v, 1/N
    off = estimate_memory(RunSetup(LLAMA7, offload="optimizer", lora=True))
    assert off.breakdown["gradients"] == 10**9  # only the ipg_buffer: no ZeRO-2 overlap_comm
    assert off.breakdown["weights"] == weight_bytes(RunSetup(LLAMA7, lora=True))  # ZeRO-2: all


def test_auto_zero_settings_follow_accelerate():
    from lowvram.plan.memory.sharding import auto_zero_settings, zero_settings

    s = RunSetup(LLAMA7, offload="zero3", gpus=2)
    auto = auto_zero_settings(s)
    assert (auto.reduce_bucket_size, auto.prefetch_bucket_size, auto.param_persistence_threshold) == (
        16_777_216, 15_099_494, 40_960)
    assert zero_settings(s).reduce_bucket_size == 500_000_000
    assert zero_settings(RunSetup(LLAMA7)) is None


def test_zero_offloads_match_the_launch_config():
    from lowvram.plan.memory.sharding import ZERO_OFFLOADS
    from lowvram.train.run.launch import BACKENDS

    deepspeed = {k: v[1:] for k, v in BACKENDS.items() if v[0] == "deepspeed"}
    assert deepspeed == ZERO_OFFLOADS
