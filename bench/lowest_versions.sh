#!/usr/bin/env bash
# lowvram on the lowest versions pyproject.toml admits (issue 24, item 10), in a fresh virtualenv:
#   1. python 3.12 venv with torch $TORCH (default 2.11.0, the lowest) from PyPI: the CUDA build (no
#      CPU wheel of an older torch is reachable here), which runs on the CPU; its nvidia-* wheels
#      take 3-5 GB of disk;
#   2. `pip install -e '.[dev]' -c bench/lowest_versions.txt`: every other bounded dependency at
#      its lower bound; torch is not in the constraints, so this step also shows that installing
#      lowvram into a venv that already holds another supported torch keeps that torch;
#   3. a representative subset of the tests (each library's API that sets a bound is exercised).
#
#   bash bench/lowest_versions.sh [VENV]      # default /work/venvs/lowest; output on stdout
#   TORCH=2.6.0 bash bench/lowest_versions.sh /work/venvs/torch26   # below the bound: FSDP2 on CPU fails
# The dated output is kept in bench/results/lowest_versions-<date>.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-/work/venvs/lowest}
PY312=${PY312:-/root/.pyenv/versions/3.12.1/bin/python}
TORCH=${TORCH:-2.11.0}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PIP_DISABLE_PIP_VERSION_CHECK=1

echo "# lowest_versions $(date -u +%Y-%m-%d) ($(git rev-parse --short HEAD)), venv $VENV"
rm -rf "$VENV"
"$PY312" -m venv "$VENV"
"$VENV/bin/pip" install -q "torch==$TORCH" 2>&1 | grep -vE "^WARNING: Location 'file:" || true
before=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
echo "torch before lowvram: $before"

"$VENV/bin/pip" install -e '.[dev]' -c bench/lowest_versions.txt 2>&1 \
  | grep -E '^(Requirement already satisfied: torch|Successfully installed)' || true
after=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
echo "torch after lowvram:  $after"
if [ "$before" != "$after" ]; then echo "error: pip replaced torch $before by $after" >&2; exit 1; fi

echo "## installed"
"$VENV/bin/python" - <<'EOF'
import sys
from importlib import metadata

from lowvram.deps import MIN_VERSIONS, version_problems

print("python", sys.version.split()[0])
got = {}
for name, (low, api) in MIN_VERSIONS.items():
    got[name] = metadata.version(name)
    print(f"{name:13} {got[name]:14} bound >={low:6}  {api}")
problems = version_problems(got)
print("bounds met" if not problems else "\n".join(problems))
sys.exit(1 if problems else 0)
EOF
for name in torch transformers peft accelerate bitsandbytes datasets; do
  v=$("$VENV/bin/python" -c "from importlib.metadata import version; print(version('$name'))")
  low=$(grep -iE "^$name==" bench/lowest_versions.txt | cut -d= -f3 || true)
  if [ -n "$low" ] && [ "$v" != "$low" ]; then echo "error: $name $v is not the lowest $low" >&2; exit 1; fi
done

# One test file or case per bounded API: training through the Trainer (TrainingArguments'
# activation_checkpointing, LoRA, 8-bit AdamW, QLoRA through BitsAndBytesConfig, datasets), merge
# and generate (PeftModel), the launch configs, two-process DDP and FSDP2 launches on the CPU
# (accelerate), the fake-mode simulation (bitsandbytes.functional under torch's FakeTensorMode),
# and the GPU check's dry run. About 15 minutes on 2 shared cores.
echo "## tests"
"$VENV/bin/python" -m pytest -rfE -p no:cacheprovider \
  tests/train/test_techniques.py tests/train/test_e2e.py tests/train/test_data.py \
  tests/train/test_after_training.py tests/train/test_launch.py tests/check/test_simulate.py \
  tests/test_deps.py tests/bench/test_gpu_check.py \
  "tests/train/test_multi_gpu.py::test_two_processes_match_one" \
  "tests/train/test_multi_gpu.py::test_fsdp_two_processes_match_one" 2>&1 \
  | grep -vE "^WARNING: Location 'file:" || exit 1
