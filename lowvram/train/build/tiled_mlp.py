"""Tiled MLP (Plan.tiled_mlp): every decoder layer's MLP runs through DeepSpeed's TiledMLP
(``deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP``, DeepSpeed >= 0.17, the code of
ALST, arXiv:2506.13996): the forward over the sequence in shards without autograd, saving only
the MLP's input; the backward recomputes and differentiates one shard at a time.

Why DeepSpeed's: it is pure PyTorch (runs on the CPU as on CUDA), it calls the MLP module's own
forward (so peft's LoRA Linears and bitsandbytes' 4-bit Linears inside the MLP run unchanged),
and DeepSpeed is already lowvram's ZeRO extra. Liger Kernel's LigerTiledSwiGLUMLP replaces the
module by its own (Triton SwiGLU: CUDA only, and no peft adapters inside it).

This module is the thin adapter between TiledMLP and a transformers / peft MLP module:

* the shard function is the module's original ``forward`` (gate/up/down or fc1/fc2 with their
  adapters), called inside the autocast state the forward ran under: TiledMLP's backward
  recomputes outside the Trainer's autocast (as torch.utils.checkpoint restores it, we do);
* the trainable parameters inside the module are its ``compute_params``;
* the backward's recompute of a shard draws from the random state its forward did (peft's
  lora.dropout masks as in the forward; TiledMLP itself keeps none);
* when the input needs no gradient but the MLP has trainable parameters (layer 0 under LoRA on
  the MLP alone: nothing upstream trains), the input is made a leaf that does, so the Function
  is recorded and the adapters get their gradients;
* the input goes in as its flattened (b*s, h) rows: TiledMLP's forward chunks dim -2 and its
  backward the flattened rows, which are the same shards only for one row per batch (with two
  rows they differ in content and may in number: torch.chunk of 9 positions into 4 gives 3, of
  18 rows 4, and the backward's recompute drew the wrong random state or none);
* under DDP (``one_grad_hook``) each trainable parameter's gradient reaches autograd's
  AccumulateGrad once per backward, as DDP's reducer requires ("Expected to mark a variable
  ready only once"): TiledMLP runs one ``torch.autograd.backward`` per shard, so every shard but
  the last differentiates detached aliases of the parameters (no copy) and their gradients are
  added to ``param.grad`` before the next shard runs; the last shard's backward then accumulates
  into the real parameters and fires DDP's hook once, with the whole gradient. The same tensors
  live as with per-shard accumulation (param.grad and one shard's gradient), so the memory the
  planner counts (lowvram.plan.memory.tiled) is unchanged. DeepSpeed itself only marks ZeRO's
  ``ds_grad_is_ready`` ("XXX: DDP, FSDP will need something similar", ulysses_sp.py).
"""

from __future__ import annotations

import types

# transformers' dense MLP classes end in "MLP" (LlamaMLP, Qwen2MLP, Phi3MLP, GemmaMLP, ...);
# mixture-of-experts blocks are not tiled (lowvram.plan.setup.tiled_mlp_conflict).
_SKIP = ("SparseMoe", "MoE", "Moe", "Experts")


def _is_dense_mlp(module) -> bool:
    name = type(module).__name__
    return name.endswith("MLP") and not any(s in name for s in _SKIP)


def mlp_modules(model) -> list:
    """The decoder layers' dense MLP modules of a (peft-wrapped) transformers model."""
    return [m for m in model.modules() if _is_dense_mlp(m)]


