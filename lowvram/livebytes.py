"""Exact tensor memory on any device: a live-bytes tracker, and the run's peak memory by step.

:class:`LiveBytes` is a ``TorchDispatchMode`` that records the untyped storage of every tensor an
op returns (``storage._cdata`` -> ``nbytes``) and subtracts it through ``weakref.finalize`` when
the storage dies. Tensors that existed before the mode (params, buffers, optimizer state, inputs,
bitsandbytes quant states) are registered first. On CPU this is the exact tensor memory (it agrees
to the byte with torch.distributed._tools.mem_tracker.MemTracker, about 10x slower, and with the
profiler's memory events; measured); process RSS is useless for it.

Compiled code (torchao's optimizer step, ``torch.compile``) runs compiled inside the mode, as it
runs without it (``ignore_compile_internals``: dynamo would otherwise skip every frame under a
dispatch mode and run it eagerly); the buffers inductor's CPU code allocates itself
(``torch._C._dynamo.guards._empty_strided_cpu``, which no dispatch mode sees) are followed by a
patch installed at the first ``__enter__`` (the generated module binds the function when it
loads) and counted by every tracker active then; the aten ops it falls back to are dispatched
and counted as any op. Checked against torch.profiler's memory events on torchao's AdamW8bit and
AdamW4bit steps (tests/plan/test_torchao.py).

An optional ``cap_bytes`` turns it into an emulated card: crossing the cap raises
``torch.OutOfMemoryError`` exactly where a GPU of that size would.

A torch utility: imports nothing of lowvram; torch and transformers are imported inside
functions (importing lowvram stays instant). Users: lowvram.check.step (the measured step),
lowvram.train.run.run (the peak of a run on CPU), benches.
"""

from __future__ import annotations

import weakref
from typing import Any


def _dispatch_base():
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


class _Counter:
    """Shared state the finalizers update (they must not keep the mode alive).

    With ``snapshot`` on, it also keeps what was alive at the highest point (``top``) as
    {serial: nbytes}; each storage gets a serial number (storage addresses are reused), and
    ``tags`` names what some serials are (weights, optimizer, gradients, logits).
    """

    def __init__(self, snapshot: bool = False) -> None:
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        self.phase = "setup"
        self.peak_phase = "setup"
        self.snapshot = snapshot
        self.serials: dict[int, int] = {}
        self.next_serial = 0
        self.tags: dict[int, str] = {}
        self.top = 0
        self.top_phase = "setup"
        self.top_live: dict[int, int] = {}
        self._at_top = False

    def resize(self, key: int, nbytes: int) -> None:
        """A tracked storage changed size in place (FSDP2 frees and refills its unsharded
        parameters with ``UntypedStorage.resize_``; the storage object lives on)."""
        old = self.live.get(key)
        if old is None or old == nbytes:
            return
        if nbytes < old and self.snapshot:
            self.take_snapshot()
        self.live.pop(key)
        self.current -= old
        if self.snapshot:
            self.serials.pop(key, None)
        self.add(key, nbytes)

    def add(self, key: int, nbytes: int) -> None:
        self.live[key] = nbytes
        self.current += nbytes
        if self.snapshot:
            self.serials[key] = self.next_serial
            self.next_serial += 1
            if self.current > self.top:
                self.top, self.top_phase, self._at_top = self.current, self.phase, True
        if self.current > self.peak:
            self.peak = self.current
            self.peak_phase = self.phase

    def take_snapshot(self) -> None:
        """Record what is alive now if this is the highest point so far (called before a drop)."""
        if self._at_top:
            self.top_live = {self.serials[k]: n for k, n in self.live.items()}
            self._at_top = False

    def drop(self, key: int) -> None:
        if self.snapshot:
            self.take_snapshot()
            self.serials.pop(key, None)
        n = self.live.pop(key, None)
        if n is not None:
            self.current -= n


_ACTIVE: list = []  # the trackers inside their ``with``: compiled code's buffers count in each


def _follow_inductor_buffers() -> None:
    """Count the CPU buffers inductor's generated code allocates (see the module); once."""
    import torch._C._dynamo.guards as guards

    original = guards._empty_strided_cpu
    if getattr(original, "_lowvram_followed", False):
        return

    def empty_strided_cpu(*args, **kwargs):
        t = original(*args, **kwargs)
        for tracker in _ACTIVE:
            tracker.track(t)
        return t

    empty_strided_cpu._lowvram_followed = True
    guards._empty_strided_cpu = empty_strided_cpu


