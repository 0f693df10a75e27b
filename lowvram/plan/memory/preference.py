"""The memory terms of preference tuning (training.objective dpo, orpo, simpo, kto), read from TRL 1.16.

Every objective runs chosen and rejected in ONE forward: the collator stacks the chosen rows over
the rejected ones (trl/trainer/dpo_trainer.py DataCollatorForPreference.torch_call, L146-208:
``input_ids = prompt_chosen_ids + prompt_rejected_ids``; trl/experimental/orpo/orpo_trainer.py and
cpo_trainer.py ``concatenated_inputs``), so a micro-batch of b pairs is a forward of 2b rows of up
to max_length (= training.seq_len) tokens: :func:`policy_setup`, the SFT setup of 2b rows, whose
activations, recomputation and gradients lowvram.plan.memory.memory counts as for SFT.

What differs from SFT, term by term:

- **DPO's log-probs** (:func:`dpo_logprob_bytes`). DPOTrainer never makes the b x s x V logits:
  it patches the model with a fused LM head (trl/trainer/utils.py add_fused_lm_head, L1548-1700)
  that runs the backbone, then ``ChunkedLogProbFunction`` (trl/kernels/chunked_logprob.py L299-465)
  projects tiles of at most 4,096 positions x 32,768 vocabulary columns into one ``mm_buf`` and
  folds them into per-token statistics. Saved for the backward: the flattened hidden states
  (``reshape`` of the non-contiguous ``[:, :-1]`` slice: a copy; on CUDA only the completion
  positions, ``hidden_states[mask]``; counted at every position), int64 targets, fp32 log_z and
  entropy. Its backward allocates fp32 ``grad_hidden`` (N x h), with a trainable lm_head fp32
  ``grad_weight`` (V x h), another ``mm_buf``, and, without Triton (a CPU), the torch fallback
  ``_backward_tile``'s fp32 temporaries over one tile (``_CPU_BACKWARD_TILES``).
- **DPO's reference** (:func:`reference_weight_bytes`, :func:`reference_forward_bytes`). With
  LoRA the reference is the policy with its adapter disabled (DPOTrainer.__init__ L922-930:
  ``ref_model = None`` for a peft model; ``_compute_loss`` L1342-1350 ``use_adapter(..., None)``):
  no second copy. Full fine-tuning loads a frozen second copy in the policy's dtype
  (``create_model_from_path``, L931-945), unless precompute_ref_log_probs, which computes the
  reference log-probs in a pass before training (``_precompute_ref_logps`` L1168-1241: a no-grad
  forward per batch, weights only, no optimizer state yet: below the training step's peak) and
  keeps none. The reference forward runs after the policy's (``_compute_loss`` L1332-1352, under
  ``torch.no_grad``): every saved activation of the policy is alive beside the reference's
  transient, its last hidden states and the same fused head's forward tiles (``_CPU_FORWARD_TILES``).
- **KTO** (trl/trainer/kto_trainer.py, ``KTOTrainer._compute_loss`` L1370-1440): unpaired rows,
  so a micro-batch of b examples is ONE forward of b rows (:func:`rows_per_example`; TRL unpairs
  a paired dataset into two rows per pair itself, ``unpair_preference_dataset``). It uses DPO's
  fused head (``fused_lm_head=True``: the same saved tiles and backward, over b rows) and DPO's
  reference (adapter disabled under LoRA, a frozen copy under full fine-tuning unless
  precompute_ref_log_probs, L919-940). Its KL estimate adds two no-grad forwards of the batch's
  mismatched (prompt, other row's completion) rows (``_compute_kl_logps`` L1337-1367): the
  policy's runs BEFORE the grad forward (nothing saved is alive yet: below the reference moment),
  the reference's after it, one after the other beside every saved activation, each the size of
  the reference forward counted here. TRL refuses a micro-batch of 1 for loss_type kto (L844-846:
  the KL term would equal the implied reward): lowvram.plan.choose.request refuses it before training.
- **ORPO and SimPO** (:func:`full_logits_bytes`): TRL's experimental ORPOTrainer and CPOTrainer
  run the plain model forward and keep its 2b x s x V logits (orpo_trainer.py
  ``concatenated_forward`` L745-822: ``outputs.logits``; a ``.contiguous()`` copy of the chosen
  half for the NLL term, ``cross_entropy_loss``; ``selective_log_softmax`` over all rows); no
  reference model (ORPO's odds ratio and SimPO's length-normalized reward need none).
"""

from __future__ import annotations

from dataclasses import replace

from lowvram.plan import constants as fitted
from lowvram.plan.memory.activations import dtypes
from lowvram.plan.memory.states import dtype_bytes, weight_bytes
from lowvram.plan.setup import RunSetup

