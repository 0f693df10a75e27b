"""The lowest library versions lowvram runs on, and the check that the installed ones meet them.

pyproject.toml's dependencies carry the same lower bounds (tests/test_deps.py keeps the two equal).
Each bound was run once in a fresh virtualenv holding exactly those versions
(bench/lowest_versions.sh; bench/results/lowest_versions-*.txt). pip enforces them on install; this
module is for code that runs where pip's metadata was never consulted, such as the GPU check on a
machine whose packages come from its image and a PYTHONPATH of carried wheels
(bench/gpu_check.py), where transformers 5.17 otherwise fails deep inside TrainingArguments.
"""

from __future__ import annotations

# package: (lowest version, what sets it). Lower bounds only: pip then keeps a torch (a CUDA build
# matching the driver, say) that already meets them instead of replacing it.
MIN_VERSIONS: dict[str, tuple[str, str]] = {
    "torch": ("2.11", "FSDP2 on the CPU (lowvram train --gpus N --cpu, offload fsdp): torch 2.6's "
              "fully_shard all-gather calls Stream.record_event, which CPU streams lack there; 2.6 ran "
              "everything else; 2.7-2.10 not checked; transformers 5.23 itself asks >=2.6"),
    "transformers": ("5.23", "TrainingArguments(activation_checkpointing=, activation_checkpointing_kwargs=) "
                     "and PreTrainedModel.activation_checkpointing_enable(offload=) (lowvram.train.build.trainer, "
                     ".model), first in 5.23; 5.17-5.22 raise in TrainingArguments"),
    "peft": ("0.18", "LoraConfig/get_peft_model and PeftModel on transformers 5 models "
             "(0.17.1 imports transformers' HybridCache, gone in 5)"),
    "accelerate": ("1.8", "FSDP2's full-state-dict load onto the CPU mesh (utils/fsdp_utils.py "
                   "fsdp2_load_full_state_dict: 1.7 calls .cuda(), a --cpu FSDP launch fails), for the "
                   "FSDP2 launch config (fsdp_version: 2, lowvram.train.run.launch)"),
    "bitsandbytes": ("0.50", "bnb.optim 8-bit AdamW on CPU tensors (lowvram train --cpu, the CPU tests): 0.48-0.49 "
                     "raise in functional.is_on_gpu at the first step; transformers 5's BitsAndBytesConfig "
                     "asks >=0.46.1; bnb.functional.quantize_4bit under FakeTensorMode (lowvram.check.simulate)"),
    "datasets": ("4.0", "the lowest pip installs beside the other bounds (3.0 and 3.6: ResolutionImpossible with "
                 "transformers 5.23); lowvram's calls (Dataset.from_dict, load_dataset('json'), Features, "
                 "Sequence, Value: lowvram.train.data) are older: its data tests passed on 2.21, 3.0 and 3.6"),
}


def _parse(version: str):
    from packaging.version import Version  # transformers and accelerate both depend on packaging

    return Version(version.split("+")[0])  # "2.11.0+cu130": the local build tag does not count


def version_problems(installed: dict[str, str | None]) -> list[str]:
    """One line per bounded package that is missing or older than its bound; [] when all are met."""
    problems = []
    for name, (low, why) in MIN_VERSIONS.items():
        if name not in installed:
            continue
        got = installed[name]
        if got is None:
            problems.append(f"{name} is not installed (lowvram needs >={low}: {why})")
        elif _parse(got) < _parse(low):
            problems.append(f"{name} {got} is older than lowvram needs (>={low}: {why})")
    return problems


def installed_versions() -> dict[str, str | None]:
    """The installed version of each bounded package (None: not installed), as importlib sees it:
    the first distribution on sys.path, so a PYTHONPATH of carried wheels wins over site-packages."""
    from importlib import metadata

    found: dict[str, str | None] = {}
    for name in MIN_VERSIONS:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def pip_line() -> str:
    """The pip command that meets every bound (for a hint)."""
    return "pip install " + " ".join(f"'{n}>={low}'" for n, (low, _) in MIN_VERSIONS.items())


def cpu_adam_build_problems(environ: dict | None = None) -> list[str]:
    """What this machine lacks to run DeepSpeed's CPU Adam (the optimizer of every offload that
    moves the optimizer to the CPU: plan.setup.DEEPSPEED_CPU_OPTIMIZER); [] when it can run.

    deepspeed's wheel ships no compiled op (its git_version_info_installed.installed_ops lists
    cpu_adam False unless it was built with DS_BUILD_CPU_ADAM=1), so OpBuilder.load falls through
    to jit_load (deepspeed/ops/op_builder/builder.py): torch.utils.cpp_extension.load builds
    csrc/adam/cpu_adam.cpp with ninja and the C++ compiler $CXX (default c++), against Python.h.
    Without one of them the run fails at optimizer creation, after the model load. Read without
    importing deepspeed or torch (planning calls this for every plan)."""
    import importlib.util
    import os
    import shutil
    import sysconfig

    environ = os.environ if environ is None else environ
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return []  # the "deepspeed" extra is missing: said on its own (planning.budget.missing_extras)
    if _cpu_adam_prebuilt(os.path.join(spec.submodule_search_locations[0], "git_version_info_installed.py")):
        return []
    problems = []
    path = environ.get("PATH", "")
    cxx = environ.get("CXX", "c++")
    if shutil.which(cxx, path=path) is None:
        problems.append(f"no C++ compiler ({cxx}{', $CXX' if 'CXX' in environ else ''}) on PATH")
    if shutil.which("ninja", path=path) is None:
        problems.append("no ninja on PATH")
    include = sysconfig.get_paths()["include"]
    if not os.path.exists(os.path.join(include, "Python.h")):
        problems.append(f"no Python headers ({include}/Python.h)")
    return problems


def _cpu_adam_prebuilt(path: str) -> bool:
    """Whether deepspeed was installed with its cpu_adam op built (DS_BUILD_CPU_ADAM=1)."""
    import ast

    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (OSError, SyntaxError, ValueError):
        return False
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "installed_ops" for t in node.targets):
            try:
                return bool(ast.literal_eval(node.value).get("cpu_adam", False))
            except (ValueError, AttributeError):
                return False
    return False
