"""Multi-GPU model states: DeepSpeed ZeRO settings and what each engine keeps on the GPU, sharding
of weights, gradients and optimizer states over the ranks (ZeRO, FSDP2), offload to host RAM, and
what FSDP / DDP hold beyond a rank's share."""

from __future__ import annotations

from dataclasses import dataclass, replace

from lowvram.plan import constants as fitted
from lowvram.plan.memory.states import (
    dtype_bytes,
    gradient_bytes,
    lora_parameters,
    optimizer_bytes,
    shape_numel,
    trainable_parameters,
    trainable_tensors,
    weight_bytes,
)
from lowvram.plan.model.models import (
    block_linears,
    count_parameters,
    embedding_numel,
    lm_head_numel,
    norm_numel,
)
from lowvram.plan.setup import DEEPSPEED_CPU_OPTIMIZER, RunSetup

# --------------------------------------------------------------------------------------------
# DeepSpeed ZeRO: what each engine keeps on the GPU beyond its share of the model states


@dataclass(frozen=True)
class ZeroSettings:
    """The ZeRO settings a lowvram DeepSpeed run trains with, in elements.

    lowvram writes accelerate's DeepSpeed *plugin* keys only (lowvram.train.run.launch.accelerate_config:
    zero_stage, offload_optimizer_device, offload_param_device); accelerate builds the DeepSpeed
    config from them without any bucket key (accelerate/utils/dataclasses.py,
    DeepSpeedPlugin.__post_init__, the ``config = {...}`` branch without hf_ds_config, v1.15.0
    lines 1302-1318). accelerate fills reduce_bucket_size (h*h), stage3_prefetch_bucket_size
    (0.9*h*h) and stage3_param_persistence_threshold (10*h) from the model's hidden size only for
    keys set to ``"auto"`` (accelerate/accelerator.py, _prepare_deepspeed, lines 2295-2326;
    transformers' HfTrainerDeepSpeedConfig.trainer_config_finalize the same): absent keys are not
    ``auto``, so DeepSpeed's own defaults apply (deepspeed/runtime/zero/config.py,
    DeepSpeedZeroConfig): the values below. :func:`auto_zero_settings` gives what ``auto`` would.
    """

    stage: int
    offload_optimizer: bool
    offload_param: bool
    reduce_bucket_size: int = 500_000_000  # reduce_bucket_size: Field(pp_int(5e8))
    allgather_bucket_size: int = 500_000_000  # allgather_bucket_size: Field(pp_int(5e8))
    prefetch_bucket_size: int = 50_000_000  # stage3_prefetch_bucket_size: Field(pp_int(5e7))
    param_persistence_threshold: int = 100_000  # stage3_param_persistence_threshold: pp_int(1e5)
    max_live_parameters: int = 1_000_000_000  # stage3_max_live_parameters: pp_int(1e9)
    contiguous_gradients: bool = True  # contiguous_gradients: bool = True

    @property
    def overlap_comm(self) -> bool:
        # DeepSpeedZeroConfig.overlap_comm_valid: None -> True for stage 3 only.
        return self.stage == 3


# plan.offload -> (ZeRO stage, offload optimizer, offload params); lowvram.train.run.launch.BACKENDS
# writes the same (tests/plan/test_memory.py checks that the two agree).
ZERO_OFFLOADS = {
    "optimizer": (2, True, False), "zero2": (2, False, False), "zero2-offload": (2, True, False),
    "zero3": (3, False, False), "zero3-offload": (3, True, True), "full": (3, True, True),
}


def zero_settings(setup: RunSetup) -> ZeroSettings | None:
    """The ZeRO settings of ``setup``'s offload (None: not DeepSpeed)."""
    if setup.offload not in ZERO_OFFLOADS:
        return None
    return ZeroSettings(*ZERO_OFFLOADS[setup.offload])


def auto_zero_settings(setup: RunSetup) -> ZeroSettings | None:
    """What the three hidden-size keys become when a DeepSpeed config sets them to ``auto``
    (accelerate/accelerator.py lines 2322-2326: h*h, int(0.9*h*h), 10*h)."""
    zs = zero_settings(setup)
    if zs is None:
        return None
    h = setup.model.hidden_size
    return replace(zs, reduce_bucket_size=h * h, prefetch_bucket_size=int(0.9 * h * h),
                   param_persistence_threshold=10 * h)


def _zero_element_bytes(setup: RunSetup) -> int:
    """DeepSpeed runs the model in the dtype its bf16/fp16 section enables (accelerate enables it
    from mixed_precision): 2 bytes, 4 for fp32."""
    return 4 if setup.precision == "fp32" else 2


