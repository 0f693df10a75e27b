"""lowvram.train.build.galore_cpu: galore_torch's AdamW8bit (optimizer galore_adamw_8bit and its
layerwise form) stepping on a machine without CUDA, against the real optimizer and bitsandbytes'
own 8-bit AdamW."""

from __future__ import annotations

import pytest

pytest.importorskip("galore_torch")
torch = pytest.importorskip("torch")

if torch.cuda.is_available():
    pytest.skip("a CUDA machine steps galore_torch's AdamW8bit as it is", allow_module_level=True)


def _restore_step(monkeypatch):
    """Each test sees the class as galore_torch ships it (the adapter patches it once per process)."""
    from galore_torch import GaLoreAdamW8bit

    step = GaLoreAdamW8bit.step
    if getattr(step, "_lowvram_cpu_step", False):  # only our wrapper: torch's no_grad wraps too
        step = step.__wrapped__
    monkeypatch.setattr(GaLoreAdamW8bit, "step", step)


def test_without_the_adapter_its_step_fails_on_torch_cuda_synchronize(monkeypatch):
    """Why the adapter exists: the only CUDA call in the step is torch.cuda.synchronize()."""
    from galore_torch import GaLoreAdamW8bit

    _restore_step(monkeypatch)
    w = torch.nn.Parameter(torch.randn(64, 128))
    opt = GaLoreAdamW8bit([{"params": [w], "rank": 8, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}])
    w.grad = torch.randn(64, 128)
    with pytest.raises((AssertionError, RuntimeError), match="CUDA") as err:
        opt.step()
    assert any(f.name == "synchronize" for f in __import__("traceback").extract_tb(err.value.__traceback__))


def test_with_it_a_tensor_it_does_not_project_steps_as_bitsandbytes_adamw8bit(monkeypatch):
    """A parameter outside GaLore's group is stepped by bitsandbytes' 8-bit blockwise Adam alone:
    the same update as bitsandbytes' own AdamW8bit (whose step needs no adapter) to the bit."""
    import bitsandbytes as bnb
    from galore_torch import GaLoreAdamW8bit

    from lowvram.train.build.galore_cpu import allow_cpu_step
    from lowvram.train.build.trainer import _forget_bitsandbytes_overrides

    _restore_step(monkeypatch)
    _forget_bitsandbytes_overrides()  # an earlier test's Trainer may have left (0, 0) at 32 bit
    assert allow_cpu_step() and allow_cpu_step()  # idempotent: wrapped once
    assert not getattr(GaLoreAdamW8bit.step.__wrapped__, "_lowvram_cpu_step", False)
    torch.manual_seed(0)
    start = torch.randn(128, 64)  # 8192 elements: 8-bit moments (min_8bit_size 4096)
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    opts = [GaLoreAdamW8bit([ours], lr=1e-2), bnb.optim.AdamW8bit([theirs], lr=1e-2)]
    for _ in range(3):
        g = torch.randn(128, 64)
        for p, opt in zip((ours, theirs), opts, strict=True):
            p.grad = g.clone()
            opt.step()
    assert not torch.equal(ours, start)
    assert torch.equal(ours, theirs)
    assert opts[0].state[ours]["state1"].dtype == torch.uint8


def test_with_it_a_projected_weight_steps_and_synchronize_is_untouched_outside(monkeypatch):
    from galore_torch import GaLoreAdamW8bit

    from lowvram.train.build.galore_cpu import allow_cpu_step

    _restore_step(monkeypatch)
    synchronize = torch.cuda.synchronize
    allow_cpu_step()
    assert torch.cuda.synchronize is synchronize
    w = torch.nn.Parameter(torch.randn(64, 128))
    start = w.detach().clone()
    opt = GaLoreAdamW8bit([{"params": [w], "rank": 8, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}])
    w.grad = torch.randn(64, 128)
    opt.step()
    assert w.shape == (64, 128) and not torch.equal(w, start)
    assert opt.state[w]["projector"].ortho_matrix.shape == (64, 8)
    assert torch.cuda.synchronize is synchronize  # restored after the step
    with pytest.raises((AssertionError, RuntimeError), match="CUDA"):
        torch.cuda.synchronize()


def test_the_trainer_builds_and_steps_the_layerwise_form_on_the_cpu(tmp_path):
    """Through lowvram's own builder (build_trainer installs the adapter): the Trainer's layerwise
    8-bit GaLore steps every parameter in its hook during the backward."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from lowvram.check.builders import hf_config
    from lowvram.plan.choose.search import plan_for_setup
    from lowvram.plan.setup import RunSetup
    from lowvram.recipe.schema import Recipe
    from lowvram.train.build.model import prepare_model
    from lowvram.train.build.trainer import build_trainer, build_training_args
    from tests.plan.test_galore import TINY

    plan = plan_for_setup(RunSetup(TINY, optimizer="galore_adamw_8bit_layerwise", galore_rank=8, device="cpu"), "cpu", 16)
    recipe = Recipe.model_validate({"model": {"name_or_path": "x"}, "data": {"datasets": [{"path": "d"}]},
                                    "training": {"output_dir": str(tmp_path), "report_to": "none", "max_steps": 1}})
    torch.manual_seed(0)
    model = prepare_model(AutoModelForCausalLM.from_config(hf_config(TINY)), plan, seed=0)
    trainer = build_trainer(SimpleNamespace(model=model, tokenizer=None), SimpleNamespace(train=[], eval=None),
                            build_training_args(recipe, plan), None, optimizer=plan.optimizer)
    opt = trainer.create_optimizer()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 256, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is None for p in model.parameters())  # each stepped and dropped in its hook
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert len(opt.optimizer_dict) == len(before)


def test_a_new_trainer_forgets_the_last_ones_32_bit_override_by_position():
    """bitsandbytes records the Trainer's 32-bit Embedding override by position (group, index) in a
    process-wide manager: left there, every later 8-bit optimizer's first parameter got 32-bit state
    (the layerwise forms: all of them). build_trainer clears it first, as a new process starts."""
    import bitsandbytes as bnb

    from lowvram.train.build.trainer import _forget_bitsandbytes_overrides

    def first_state_dtype():
        p = torch.nn.Parameter(torch.randn(128, 64))  # 8192 elements: 8-bit (min_8bit_size 4096)
        opt = bnb.optim.AdamW8bit([p])
        p.grad = torch.randn_like(p)
        opt.step()
        return opt.state[p]["state1"].dtype

    manager = bnb.optim.GlobalOptimManager.get_instance()
    manager.index2config[(0, 0)] = {"optim_bits": 32}  # what check_overrides leaves after a Trainer
    manager.uses_config_override = True
    assert first_state_dtype() == torch.float32
    _forget_bitsandbytes_overrides()
    assert first_state_dtype() == torch.uint8
