#!/usr/bin/env bash
# The GPU check in one call (issue 3: calibrate the planner's CUDA overheads).
#
# Prepare here (no GPU needed), once per session, in the repo root:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#     -d .whl bitsandbytes==0.50.2
# Then run on the device machine with `.whl` carried:  bash bench/gpu_check.sh
# It prints predicted vs torch.cuda.max_memory_allocated/reserved (and the memory outside the
# allocator) and writes $OUT/gpu_check.json after every technique; at most ~8 minutes (device call
# timeout_s 590). Test it on CPU first: python bench/gpu_check.py --dry-run (no GPU needed).
# Then commit that output under bench/results/ and calibrate lowvram.plan.memory.cuda_overheads().
set -u
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
python3 -c "import bitsandbytes as b; print('bitsandbytes', b.__version__)" || echo "bitsandbytes missing: the QLoRA and 8-bit rows will fail"
timeout 560 python3 bench/gpu_check.py | tee "${OUT:-/tmp}/gpu_check.txt"