def _follow_threads(tracker, base):
    """Count what threads started inside the tracker allocate: a dispatch mode is thread-local,
    and transformers' continuous batching (``generate_batch``, TRL's paged generation) runs its
    forward passes in a thread of its own (generation/continuous_batching/continuous_api.py
    ContinuousBatchingManager.start). Each new thread enters the same mode around its ``run``.
    Returns the original ``Thread.run`` for ``__exit__`` to put back."""
    import threading

    original = threading.Thread.run

    def run(thread):
        base.__enter__(tracker)
        try:
            original(thread)
        finally:
            base.__exit__(tracker, None, None, None)

    threading.Thread.run = run
    return original


def _make_tracker_class():
    base = _dispatch_base()

    class LiveBytes(base):  # type: ignore[misc, valid-type]
        """Live tensor bytes and their peak; ``cap_bytes`` raises torch.OutOfMemoryError."""

        def __init__(self, cap_bytes: int | None = None, snapshot: bool = False,
                     logits_dim: int | None = None) -> None:
            super().__init__()
            self.counter = _Counter(snapshot)
            self.cap_bytes = cap_bytes
            self.logits_dim = logits_dim  # outputs whose last dim is the vocabulary: "logits"

        # -- bookkeeping
        @property
        def current_bytes(self) -> int:
            return self.counter.current

        @property
        def peak_bytes(self) -> int:
            return self.counter.peak

        @property
        def peak_phase(self) -> str:
            return self.counter.peak_phase

        def set_phase(self, phase: str) -> None:
            self.counter.phase = phase

        def reset_peak(self) -> None:
            self.counter.peak = self.counter.current

        def track(self, t: Any, tag: str | None = None) -> None:
            import torch

            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                return
            flatten = getattr(type(t), "__tensor_flatten__", None)
            if flatten is not None:
                # A wrapper subclass (FSDP2's DTensor parameters, shards, gradients) owns no
                # memory itself: count the plain tensors it wraps (its local shard).
                for name in flatten(t)[0]:
                    self.track(getattr(t, name), tag)
                return
            st = t.untyped_storage()
            key = st._cdata
            if key in self.counter.live:
                return
            self.counter.add(key, st.nbytes())
            if self.counter.snapshot:
                if tag is None and self.logits_dim and t.dim() >= 2 and t.shape[-1] == self.logits_dim:
                    tag = "logits"
                if tag is not None:
                    self.counter.tags[self.counter.serials[key]] = tag
            weakref.finalize(st, self.counter.drop, key)

        def tag(self, t: Any, tag: str) -> None:
            """Name what an already tracked tensor's storage is (e.g. a gradient)."""
            serial = self.counter.serials.get(t.untyped_storage()._cdata)
            if serial is not None:
                self.counter.tags[serial] = tag

        def register(self, *objs: Any, tag: str | None = None) -> None:
            """Count tensors that exist already (nested lists/dicts/modules/optimizers)."""
            for obj in objs:
                for t in iter_tensors(obj):
                    self.track(t, tag)

        def peak_breakdown(self) -> dict[str, int]:
            """Bytes alive at the highest point, by tag ("other" for untagged): needs snapshot."""
            self.counter.take_snapshot()
            out: dict[str, int] = {}
            for serial, n in self.counter.top_live.items():
                k = self.counter.tags.get(serial, "other")
                out[k] = out.get(k, 0) + n
            return out

        # -- the mode
        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True  # compiled code runs compiled (see the module)

        def __enter__(self):
            # UntypedStorage.resize_ (FSDP2's free_storage/alloc_storage) is no dispatched op:
            # follow it here, so storage emptied in place stops counting (and counts again when
            # refilled).
            import torch

            counter, original = self.counter, torch.UntypedStorage.resize_

            def resize_(storage, size):
                out = original(storage, size)
                counter.resize(storage._cdata, storage.nbytes())
                return out

            self._storage_resize = original
            torch.UntypedStorage.resize_ = resize_
            _follow_inductor_buffers()
            self._thread_run = _follow_threads(self, base)
            _ACTIVE.append(self)
            return super().__enter__()

        def __exit__(self, *exc):
            import threading

            import torch

            torch.UntypedStorage.resize_ = self._storage_resize
            threading.Thread.run = self._thread_run
            if self in _ACTIVE:
                _ACTIVE.remove(self)
            return super().__exit__(*exc)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            from torch.utils._pytree import tree_leaves

            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                self.track(t)
            if self.cap_bytes is not None and self.counter.current > self.cap_bytes:
                import torch

                raise torch.OutOfMemoryError(
                    f"emulated card of {self.cap_bytes} bytes: {self.counter.current} bytes live "
                    f"after {func} (phase {self.counter.phase})"
                )
            return out

    return LiveBytes