def zero_residency_bytes(setup: RunSetup, zs: ZeroSettings | None = None) -> dict[str, int]:
    """Bytes one DeepSpeed process holds on the GPU beyond its partition of the model states.

    - ``gathered`` (ZeRO-3, with and without offload_param): parameters all-gathered for compute
      stay resident until ``stage3_max_live_parameters`` elements are live (and are not released
      while reused within stage3_max_reuse_distance, 1e9 too): at most that many, at least the
      largest module gathered at once (the embedding, or the untied lm_head)
      (deepspeed/runtime/zero/partitioned_param_coordinator.py; DeepSpeedZeroConfig docs).
    - ``prefetch``: ``stage3_prefetch_bucket_size`` elements fetched ahead of use.
    - ``persistent``: every parameter under ``stage3_param_persistence_threshold`` elements is
      never partitioned (norms, biases, LoRA A matrices of r x d_in), on the GPU whatever the
      offload (DeepSpeedZeroConfig.param_persistence_threshold).
    - ``buckets``: the gradient reduction buffer of ``reduce_bucket_size`` elements in the model
      dtype, allocated whole however few parameters train: ZeRO-3's ``__ipg_bucket_flat_buffer``
      (stage3.py, with contiguous_gradients), ZeRO-1/2's ``ipg_buffer`` made in ``backward()``
      (stage_1_and_2.py; a second one with overlap_comm, off for stage 2). The allgather of
      updated parameters writes in place into the flat partitions in chunks of
      ``allgather_bucket_size`` (deepspeed/runtime/utils.py all_gather_dp_groups; nothing with
      one GPU): no buffer of its own.
    Weights at ``weight_bytes``' average bytes per element (quantized bases included).
    """
    zs = zs or zero_settings(setup)
    out = dict(gathered=0, prefetch=0, persistent=0, buckets=0)
    if zs is None:
        return out
    elt = _zero_element_bytes(setup)
    out["buckets"] = zs.reduce_bucket_size * elt * (2 if zs.overlap_comm and zs.stage < 3 else 1)
    if zs.stage < 3:
        return out
    spec = setup.model
    lora = lora_parameters(setup) if setup.lora else 0
    total = count_parameters(spec) + lora
    per_elt = weight_bytes(setup) / total
    largest = max(spec.vocab_size * spec.hidden_size, *(lin.numel for lin in block_linears(spec)))
    live = min(total, max(zs.max_live_parameters, largest))
    out["gathered"] = int(live * per_elt)
    out["prefetch"] = int(min(zs.prefetch_bucket_size, total - live) * per_elt)
    shapes = trainable_tensors(replace(setup, lora=False))
    small = sum(shape_numel(s) for s in shapes if shape_numel(s) < zs.param_persistence_threshold)
    out["persistent"] = small * dtype_bytes(setup)[0]
    if setup.lora:
        adapters = trainable_tensors(setup)
        out["persistent"] += 4 * sum(shape_numel(s) for s in adapters if shape_numel(s) < zs.param_persistence_threshold)
    return out


def zero_optimizer_bytes(setup: RunSetup) -> int:
    """A ZeRO optimizer without optimizer offload: fp32 master partitions of the trainable
    parameters (stage_1_and_2.py ``single_partition_of_fp32_groups``, stage3.py
    ``fp32_partitioned_groups_flat``) plus the wrapped optimizer's state over those fp32
    parameters (before partitioning over N)."""
    master = 4 * trainable_parameters(setup)
    return master + optimizer_bytes(replace(setup, precision="fp32"))


