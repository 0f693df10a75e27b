"""FSDP2 against the real libraries: one process over gloo on the CPU, built as a launched worker
builds it (tests/fsdp_step.py: accelerate's launch environment from lowvram's config, lowvram's
load_model / build_training_args / build_trainer, Trainer.train())."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[1]  # tests/

BASE = dict(device="cpu", mixed_precision="fp32", gradient_checkpointing=False, micro_batch_size=1,
            grad_accum=2, lora=False, quantization="none", optimizer="adamw", offload="fsdp",
            attention="sdpa", loss="standard", gpus=1)


def fsdp_step(tmp_path: Path, model_dir: Path, max_steps: int = 1, **plan) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join(
        [str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, str(HERE / "fsdp_step.py"), str(model_dir), str(tmp_path),
                        json.dumps({**BASE, **plan}), str(max_steps)],
                       cwd=tmp_path, env=env, text=True, capture_output=True, timeout=300)
    lines = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    assert r.returncode == 0 and lines, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_bitsandbytes_8bit_adamw_fails_at_fsdp2s_first_step(tmp_path, tiny_model_dir):
    """What lowvram.plan.setup.offload_conflict refuses (issue 24 item 1): the Trainer's
    adamw_bnb_8bit on FSDP2's DTensor shards raises in bitsandbytes' update kernel (on GPUs "got
    mixed torch.Tensor and DTensor"; in one CPU process no DTensor sharding rule is registered).
    If this stops failing, bitsandbytes handles DTensors: drop the refusal."""
    out = fsdp_step(tmp_path, tiny_model_dir, optimizer="adamw_8bit")
    assert out["distributed_type"] == "DistributedType.FSDP" and out["sharded"] > 0
    err = out.get("error", "")
    assert "bitsandbytes" in err and ("DTensor" in err or "sharding strategy" in err), out


@pytest.mark.slow  # ~15 s each; the 8-bit case above runs by default
@pytest.mark.parametrize("optimizer", ["paged_adamw_8bit", "paged_adamw_32bit"])
def test_every_bitsandbytes_optimizer_fails_under_fsdp2(tmp_path, tiny_model_dir, optimizer):
    out = fsdp_step(tmp_path, tiny_model_dir, optimizer=optimizer)
    assert "bitsandbytes" in out.get("error", ""), out


def test_fsdp2_bf16_full_finetuning_keeps_the_dtype_the_plan_counts(tmp_path, tiny_model_dir):
    """Issue 24 item 2: with the Trainer's bf16=True, accelerate's fsdp2_prepare_model upcast every
    trainable bf16 parameter to fp32 (weights, gradients and AdamW state twice the plan). lowvram
    now trains FSDP2 bf16 full fine-tuning without autocast: the shards stay in the dtype the
    planner counts for them (plan.states.dtype_bytes), here after a real optimizer step."""
    import torch

    from lowvram.plan.memory.states import dtype_bytes
    from lowvram.plan.model.catalog import resolve_model
    from lowvram.plan.setup import RunSetup

    out = fsdp_step(tmp_path, tiny_model_dir, mixed_precision="bf16")
    assert "error" not in out, out
    assert out["distributed_type"] == "DistributedType.FSDP" and out["sharded"] > 0
    assert out["trainable_dtypes_before"] == ["torch.bfloat16"]
    planned = dtype_bytes(RunSetup(resolve_model("llama-2-7b"), precision="bf16", offload="fsdp", gpus=4))[0]
    assert [getattr(torch, d.removeprefix("torch.")).itemsize for d in out["trainable_dtypes"]] == [planned], out
    assert out["mixed_precision"] == "no"  # no Trainer autocast: what keeps accelerate from upcasting
