"""Device memory a process holds outside PyTorch's caching allocator (issue 41 item 13), read
the way lowvram.gpumemory reads a run's (total - free - memory_reserved), for bench/gpu_check.py's
cases that run in a fresh process: a bare CUDA context, and one NCCL rank.

torch is imported inside the function (importing lowvram stays instant)."""

from __future__ import annotations

import os
import socket


def measure_outside(what: str, device: str = "cuda") -> dict:
    """Device memory this process holds outside the caching allocator (total - free - reserved),
    in a fresh process: ``bare`` after one tensor (the CUDA context, as the planning probe sees
    it); ``nccl`` after a one-rank NCCL process group's first all-reduce (its communicator and
    buffers: what DDP/FSDP/DeepSpeed add per GPU; one lent GPU holds one rank, and the NCCL
    buffers of N ranks are the per-peer ones of this communicator, NCCL_BUFFSIZE per channel and
    peer). On the CPU (the GPU check's dry run): a gloo group, 0 bytes (no allocator there)."""
    import torch

    dry_run = device == "cpu"
    x = torch.ones(16 * 2**20, device=device)  # 64 MiB, the all-reduce's payload
    if what == "nccl":
        import torch.distributed as dist

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        with socket.socket() as sock:  # a free port: other processes on this machine may hold one
            sock.bind(("127.0.0.1", 0))
            os.environ.setdefault("MASTER_PORT", str(sock.getsockname()[1]))
        dist.init_process_group("gloo" if dry_run else "nccl", rank=0, world_size=1)
        dist.all_reduce(x)
        dist.barrier()
    if dry_run:
        out = dict(outside_allocator=0, gpus=1)
    else:
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        out = dict(outside_allocator=(total - free) - torch.cuda.memory_reserved(), gpus=1)
    if what == "nccl":
        dist.destroy_process_group()
    return out