def shard(setup: RunSetup, weights: int, grads: int, optim: int) -> tuple[int, int, int, int]:
    """Per-GPU model states and the host RAM (bytes per process) of what is offloaded.

    Sharding (ZeRO paper, Rajbhandari et al. 2020): ZeRO-2 and FSDP shard gradients and optimizer
    states over the N ranks, ZeRO-3 and FSDP the weights too. A ZeRO optimizer keeps fp32 master
    partitions (zero_optimizer_bytes).
    DeepSpeed optimizer offload (ZeRO-Offload, Ren et al. 2021, sec. 4.1; DeepSpeed
    stage_1_and_2 keeps ``single_partition_of_fp32_groups`` and their fp32 gradients on the
    offload device, DeepSpeedCPUAdam its fp32 exp_avg/exp_avg_sq): 16 bytes per trainable
    parameter in CPU RAM (fp32 master copy 4 + Adam 8 + fp32 gradient 4), whatever optimizer the
    recipe named (offload_conflict). The gradients leave the GPU through the reduction bucket
    (ZeRO-2: ``ipg_buffer``, then copied into the CPU fp32 partition; ZeRO-3: the partitioned
    gradient buffer is allocated on the offload device, stage3.py ``grad_partitions_flat_buffer``):
    none stay on the GPU beyond the bucket (zero_residency_bytes).
    DeepSpeed parameter offload (ZeRO-3 ``offload_param``): every weight at its 16-bit dtype in
    CPU RAM; the GPU keeps the gathered, prefetched and persistent ones (zero_residency_bytes).
    FSDP2 CPU offload (torch ``CPUOffloadPolicy``): the sharded parameters, their
    gradients and the optimizer states (at the parameters' dtype; the step runs on the CPU) in
    CPU RAM (the GPU keeps the gathered units and one layer's gradients before they move).
    Each rank offloads only its own partition: host RAM per process is 1/N of the total.
    """
    n = max(1, setup.gpus)
    o = setup.offload
    host = 0
    if o in ("zero2", "zero3"):
        optim = zero_optimizer_bytes(setup)
    if o in DEEPSPEED_CPU_OPTIMIZER:
        host += 16 * trainable_parameters(setup)
        optim = 0
        grads = 0  # on the CPU; the reduction bucket: zero_residency_bytes
    if o == "fsdp-offload":
        host += weights + grads + optim
        weights = grads = optim = 0  # the gathered units and layer gradients: sharding_overhead_bytes
    if o in ("zero3-offload", "full"):
        host += weights
        weights = 0
    if o in ("zero2", "zero3", "fsdp"):
        optim //= n
    if o in ("zero2", "zero3", "fsdp"):
        grads //= n
    if o in ("zero3", "fsdp"):
        weights //= n
    return weights, grads, optim, host // n


def root_weight_bytes(setup: RunSetup) -> int:
    """Weights outside the decoder layers (embeddings, final norm, lm_head), at their dtype."""
    spec = setup.model
    w, _ = dtype_bytes(setup)
    numel = embedding_numel(spec) + norm_numel(spec) + lm_head_numel(spec)
    return numel * (4 if setup.quantization != "none" and setup.kbit_prepare else w)


def layer_weight_bytes(setup: RunSetup) -> int:
    """One decoder layer's weights, quantized storage and LoRA adapters included."""
    return (weight_bytes(setup) - root_weight_bytes(setup)) // max(1, setup.model.num_layers)


def sharding_overhead_bytes(setup: RunSetup) -> tuple[int, int, int]:
    """(weights, layer gradients, gradient buckets) a process holds beyond its share of the
    model states, per engine.

    FSDP2 (torch ``fully_shard`` as accelerate applies it with TRANSFORMER_BASED_WRAP: one unit
    per decoder layer, the root for embeddings, final norm and lm_head) all-gathers a unit's
    parameters into full-size tensors before its forward and backward and frees them after
    (reshard_after_forward); the root is not resharded between forward and backward (FSDP2 docs,
    ``fully_shard``). At the peak: the root's full parameters plus two layers' worth (the
    all-gather output and the parameters copied out of it, or the next layer prefetched). In a
    layer's backward its full-size gradients and the reduce-scatter input (two layers' worth of
    trainable gradients) join them: the peak with gradient checkpointing, whose recompute
    happens inside the backward.
    DDP (torch DistributedDataParallel, gradient_as_bucket_view=False as the Trainer leaves it)
    keeps its gradient buckets, one more copy of the trainable gradients, for the whole run.
    Measured on CPU (2-3 processes over gloo, lowvram.measure; bench/multi_process_accuracy.py):
    DDP within 0.8%, FSDP2 without checkpointing +0.5% / +3.5% (full / LoRA); with checkpointing
    the recompute term (recompute_bytes) over-predicts small models by 11-14%.
    DeepSpeed ZeRO (any stage, offloaded or not): zero_residency_bytes, from the engine's
    defaults as lowvram's generated config leaves them (ZeroSettings). Not measured: DeepSpeed
    does not run on the CPU.
    """
    if setup.offload in ("fsdp", "fsdp-offload"):
        layers = max(1, setup.model.num_layers)
        # constants.FSDP_GATHERED_LAYERS, FSDP_LAYER_GRADIENTS (fitted: bench/multi_process_accuracy.py)
        return (root_weight_bytes(setup) + fitted.FSDP_GATHERED_LAYERS.of(layer_weight_bytes(setup)),
                fitted.FSDP_LAYER_GRADIENTS.of(gradient_bytes(setup)) // layers, 0)
    if setup.offload == "none" and setup.gpus > 1:
        return 0, 0, gradient_bytes(setup)
    zero = zero_residency_bytes(setup)
    return zero["gathered"] + zero["prefetch"] + zero["persistent"], 0, zero["buckets"]


__all__ = [
    "auto_zero_settings", "layer_weight_bytes", "root_weight_bytes", "shard",
    "sharding_overhead_bytes", "ZERO_OFFLOADS", "zero_optimizer_bytes", "zero_residency_bytes",
    "zero_settings", "ZeroSettings",
]