def _shard_forward(original, device_type: str, autocast: dict, states: list, aliased=None):
    """The module's own forward on one shard, under the autocast state of the tiled forward, and
    in the backward's recompute with the random state its forward shard drew from (peft's
    lora.dropout draws the same masks again), as torch.utils.checkpoint keeps it. ``aliased``
    (a _GradientOnce): every backward shard but the last runs on aliases of the parameters."""
    import torch

    def run(x):
        with torch.autocast(device_type=device_type, **autocast):
            return original(x)

    def fn(module, x):
        devices = [x.device] if x.device.type == "cuda" else []
        if not torch.is_grad_enabled():  # TiledMLP.forward: the shards in order, under no_grad
            states.append((torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]))
            return run(x)
        cpu_state, cuda_states = states.pop(0)  # TiledMLP.backward: the same shards, same order
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(cpu_state)
            for d, state in zip(devices, cuda_states, strict=True):
                torch.cuda.set_rng_state(state, d)
            if aliased is None:
                return run(x)
            aliased.add_pending()  # the previous shard's backward has run
            return run(x) if not states else aliased.run(module, run, x)
    return fn


class _GradientOnce:
    """Backward shards on detached aliases of a module's trainable parameters, their gradients
    added to the parameters' ``.grad`` by hand, so autograd accumulates into each parameter once
    per backward (the last shard). The module docstring says why (DDP)."""

    def __init__(self, module):
        self.named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.pending: list = []

    def run(self, module, forward, x):
        from torch.nn.utils.stateless import _reparametrize_module

        aliases = {n: p.detach().requires_grad_(True) for n, p in self.named}
        self.pending = [(p, aliases[n]) for n, p in self.named]
        with _reparametrize_module(module, aliases):  # torch.func.functional_call's swap
            return forward(x)

    def add_pending(self) -> None:
        for param, alias in self.pending:
            if alias.grad is None:
                continue
            if param.grad is None:
                param.grad = alias.grad
            else:
                param.grad.add_(alias.grad)
        self.pending = []


def _tiled_forward(module, x, shards: int | None = None, one_grad_hook: bool = False):
    import torch
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    n = shards or max(1, -(-x.shape[-2] // x.shape[-1]))  # DeepSpeed's ceil(seqlen / hidden)
    device_type = x.device.type
    autocast = {"enabled": torch.is_autocast_enabled(device_type)}
    if autocast["enabled"]:
        autocast["dtype"] = torch.get_autocast_dtype(device_type)
    params = [p for p in module.parameters() if p.requires_grad]
    if params and torch.is_grad_enabled() and not x.requires_grad:
        x = x.detach().requires_grad_(True)  # record the Function: the adapters need gradients
    aliased = _GradientOnce(module) if one_grad_hook and params else None
    fn = _shard_forward(module._lowvram_untiled_forward, device_type, autocast, states=[], aliased=aliased)
    rows = x.reshape(-1, x.shape[-1])  # the backward's shards (module docstring)
    return TiledMLP.apply(fn, module, rows, n, params).view(x.shape[:-1] + (-1,))


def enable_tiled_mlp(model, shards: int = 0, one_grad_hook: bool = False) -> int:
    """Route every dense MLP's forward through TiledMLP (``shards`` 0: ceil(seq_len / hidden)
    per call, DeepSpeed's rule, as lowvram.plan.memory.tiled counts it). ``one_grad_hook``: the model
    trains under DDP (module docstring). Returns how many modules."""
    import importlib.util

    from lowvram.errors import LowvramError

    if importlib.util.find_spec("deepspeed") is None:  # TiledMLP is DeepSpeed's (>= 0.17)
        raise LowvramError("the plan tiles the MLP (tiled_mlp), which runs DeepSpeed's TiledMLP, and "
                           "DeepSpeed is not installed", "pip install 'lowvram[deepspeed]', or set "
                           "techniques.tiled_mlp: off")
    modules = mlp_modules(model)
    for module in modules:
        if not hasattr(module, "_lowvram_untiled_forward"):
            module._lowvram_untiled_forward = module.forward
        module.forward = types.MethodType(
            lambda self, x, _n=shards or None: _tiled_forward(self, x, _n, one_grad_hook), module)
    return len(modules)


__all__ = ["enable_tiled_mlp", "mlp_modules"]
