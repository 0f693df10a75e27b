"""The chunked loss's chunk sized to what is left of the budget (issue 26 item 2,
lowvram.plan.choose.search.sized_loss_chunk): 1024 tokens when that fits, halved down to 128 where that
is what fits, the same rule in the search, the limits and the ladder."""

from dataclasses import replace

from lowvram.plan.choose.choose import choose_plan
from lowvram.plan.choose.request import Budget, PlanRequest, fits_budget
from lowvram.plan.choose.search import sized_loss_chunk
from lowvram.plan.memory.backward import CHUNK_TOKENS, MIN_CHUNK_TOKENS, logits_bytes
from lowvram.plan.memory.memory import estimate_memory
from lowvram.plan.model.catalog import resolve_model
from lowvram.plan.setup import RunSetup

GIB = 2**30


def _setup(**kw) -> RunSetup:
    return RunSetup(model=resolve_model("llama-3.1-8b"), precision="bf16", lora=True, quantization="nf4-dq",
                    lora_r=32, gradient_checkpointing=True, optimizer="adamw_8bit", loss="chunked",
                    tiled_mlp=True, seq_len=540, micro_batch_size=1, **kw)


def test_the_default_chunk_when_it_fits_and_the_largest_that_fits_when_not():
    s = _setup()
    roomy = Budget(24 * GIB)
    assert sized_loss_chunk(s, roomy, estimate_memory).loss_chunk_tokens == CHUNK_TOKENS
    # 7.5 GiB (7.13 after the margin): 1024-token chunks do not fit at 540 tokens (an 8 GB card as
    # sold, 7.8 GiB, holds them since the allocator's slack on the weights is 1.5%)
    tight = Budget(int(7.5 * GIB))
    assert not fits_budget(estimate_memory(s), tight)
    sized = sized_loss_chunk(s, tight, estimate_memory)
    assert sized.loss_chunk_tokens == 256 and fits_budget(estimate_memory(sized), tight)
    assert not fits_budget(estimate_memory(replace(s, loss_chunk_tokens=512)), tight)
    assert logits_bytes(sized) < logits_bytes(s)
    # the logits term is exact in the chunk: 12 bytes per logit of one chunk, the rest unchanged
    long = replace(s, seq_len=2048)
    v = s.model.vocab_size
    assert logits_bytes(long) - logits_bytes(replace(long, loss_chunk_tokens=256)) == 12 * (1024 - 256) * v


def test_nothing_fits_the_smallest_chunk_is_kept_and_other_losses_are_left_alone():
    s = _setup()
    hopeless = Budget(4 * GIB)
    assert sized_loss_chunk(s, hopeless, estimate_memory).loss_chunk_tokens in (CHUNK_TOKENS, MIN_CHUNK_TOKENS)
    assert not fits_budget(estimate_memory(replace(s, loss_chunk_tokens=MIN_CHUNK_TOKENS)), hopeless)
    standard = replace(s, loss="standard")
    assert sized_loss_chunk(standard, Budget(int(7.8 * GIB)), estimate_memory) is standard


def test_the_plan_the_reason_and_the_ladder_agree():
    req = PlanRequest(resolve_model("llama-3.1-8b"), seq_len=540, batch_size=1, lora=True, lora_r=32,
                      quantization="nf4-dq", offload="none")
    c = choose_plan(req, Budget(int(7.8 * GIB), missing_extras=("liger",)))  # no fused loss here
    assert c.fits and c.plan.loss == "chunked" and c.plan.loss_chunk_tokens == c.chosen.setup.loss_chunk_tokens < 1024
    assert f"{c.plan.loss_chunk_tokens}-token chunks, sized to the budget" in c.plan.reasons["loss"]
    assert c.ladder[-1].fits  # the ladder sizes the chunk as the search does