_TRACKER_CLASS = None


def LiveBytes(cap_bytes: int | None = None, snapshot: bool = False,  # noqa: N802 - a class factory
              logits_dim: int | None = None):
    """A new live-bytes tracker (a TorchDispatchMode; use it as a context manager)."""
    global _TRACKER_CLASS
    if _TRACKER_CLASS is None:
        _TRACKER_CLASS = _make_tracker_class()
    return _TRACKER_CLASS(cap_bytes, snapshot, logits_dim)


def _quant_state_tensors(qs: Any):
    """bitsandbytes QuantState tensors (absmax, code, offset, nested state2): not params."""
    import torch

    for name in ("absmax", "code", "offset"):
        t = getattr(qs, name, None)
        if isinstance(t, torch.Tensor):
            yield t
    nested = getattr(qs, "state2", None)
    if nested is not None:
        yield from _quant_state_tensors(nested)


def iter_tensors(obj: Any, _seen: set | None = None):
    """Every tensor reachable from a module, optimizer, tensor or container."""
    import torch

    seen = set() if _seen is None else _seen
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
        qs = getattr(obj, "quant_state", None)
        if qs is not None:
            yield from _quant_state_tensors(qs)
        scb = getattr(obj, "SCB", None)
        if isinstance(scb, torch.Tensor):
            yield scb
    elif isinstance(obj, torch.nn.Module):
        for t in obj.parameters():
            yield from iter_tensors(t, seen)
        for t in obj.buffers():
            yield from iter_tensors(t, seen)
        for m in obj.modules():
            qs = getattr(m, "quant_state", None)
            if qs is not None:
                yield from _quant_state_tensors(qs)
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            yield from iter_tensors(state, seen)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v, seen)
    else:
        for v in getattr(obj, "__dict__", {}).values():
            if isinstance(v, (torch.Tensor, dict, list, tuple)):
                yield from iter_tensors(v, seen)


# --------------------------------------------------------------------------------------------
# Measured peak during `lowvram train`


def memory_history_callback(device: str, tracker=None):
    """A TrainerCallback recording, at every logging step, the peak since the previous one:
    ``history`` = [[step, peak_bytes], ...] (CPU: the live-bytes tracker; CUDA:
    max_memory_allocated, then its peak is reset). ``overall_peak_bytes`` keeps the maximum."""
    from transformers import TrainerCallback

    class MemoryHistory(TrainerCallback):
        def __init__(self) -> None:
            self.history: list[list[int]] = []
            self.overall_peak_bytes = 0
            self.overall_reserved_bytes = 0

        def _take(self) -> tuple[int, int] | None:
            if tracker is not None:
                peak = int(tracker.peak_bytes)
                tracker.reset_peak()
                return peak, 0
            if device == "cuda":
                import torch

                peak, reserved = int(torch.cuda.max_memory_allocated()), int(torch.cuda.max_memory_reserved())
                torch.cuda.reset_peak_memory_stats()
                return peak, reserved
            return None

        def on_log(self, args, state, control, logs=None, **kwargs):
            took = self._take()
            if took is None:
                return
            self.overall_peak_bytes = max(self.overall_peak_bytes, took[0])
            self.overall_reserved_bytes = max(self.overall_reserved_bytes, took[1])
            step = int(state.global_step)
            if self.history and self.history[-1][0] == step:  # the end-of-training log, same step
                self.history[-1][1] = max(self.history[-1][1], took[0])
            else:
                self.history.append([step, took[0]])

        def finish(self) -> tuple[int, int]:
            """(peak, reserved) over the whole run, including what followed the last log."""
            took = self._take()
            if took is not None:
                self.overall_peak_bytes = max(self.overall_peak_bytes, took[0])
                self.overall_reserved_bytes = max(self.overall_reserved_bytes, took[1])
            return self.overall_peak_bytes, self.overall_reserved_bytes

    return MemoryHistory()
