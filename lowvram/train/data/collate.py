"""After tokenizing: hold out an eval split, pack samples into windows, build the Datasets, and
pad each batch (PadCollator)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lowvram.errors import DataError
from lowvram.train.types import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

if TYPE_CHECKING:  # pragma: no cover
    import datasets


# Each training row's index in the train Dataset, passed through the run's collator (rows=True)
# as a batch key so that a step names the rows it trained on (train/run/guard.py takes it out of the
# batch before the model sees it).
ROW_COLUMN = "lowvram_row"


@dataclass(frozen=True)
class PadCollator:
    """Right-pads a batch to its longest row (rounded up to ``pad_to_multiple_of``).

    input_ids get ``pad_id``, labels ``-100``. No attention_mask by default (``padding_mask``
    False): in a causal LM a right-padded tail is never seen by a real token (each token attends
    only to earlier positions), so the mask changes nothing the loss sees, and without it
    transformers takes SDPA's ``is_causal`` path instead of building a b x 1 x s x s mask, which
    on CPU also forces the math kernel that stores the attention matrix (measured: +13% peak at
    seq 224 on the tiny Llama, tests/planning/test_fit_to_card.py). It keeps the run on the shape the
    planner models. ``padding_mask=True`` adds attention_mask ``1``/``0`` for other uses. Packed rows (with
    ``position_ids``) get no attention_mask: transformers then reads the sample boundaries from
    the position_ids resets and keeps attention inside each sample; the padding tail gets its
    own run of positions so it forms a separate block. That detection is skipped when the model
    builds a KV cache, so train packed data with ``model.config.use_cache = False``
    (transformers 5.24, ``masking_utils._preprocess_mask_arguments``).

    ``flash_varlen`` (the model runs flash-attention): packed batches also carry the varlen
    kwargs (``flash_varlen_kwargs``), since flash-attention finds samples from position_ids only
    in a one-row batch.
    """

    pad_id: int
    pad_to_multiple_of: int | None = None
    padding_mask: bool = False
    flash_varlen: bool = False
    rows: bool = False  # pass each row's index (ROW_COLUMN) on: the run's collator, train/run/guard.py takes it out

    def __call__(self, features: list[dict]) -> dict:
        import torch

        longest = max(len(f["input_ids"]) for f in features)
        m = self.pad_to_multiple_of
        if m:
            longest = -(-longest // m) * m
        packed = "position_ids" in features[0]
        batch: dict[str, list] = {"input_ids": [], "labels": []}
        if packed or self.padding_mask:
            batch["position_ids" if packed else "attention_mask"] = []
        for f in features:
            ids = list(f["input_ids"])
            n = longest - len(ids)
            batch["input_ids"].append(ids + [self.pad_id] * n)
            labels = list(f["labels"]) if "labels" in f else list(ids)
            batch["labels"].append(labels + [IGNORE_INDEX] * n)
            if packed:
                batch["position_ids"].append(list(f["position_ids"]) + list(range(n)))
            elif self.padding_mask:
                mask = list(f["attention_mask"]) if "attention_mask" in f else [1] * len(ids)
                batch["attention_mask"].append(mask + [0] * n)
        if self.rows and ROW_COLUMN in features[0]:
            batch[ROW_COLUMN] = [int(f[ROW_COLUMN]) for f in features]
        out = {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}
        if packed and self.flash_varlen:
            out.update(flash_varlen_kwargs(out["position_ids"]))
        return out


def flash_varlen_kwargs(position_ids) -> dict:
    """The sample boundaries of a packed (b x s) batch as flash-attention's varlen kwargs
    (``cu_seq_lens_q/k``, ``max_length_q/k``), from transformers' own
    ``prepare_fa_kwargs_from_position_ids`` over the flattened rows (every row starts a sample at
    position 0, and a padding tail its own run).

    Why: transformers 5.25 ``_flash_attention_forward`` finds packed samples from position_ids
    only when the batch has one row (``_is_packed_sequence``: ``batch_size != 1`` -> False); with
    two or more rows and no mask it runs plain causal flash-attention over the whole window, so
    packed samples attend to each other. Given these kwargs it takes its varlen branch for any
    batch size (q, k and v flattened to b*s tokens, one causal block per sample): the same kernel
    and memory the planner counts for flash-attention (activations.masked_layers: no mask)."""
    from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(position_ids)
    # flash_attn_varlen_func takes the longest sample as a Python int (DataCollatorWithFlattening
    # sends ints too); the Trainer moves only the tensors to the device.
    return {"cu_seq_lens_q": cu_q, "cu_seq_lens_k": cu_k, "max_length_q": int(max_q), "max_length_k": int(max_k)}


def make_collator(tokenizer: PreTrainedTokenizerBase, pad_to_multiple_of: int | None = None, padding_mask: bool = False,
                  flash_varlen: bool = False, rows: bool = False) -> PadCollator:
    """Dynamic per-batch padding with the tokenizer's pad id (its eos id if it has no pad).
    ``flash_varlen``: the model runs flash-attention (PadCollator). ``rows``: each batch names its
    training rows (ROW_COLUMN), for a Trainer whose training_step takes them out (train/run/guard.py)."""
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id
    if pad_id is None:
        raise DataError(
            "the tokenizer has neither a pad token nor an eos token",
            "use the tokenizer of a causal language model (it defines eos_token)",
        )
    return PadCollator(pad_id=pad_id, pad_to_multiple_of=pad_to_multiple_of, padding_mask=padding_mask,
                       flash_varlen=flash_varlen, rows=rows)


def hold_out(samples: list, fraction: float, seed: int) -> tuple[list, list]:
    """Hold out ``fraction`` of the samples (at least one), chosen with the recipe seed."""
    if len(samples) < 2:
        raise DataError(
            f"data.validation: {fraction} needs at least 2 samples, got {len(samples)}",
            "add data or remove data.validation",
        )
    n_eval = min(len(samples) - 1, max(1, round(len(samples) * fraction)))
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    held = set(order[:n_eval])
    train = [s for i, s in enumerate(samples) if i not in held]
    evals = [s for i, s in enumerate(samples) if i in held]
    return train, evals


def columns(samples: list[tuple]) -> dict[str, list]:
    """(input_ids, labels) samples, or (input_ids, labels, image paths) ones (format image_chat:
    an ``images`` column the ImageCollator reads)."""
    cols = {
        "input_ids": [s[0] for s in samples],
        "attention_mask": [[1] * len(s[0]) for s in samples],
        "labels": [s[1] for s in samples],
    }
    if samples and len(samples[0]) == 3:
        cols["images"] = [list(s[2]) for s in samples]
    return cols


def pack(samples: list[tuple[list[int], list[int]]], seq_len: int) -> dict[str, list]:
    """Greedy in-order packing of whole samples into windows of at most ``seq_len`` tokens.

    Samples are never split (each is already <= seq_len). ``position_ids`` restart at 0 for each
    sample; with no attention_mask in the batch (see ``PadCollator``) and ``use_cache`` off,
    transformers builds a block-diagonal causal mask from them, so attention does not cross
    sample boundaries (tests/train/test_data.py checks the logits equal unpacked ones). Each
    sample keeps its own labels, so no loss crosses a boundary either (a sample's first token is
    never a label: it is predicted from nothing of its own).
    """
    cols: dict[str, list] = {"input_ids": [], "attention_mask": [], "labels": [], "position_ids": []}
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []

    def flush() -> None:
        if ids:
            cols["input_ids"].append(list(ids))
            cols["attention_mask"].append([1] * len(ids))
            cols["labels"].append(list(labels))
            cols["position_ids"].append(list(positions))
            ids.clear(), labels.clear(), positions.clear()

    for s_ids, s_labels in samples:
        if len(ids) + len(s_ids) > seq_len:
            flush()
        ids.extend(s_ids)
        labels.extend([IGNORE_INDEX] + s_labels[1:])
        positions.extend(range(len(s_ids)))
    flush()
    return cols


def to_dataset(cols: dict[str, list]) -> datasets.Dataset:
    import datasets

    features = datasets.Features({k: datasets.Sequence(datasets.Value("string" if k == "images" else "int32"))
                                  for k in cols})
    return datasets.Dataset.from_dict(cols, features=features)