PREFERENCE_OBJECTIVES = ("dpo", "orpo", "simpo", "kto")
# The objectives scored by TRL's fused head and compared with a reference model (DPO, KTO); ORPO
# and SimPO keep the full logits and need no reference.
REFERENCE_OBJECTIVES = ("dpo", "kto")
# Online RL with generation through TRL (GRPOTrainer, RLOOTrainer): the recipe's grpo section,
# lowvram.train.build.grpo; their memory is planned in lowvram.plan's GRPO terms.
RL_OBJECTIVES = ("grpo", "rloo")
OBJECTIVES = ("sft", *PREFERENCE_OBJECTIVES, *RL_OBJECTIVES)  # grpo, rloo: lowvram.plan.memory.grpo

# trl/kernels/chunked_logprob.py: TOKEN_CHUNK_SIZE (positions per tile) and the chunk_size the
# fused head passes (trl/trainer/utils.py _CHUNKED_LOGPROB_CHUNK_SIZE); mm_buf is always
# min(N, 4096) x 32768 in the compute dtype, whatever the vocabulary.
TILE_TOKENS = 4096
TILE_COLUMNS = 32768
# fp32 tiles alive at once in the torch fallback (no Triton: CPUs), counted in the source:
# _forward_tile keeps z, exp(z - m) and e * z with the before-target mask (1 byte per element),
# 3.25 fp32 tiles; _backward_tile keeps y, z, log_p, p, grad beside is_target, is_target.float()
# and their difference: 7.25.
CPU_FORWARD_TILES = 3.25
_CPU_BACKWARD_TILES = 7.25
# Peak bytes per logit of the 2b rows in ORPO's and SimPO's loss path: TRL's own functions
# (CPOTrainer.get_batch_logps, ORPO's cross_entropy_loss) run on fp32 logits under the live-bytes
# tracker (2b=4 rows, s=128, V=1024: 16.7 and 18.7, the hidden states' gradient included);
# bf16 logits under autocast measure 6.7 and 8.8, counted as fp32 here (an upper bound).
FULL_LOGITS_BYTES_PER_LOGIT = {"simpo": fitted.SIMPO_LOGIT_BYTES.value, "orpo": fitted.ORPO_LOGIT_BYTES.value}  # constants/logits.py


def is_preference(setup: RunSetup) -> bool:
    return setup.objective in PREFERENCE_OBJECTIVES


def min_micro_batch_size(objective: str) -> int:
    """The smallest micro-batch an objective trains with: kto's KL term pairs each prompt with
    another row's completion of the same micro-batch, and TRL's KTOTrainer raises at start for a
    per-device batch of 1 (kto_trainer.py L844-846); every other objective takes 1."""
    return 2 if objective == "kto" else 1


def rows_per_example(setup: RunSetup) -> int:
    """Rows of the grad forward per micro-batch example: a pair's chosen and rejected (dpo, orpo,
    simpo), or one unpaired completion (kto)."""
    return 1 if setup.objective == "kto" else 2


def policy_setup(setup: RunSetup) -> RunSetup:
    """The SFT setup of the grad forward: 2b rows (chosen over rejected) of seq_len, or b (kto),
    with no dropout: every TRL preference trainer sets each ``nn.Dropout`` of the model to p = 0
    before training (``disable_dropout`` defaults to True in DPOConfig L185, KTOConfig L156,
    ORPOConfig L97 and CPOConfig L128; ``disable_dropout_in_model``, trl/trainer/utils.py L194),
    peft's lora_dropout modules included, and ATen's dropout at p = 0 returns its input itself
    (no mask, no copy): lora.dropout saves nothing. The model's own dropouts stay counted (an
    upper bound): many apply theirs as a float (``attention_dropout`` passed to the attention
    function, a functional dropout), which disable_dropout does not reach. The rows are padded
    to the batch's longest and carry an attention_mask (``padded``: DataCollatorForPreference pads
    input_ids and attention_mask, dpo_trainer.py L184-196; ORPO's and CPO's concatenated_inputs
    pad chosen and rejected to the longer of the two), so SDPA gets a mask in every layer
    (activations.masked_layers)."""
    return replace(setup, micro_batch_size=rows_per_example(setup) * setup.micro_batch_size, objective="sft",
                   lora_dropout=0.0, padded=True)


def _rows(setup: RunSetup) -> int:
    return rows_per_example(setup) * setup.micro_batch_size


def _positions(setup: RunSetup) -> int:
    """N, the positions the fused head scores: every row's s - 1 next-token labels."""
    return _rows(setup) * max(1, setup.seq_len - 1)


