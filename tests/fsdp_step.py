"""One FSDP2 training step in one process over gloo, on the CPU, the way a launched worker of
``lowvram train --gpus N`` makes it: the environment accelerate launch derives from lowvram's
accelerate config (library_configs.launch_environment), lowvram's load_model, build_datasets,
build_training_args and build_trainer, then ``Trainer.train()`` for ``training.max_steps``.

Run as ``python tests/fsdp_step.py MODEL_DIR WORKDIR PLAN_JSON``; prints one JSON line: the error
(type and message) if training raised, and the sharded parameters' dtypes after it ran.
Used by tests/train/test_fsdp2_step.py (a subprocess: the process group and accelerate's state are
per process).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _recipe(model_dir: str, work: Path, max_steps: int):
    from lowvram.recipe import parse_recipe

    with (work / "data.jsonl").open("w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"{i}+{i}=", "completion": f"{2 * i}"}) + "\n")
    return parse_recipe(f"""
model: {{name_or_path: {model_dir}}}
data: {{datasets: [{{path: data.jsonl, format: completion}}], validation: null}}
training: {{max_steps: {max_steps}, batch_size: 2, seq_len: 32, output_dir: out, save_steps: 100,
           logging_steps: 1, report_to: none, warmup_ratio: 0.0}}
""", source=work / "recipe.yaml")


def main(model_dir: str, workdir: str, plan_json: str, max_steps: int = 1) -> dict:
    from lowvram.plan.types import Plan
    from lowvram.train.run.launch import LaunchSpec, accelerate_config
    from tests.library_configs import launch_environment

    work = Path(workdir)
    data = json.loads(plan_json)
    plan = Plan(**{**data, "lora_targets": tuple(data.get("lora_targets", ("all-linear",)))})
    env = launch_environment(accelerate_config(plan, LaunchSpec(gpus=1, cpu=True)), work)
    # what torchrun gives rank 0 of a one-process world
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), CUDA_VISIBLE_DEVICES="")
    os.environ.update(env)

    from lowvram.train.build.model import load_model
    from lowvram.train.build.trainer import build_trainer, build_training_args
    from lowvram.train.data.build import build_datasets
    from lowvram.train.data.collate import make_collator

    recipe = _recipe(model_dir, work, max_steps)
    loaded = load_model(recipe, plan)
    before = sorted({str(p.dtype) for p in loaded.model.parameters() if p.requires_grad})
    bundle = build_datasets(recipe, loaded.tokenizer)
    args = build_training_args(recipe, plan)
    trainer = build_trainer(loaded, bundle, args, make_collator(loaded.tokenizer), loss=plan.loss)
    out: dict = {"trainable_dtypes_before": before, "mixed_precision": trainer.accelerator.mixed_precision}
    try:
        trainer.train()
    except Exception as e:  # the library's own failure is what the caller checks
        out["error"] = f"{type(e).__name__}: {e}"
    from torch.distributed.tensor import DTensor

    params = list(trainer.model.parameters())
    out["sharded"] = sum(isinstance(p, DTensor) for p in params)
    out["trainable_dtypes"] = sorted({str(p.dtype) for p in params if p.requires_grad})
    out["frozen_dtypes"] = sorted({str(p.dtype) for p in params if not p.requires_grad})
    out["distributed_type"] = str(trainer.accelerator.distributed_type)
    return out


if __name__ == "__main__":
    result = main(*sys.argv[1:4], *(int(a) for a in sys.argv[4:5]))
    print("RESULT " + json.dumps(result))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
