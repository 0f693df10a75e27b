"""The paged engine's memory (grpo.generation paged: transformers' continuous batching, as TRL 1.16
drives it): the PagedAttentionCache the plan sizes and the static attention masks continuous
batching allocates beside it, in transformers' own arithmetic (generation/continuous_batching/
cache.py, input_outputs.py). Used by the generation moments of plan/memory/grpo.py."""

from __future__ import annotations

import math

from lowvram.plan.memory.states import dtype_bytes
from lowvram.plan.setup import RunSetup

# transformers ContinuousBatchingConfig.page_size (generation/configuration_utils.py): tokens per page
PAGE_SIZE = 256


def _rows(setup: RunSetup) -> int:
    """The generation batch's rows per GPU: grpo.generation_rows, which this module cannot import
    (grpo.py imports it; import-linter holds plan/memory acyclic)."""
    return setup.micro_batch_size * setup.grpo.steps_per_generation


def paged_groups(setup: RunSetup) -> tuple[int, ...]:
    """The layers of each attention type continuous batching gives a cache allocator of its own
    (continuous_batching/cache.py group_layers_by_attn_type): sliding and full layers apart where a
    model has both (Gemma-3, gpt-oss), else one group of every layer."""
    m = setup.model
    s = m.sliding_layers
    return (s, m.num_layers - s) if 0 < s < m.num_layers else (m.num_layers,)


def _paged_geometry(setup: RunSetup) -> tuple[int, int, int]:
    """(bytes of a sector, data sectors, max_tokens_read) of the PagedAttentionCache transformers
    builds for ContinuousBatchingConfig.num_blocks = :func:`paged_num_blocks` (cache.py
    PagedAttentionCache.__init__, PagedAttentionMemoryHandler.num_sectors_from_config): a page is
    PAGE_SIZE tokens of one layer's keys and values; an allocator's block is a page of each of its
    layers; a sector is the least common multiple of the allocators' blocks (and 128 bytes); the
    capacity target, num_blocks whole-model blocks, is rounded up to sectors; each allocator may
    read every page of the cache as its own blocks, so the tokens read are bounded by the smallest
    group's (allocator num_blocks x tokens_per_page, the largest). One group: a sector is a
    whole-model block, num_blocks sectors, num_blocks x PAGE_SIZE tokens read. Measured: held-out
    seed 1012 (Gemma-3, two sliding and two full layers), 34 sectors of 2 MiB and 8,192 tokens read
    for 16 blocks."""
    m = setup.model
    page = 2 * m.num_kv_heads * m.head_dim * PAGE_SIZE * dtype_bytes(setup)[0]
    groups = paged_groups(setup)
    sector = math.lcm(*(page * n for n in groups), 128)
    sectors = max(1, math.ceil(paged_num_blocks(setup) * page * m.num_layers / sector))
    return sector, sectors, PAGE_SIZE * (sectors * sector // page) // min(groups)


def paged_cache_bytes(setup: RunSetup) -> int:
    """The PagedAttentionCache the plan asks transformers for: the data sectors that hold every
    row's whole prompt + completion in pages of PAGE_SIZE tokens, and the two trash sectors
    (cache.py: ``torch.zeros(non_trash_bytes + trash_bytes)``)."""
    sector, sectors, _ = _paged_geometry(setup)
    return (sectors + 2) * sector


def paged_max_batch_tokens(setup: RunSetup) -> int:
    """ContinuousBatchingConfig.max_batch_tokens the plan passes: the whole generation batch's
    prompts in one forward, as the generation_prefill moment counts them (transformers' default
    8192 is the cap)."""
    return min(8192, _rows(setup) * setup.grpo.prompt_len)


def paged_mask_bytes(setup: RunSetup) -> int:
    """The static attention mask continuous batching allocates once per attention group with SDPA
    or eager attention (continuous_batching/input_outputs.py _setup_static_tensors: [1, 1,
    max_batch_tokens, max_tokens_read + max_batch_tokens] in the model's dtype, one per layer type
    of the cache; async batching, which would double it, is off whenever a mask is needed:
    initialization.py decide_use_async_batching). With two groups each may read the whole cache
    as its own (:func:`_paged_geometry`), so each mask is wider than the rows' tokens. Measured:
    in-sample seed 156, SmolLM3 LoRA fp32, 9.44 MB; held-out seed 1012, Gemma-3 QLoRA fp32, two
    masks of 512 x 8,704 (35.65 MB; planned 18.9 MB before)."""
    if setup.attention not in ("sdpa", "eager"):
        return 0
    tokens = paged_max_batch_tokens(setup)
    read = _paged_geometry(setup)[2]
    return tokens * (read + tokens) * dtype_bytes(setup)[0] * len(paged_groups(setup))


def paged_num_blocks(setup: RunSetup) -> int:
    """ContinuousBatchingConfig.num_blocks for :func:`paged_cache_bytes`."""
    rows = _rows(setup)
    return rows * math.ceil((setup.grpo.prompt_len + setup.grpo.completion_len) / PAGE_SIZE)


__all__ = ["PAGE_SIZE", "paged_cache_bytes", "paged_groups", "paged_mask_bytes", "paged_max_batch_tokens",
           "paged_num_blocks"]