def tile_bytes(setup: RunSetup, n: int) -> tuple[int, int]:
    """(mm_buf, one fp32 tile of the torch fallback) for n positions (CUDA: no fallback)."""
    _, c, autocast = dtypes(setup)
    cc = 2 if autocast else c
    rows = min(n, TILE_TOKENS)
    mm_buf = rows * TILE_COLUMNS * cc
    fallback = rows * min(setup.model.vocab_size, TILE_COLUMNS) * 4 if setup.device == "cpu" else 0
    return mm_buf, fallback


def dpo_saved_bytes(setup: RunSetup) -> int:
    """What ChunkedLogProbFunction saves for DPO's and KTO's rows (:func:`fused_saved_bytes`)."""
    return fused_saved_bytes(setup, _positions(setup))


def fused_saved_bytes(setup: RunSetup, n: int) -> int:
    """What ChunkedLogProbFunction saves for the backward over n positions: the flattened hidden
    states (a copy), int64 targets, fp32 log_z and entropy; plus its per-token outputs (log-probs,
    entropy, mean logits: fp32; is_top1: bool) scattered to the batch's shape."""
    r, _, _ = dtypes(setup)
    return r * n * setup.model.hidden_size + (8 + 4 + 4) * n + (4 + 4 + 4 + 1) * n


def dpo_logprob_bytes(setup: RunSetup) -> int:
    """DPO's and KTO's fused head at the start of the backward (:func:`fused_head_bytes`)."""
    return fused_head_bytes(setup, _positions(setup))


def fused_head_bytes(setup: RunSetup, n: int) -> int:
    """The fused head's bytes over n positions at the start of the backward (the SFT logits'
    place): what it saved, and its backward's fp32 grad_hidden, mm_buf, the CPU fallback's tiles,
    and with a trainable lm_head (full fine-tuning) the fp32 grad_weight (V x h) and its cast to
    the weight dtype."""
    h, v = setup.model.hidden_size, setup.model.vocab_size
    mm_buf, tile = tile_bytes(setup, n)
    total = fused_saved_bytes(setup, n) + 4 * n * h + mm_buf + int(_CPU_BACKWARD_TILES * tile)
    if not setup.lora:
        w, _ = dtype_bytes(setup)
        total += 4 * v * h + (w * v * h if w != 4 else 0)
    return total


def reference_weight_bytes(setup: RunSetup) -> int:
    """DPO's (and KTO's) frozen reference copy: full fine-tuning without precompute_ref_log_probs;
    none for LoRA (the adapter disabled), ORPO and SimPO (no reference)."""
    if setup.objective not in REFERENCE_OBJECTIVES or setup.lora or setup.precompute_ref:
        return 0
    return weight_bytes(setup)


def reference_forward_bytes(setup: RunSetup) -> int:
    """The reference forward's transient beside every saved activation of the policy (DPO
    without precompute): its last hidden states and their flattened copy, and the fused head's
    forward (mm_buf, the CPU fallback's tiles)."""
    if setup.objective not in REFERENCE_OBJECTIVES or setup.precompute_ref:
        return 0
    r, _, _ = dtypes(setup)
    n = _positions(setup)
    t = _rows(setup) * setup.seq_len
    mm_buf, tile = tile_bytes(setup, n)
    return r * t * setup.model.hidden_size + r * n * setup.model.hidden_size + mm_buf + int(CPU_FORWARD_TILES * tile)


def full_logits_bytes(setup: RunSetup) -> int:
    """ORPO/SimPO: the logits of all 2b rows and what their loss keeps (FULL_LOGITS_BYTES_PER_LOGIT
    per logit): the fp32 logits, kept (``selective_log_softmax``'s per-row logsumexp saves its
    input), and in the backward each row's gradient, their ``unbind`` stack, the ``[:, :-1]``
    slice's full-size zeros and the gather's scatter; ORPO's NLL on the chosen half adds its
    saved log-softmax over half the rows."""
    t = 2 * setup.micro_batch_size * setup.seq_len
    return FULL_LOGITS_BYTES_PER_LOGIT[setup.objective] * t * setup.model.vocab_size


def objective_logits_bytes(setup: RunSetup) -> int:
    """The objective's loss-side bytes at the start of the backward."""
    return dpo_logprob_bytes(setup) if setup.objective in REFERENCE_OBJECTIVES else full_logits_bytes(setup)


__all__ = [
    "CPU_FORWARD_TILES", "dpo_logprob_bytes", "dpo_saved_bytes", "full_logits_bytes", "fused_head_bytes",
    "fused_saved_bytes", "tile_bytes", "is_preference", "objective_logits_bytes",
    "min_micro_batch_size", "OBJECTIVES", "RL_OBJECTIVES", "policy_setup", "PREFERENCE_OBJECTIVES", "REFERENCE_OBJECTIVES", "reference_forward_bytes",
    "reference_weight_bytes", "rows_per_example",
]
