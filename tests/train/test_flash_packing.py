"""Packed data under flash-attention with two or more rows per batch (issue 41 item 1).

transformers' ``_flash_attention_forward`` decides how to treat a batch; only the flash-attention
CUDA kernels cannot run on a CPU, so they are replaced by reference kernels (SDPA per sample,
below) and everything else is transformers' own code: the packed-sequence check, the varlen
branch, the model's kwargs plumbing.
"""

from __future__ import annotations

import pytest

from tests.train.test_data import build

torch = pytest.importorskip("torch")


def _flash(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
           deterministic=False):
    """flash_attn_func's contract on (b, s, heads, head_dim) tensors."""
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=softmax_scale,
        enable_gqa=True)
    return out.transpose(1, 2)


def _flash_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                  softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False):
    """flash_attn_varlen_func's contract: (total_tokens, heads, head_dim), one block per sample."""
    assert isinstance(max_seqlen_q, int)  # the kernel takes a Python int
    bounds = cu_seqlens_q.tolist()
    return torch.cat([_flash(q[None, a:b], k[None, a:b], v[None, a:b], softmax_scale=softmax_scale, causal=causal)[0]
                      for a, b in zip(bounds[:-1], bounds[1:], strict=True)])


@pytest.fixture
def flash_on_cpu(monkeypatch):
    """transformers' flash-attention path with the reference kernels loaded in place of flash_attn."""
    import transformers.modeling_flash_attention_utils as fa

    for name, value in {"_loaded_implementation": "flash_attention_2", "_flash_fn": _flash,
                        "_flash_varlen_fn": _flash_varlen, "_flash_with_kvcache_fn": None,
                        "_pad_fn": fa._pad_input, "_unpad_fn": fa._unpad_input,
                        "_process_flash_kwargs_fn": fa._lazy_define_process_function(_flash_varlen),
                        "_process_with_kvcache_kwargs_fn": dict}.items():
        monkeypatch.setattr(fa, name, value)
    return fa


def test_packed_batch_of_two_rows_keeps_samples_apart_under_flash_attention(
        tmp_path, tiny_model_dir, tiny_tokenizer, flash_on_cpu):
    from transformers import AutoModelForCausalLM

    from lowvram.train.data.collate import make_collator

    rows = [{"prompt": "Q", "completion": "hello world"}, {"prompt": "What is", "completion": " LoRA?"},
            {"prompt": "Explain", "completion": " adapters."}, {"prompt": "Q", "completion": " the capital"}]
    plain = build(tmp_path, tiny_tokenizer, rows, fmt="completion", seq_len=64)
    lengths = [len(r["input_ids"]) for r in plain.train]
    window = lengths[0] + lengths[1]
    packed = build(tmp_path, tiny_tokenizer, rows, fmt="completion", seq_len=max(window, lengths[2] + lengths[3]),
                   packing=True)
    assert packed.stats.train_rows == 2  # two samples in each of two windows

    features = [packed.train[0], packed.train[1]]
    batch = make_collator(tiny_tokenizer, flash_varlen=True)(features)
    # The function transformers uses to find packed samples says no for a two-row batch: without
    # the collator's varlen kwargs, flash-attention would attend across samples.
    assert not flash_on_cpu._is_packed_sequence(batch["position_ids"], batch["input_ids"].shape[0])
    assert flash_on_cpu._is_packed_sequence(batch["position_ids"][:1], 1)
    assert batch["cu_seq_lens_q"].tolist()[:3] == [0, lengths[0], window]

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    model.config.use_cache = False
    model.config._attn_implementation = "flash_attention_2"
    with torch.no_grad():
        logits = model(**batch).logits
        without = {k: v for k, v in batch.items() if not k.startswith(("cu_seq_lens", "max_length"))}
        mixed = model(**without).logits
        model.config._attn_implementation = "sdpa"
        for i, row in enumerate(plain.train):
            alone = model(input_ids=torch.tensor([row["input_ids"]])).logits[0]
            start = 0 if i % 2 == 0 else lengths[i - 1]
            torch.testing.assert_close(logits[i // 2, start:start + len(alone)], alone, atol=1e-5, rtol=1e-5)
    # the second sample of a window saw the first one on the plain flash path
    assert not torch.allclose(mixed[0, lengths[0]:window], logits[0, lengths[0]:window], atol=1e-3)


def test_collator_sends_varlen_kwargs_only_for_packed_rows_under_flash_attention():
    from lowvram.train.data.collate import make_collator

    class Tok:
        pad_token_id = 0

    packed = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": [0, 0, 1]},
              {"input_ids": [8], "labels": [-100], "position_ids": [0]}]
    batch = make_collator(Tok(), flash_varlen=True)(packed)
    # the padding tail of row 2 is its own block (positions 0, 1)
    assert batch["cu_seq_lens_q"].tolist() == [0, 1, 3, 4, 6]
    assert batch["max_length_q"] == batch["max_length_k"] == 2
    assert "cu_seq_lens_q" not in make_collator(Tok())(packed)
    plain = [{k: v for k, v in f.items() if k != "position_ids"} for f in packed]
    assert "cu_seq_lens_q" not in make_collator(Tok(), flash_varlen=True)(plain)
