"""Predicted peak memory vs the exact live tensor bytes of real CPU training steps.

Small random-init Llama (lowvram.check.cases.tiny_llama_spec), one warm-up step (optimizer state
exists), then one step measured with lowvram.livebytes.LiveBytes the way the Trainer runs it.
Target: within 3% per case (bench/plan_accuracy.py prints the full matrix at seq 512).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from lowvram.check.cases import ACCURACY_MATRIX, tiny_llama_spec  # noqa: E402
from lowvram.check.step import measure_setup  # noqa: E402
from lowvram.plan.memory.memory import estimate_memory  # noqa: E402
from lowvram.plan.setup import RunSetup  # noqa: E402

# A fast subset on a smaller model at a quarter of the sequence length, covering every
# technique of the matrix (the bench runs all of it on the h256/L4/V4096 model at seq 512).
FAST = [
    "full fp32", "full bf16", "full bf16-mixed", "full bf16 + checkpointing", "full bf16 b2 s512",
    "full bf16 accum 2", "full bf16 adamw_8bit", "full bf16 adafactor", "lora bf16",
    "lora bf16-mixed", "qlora nf4", "qlora nf4-dq + checkpointing", "lora fp32 dropout 0.1",
    "lora bf16-mixed dropout 0.05",
    "full bf16 chunked loss b8 s1024",  # 2048 tokens here: two chunks of 1024
]
CASES = {name: kw for name, kw in ACCURACY_MATRIX}


@pytest.mark.parametrize("name", FAST)
def test_peak_within_3_percent(name):
    kw = dict(CASES[name])
    kw["seq_len"] = kw.get("seq_len", 512) // 4
    setup = RunSetup(tiny_llama_spec(hidden_size=128, num_layers=2, vocab_size=2048), device="cpu", **kw)
    measured = measure_setup(setup)
    est = estimate_memory(setup)
    assert abs(est.peak_bytes - measured.peak_bytes) <= 0.03 * measured.peak_bytes, (
        f"{name}: predicted {est.peak_bytes:,} measured {measured.peak_bytes:,}")
    assert (est.peak_phase == "optimizer_step") == (measured.peak_phase == "optimizer_step")
    if setup.grad_accum == 1:
        # weights + optimizer state: exact up to a few scalars (step counters, inputs)
        inputs = 8 * setup.micro_batch_size * setup.seq_len  # the int64 batch (ids = labels)
        assert abs(est.persistent_bytes - measured.start_bytes) <= 16 * 1024 + inputs


def test_tracker_counts_live_bytes_and_frees():
    from lowvram.livebytes import LiveBytes

    with LiveBytes() as mode:
        a = torch.ones(1000)  # 4000 bytes
        b = a * 2  # +4000
        assert mode.current_bytes == 8000
        del b
        assert mode.current_bytes == 4000
        v = a.view(10, 100)  # a view allocates nothing
        assert mode.current_bytes == 4000
        del a, v
    assert mode.peak_bytes == 8000 and mode.current_bytes == 0


def test_tracker_counts_what_threads_started_inside_it_allocate():
    # transformers' continuous batching (TRL's paged generation) runs its forwards in a thread of
    # its own; a dispatch mode is thread-local, so the tracker enters each new thread too
    import threading

    from lowvram.livebytes import LiveBytes

    kept = []
    with LiveBytes() as mode:
        t = threading.Thread(target=lambda: kept.append(torch.ones(1000)))
        t.start()
        t.join()
        assert mode.current_bytes == 4000
        kept.clear()
        assert mode.current_bytes == 0
    assert mode.peak_bytes == 4000
    assert threading.Thread.run is threading.Thread.__dict__["run"]  # put back


def test_emulated_card_raises_out_of_memory():
    from lowvram.livebytes import LiveBytes

    with pytest.raises(torch.OutOfMemoryError, match="emulated card"):
        with LiveBytes(cap_bytes=10_000):
            x = torch.zeros(2000)  # 8000 bytes: fits
            y = torch.zeros(2000)  # 16000: over the cap
            del x, y


@pytest.mark.slow  # ~15 s (make test-all); LATE_PEAKS below keep checkpointing with small logits in make test
def test_checkpointing_with_small_logits_is_not_underpredicted():
    """Checkpointing + chunked loss at many tokens: the peak is a layer's recompute and backward,
    not the logits (bench cases "... + ckpt + chunked b2 s2048"). Within 3%, never below."""
    setup = RunSetup(tiny_llama_spec(hidden_size=128, num_layers=2, vocab_size=2048), device="cpu",
                     precision="bf16", lora=True, gradient_checkpointing=True, loss="chunked",
                     micro_batch_size=2, seq_len=2048)
    measured = measure_setup(setup)
    est = estimate_memory(setup)
    assert measured.peak_bytes <= est.peak_bytes <= 1.03 * measured.peak_bytes, (
        f"predicted {est.peak_bytes:,} measured {measured.peak_bytes:,}")


# Small logits (vocabulary 256) and checkpointing: the peak is late in the backward, in the first
# decoder layer's recompute, with nearly every gradient made (full fine-tuning: the model used to
# miss those: -8.6% and -8.4% here); under autocast with fp32 weights, at the end of the forward with
# autocast's cached 16-bit weight copies. Each within 3%.
LATE_PEAKS = [
    ("full fp32 ckpt", dict(precision="fp32"), 256),
    ("full bf16 ckpt", dict(precision="bf16"), 256),
    ("lora fp32 ckpt", dict(precision="fp32", lora=True), 256),
    ("full bf16-mixed ckpt", dict(precision="bf16-mixed"), 2048),
]


@pytest.mark.parametrize("name, kw, vocab", LATE_PEAKS, ids=[c[0] for c in LATE_PEAKS])
def test_checkpointed_backward_peaks_are_within_3_percent(name, kw, vocab):
    setup = RunSetup(tiny_llama_spec(hidden_size=128, num_layers=4, vocab_size=vocab), device="cpu",
                     gradient_checkpointing=True, micro_batch_size=2, seq_len=128, **kw)
    measured = measure_setup(setup)
    est = estimate_memory(setup)
    assert abs(est.peak_bytes - measured.peak_bytes) <= 0.03 * measured.peak_bytes, (
        f"{name}: predicted {est.peak_bytes:,} measured {measured.peak_bytes:,}")


def test_tied_embedding_gradient_at_the_end_of_the_backward():
    """A tied embedding (Qwen2.5-0.5B, Llama-3.2-1B, Gemma): the embedding's dense gradient is
    accumulated into the lm_head's at the very end, two more V x h tensors (was -4.0% here,
    -12% for Qwen2.5-0.5B full bf16 at seq 256 in the full-size simulation)."""
    import dataclasses

    spec = dataclasses.replace(tiny_llama_spec(hidden_size=128, num_layers=2, vocab_size=8192),
                               tie_word_embeddings=True)
    setup = RunSetup(spec, device="cpu", precision="bf16", gradient_checkpointing=True, seq_len=64)
    measured = measure_setup(setup)
    est = estimate_memory(setup)
    assert abs(est.peak_bytes - measured.peak_bytes) <= 0.01 * measured.peak_bytes, (
        f"predicted {est.peak_bytes:,} measured {measured.peak_bytes:,}")


@pytest.mark.parametrize("kw", [pytest.param(dict(precision="bf16"), marks=pytest.mark.slow, id="full bf16"),
                                pytest.param(dict(precision="fp32", lora=True), id="lora fp32")])
def test_eager_attention_with_checkpointing(kw):
    """Eager attention keeps the s x s scores (fp32 softmax + its 16-bit copy; in fp32 one tensor)
    and its softmax backward makes fp32 gradients beside them: within 3% over and 10% under."""
    spec = tiny_llama_spec(hidden_size=128, num_layers=3, vocab_size=512)
    setup = RunSetup(spec, device="cpu", attention="eager", gradient_checkpointing=True, seq_len=512,
                     micro_batch_size=4, loss="chunked", **kw)
    measured = measure_setup(setup).peak_bytes
    predicted = estimate_memory(setup).peak_bytes
    assert -0.10 <= measured / predicted - 1 <= 0.03, f"measured {measured:,} predicted {predicted:,}"


@pytest.mark.slow  # one measured Trainer step: ~13 s on the 2-core machine (make test-all)
def test_activation_offload_peak_as_planned(monkeypatch):
    """Activation offload measured on the CPU: transformers' save_on_cpu is replaced by hooks that
    take each packed tensor out of torch (bytes), as pinned host RAM is out of the GPU's
    allocator; the measured peak is the plan's GPU tensor bytes (context and slack aside) within
    3%. Measured -0.12% / -0.08% / exact for LoRA fp32, LoRA bf16, full fp32 on an 8-layer
    h=256 model at 2 x 512 tokens (the commit that added this test)."""
    from dataclasses import replace

    import transformers.modeling_utils as mu

    packed = []

    class ToHost(torch.autograd.graph.saved_tensors_hooks):
        def __init__(self, pin_memory=False, device_type="cuda"):
            def pack(t):
                packed.append(t.numel() * t.element_size())
                return t.dtype, t.shape, t.detach().contiguous().view(torch.uint8).numpy().tobytes()

            def unpack(p):
                dtype, shape, data = p
                return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone().view(dtype).reshape(shape)

            super().__init__(pack, unpack)

    monkeypatch.setattr(mu, "save_on_cpu", ToHost)
    spec = tiny_llama_spec(hidden_size=128, num_layers=6, vocab_size=256)
    setup = RunSetup(spec, device="cpu", precision="fp32", lora=True, gradient_checkpointing=True,
                     activation_offload=True, seq_len=256, micro_batch_size=2)
    measured = measure_setup(setup).peak_bytes
    on_gpu = estimate_memory(replace(setup, device="cuda"))
    tensors = on_gpu.peak_bytes - on_gpu.breakdown["cuda_context"] - on_gpu.breakdown["allocator"]
    assert abs(tensors - measured) <= 0.03 * measured, (tensors, measured)
    assert set(packed) == {4 * 2 * 256 * 128}  # only layer inputs, fp32 b x s x h
    assert len(packed) % spec.num_layers == 0


@pytest.mark.parametrize("chunk", [128, 512])
def test_a_smaller_loss_chunk_is_counted_as_it_runs(chunk):
    """Issue 26 item 2: the chunked loss's chunk sized to the budget (search.sized_loss_chunk)
    runs with that chunk in the Trainer lowvram train builds, and the plan counts it: within 3%,
    and below the 1024-token chunk's peak by the logits it no longer keeps."""
    from dataclasses import replace

    spec = tiny_llama_spec(hidden_size=128, num_layers=2, vocab_size=8192)
    setup = RunSetup(spec, device="cpu", precision="bf16", loss="chunked", micro_batch_size=4, seq_len=512,
                     loss_chunk_tokens=chunk)
    measured = measure_setup(setup).peak_bytes
    est = estimate_memory(setup)
    assert abs(est.peak_bytes - measured) <= 0.03 * measured, f"predicted {est.peak_bytes:,} measured {measured:,}"
    whole = estimate_memory(replace(setup, loss_chunk_tokens=1024))
    assert whole.breakdown["logits"] - est.breakdown["logits"] == 12 * (1024 - chunk) * 8192
