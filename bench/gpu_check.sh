#!/usr/bin/env bash
# The GPU check in one device call (issue 3: calibrate the planner's CUDA overheads; issue 24:
# self-sufficient on the device machine as it is).
#
# Prepare here (no GPU needed), once per session, in the repo root:
#   bash bench/gpu_wheels.sh      # the wheels the machine lacks, into the git-ignored .whl/ (~58 MiB)
# Then run on the device machine with `.whl` carried (device call timeout_s 540):
#   bash bench/gpu_check.sh
# It installs the wheels into $LOWVRAM_SITE (default /tmp/site) ahead of the machine's packages on
# PYTHONPATH, prints the versions it found (and stops, exit 1, if one is below lowvram's bounds),
# then prints predicted vs torch.cuda.max_memory_allocated/reserved (and the memory outside the
# allocator), rewriting $OUT/gpu_check.json after every row and teeing the table to
# $OUT/gpu_check.txt. Under 8 minutes: the wheels install in seconds, the measuring starts no case
# whose estimate would end past 390 s (gpu_check.BUDGET_S; its plan: `--plan`; no checkpoint or
# model file is written, a disk reserve is kept) and is killed at 450 s. Exit status: the measuring's (pipefail): 1
# when no case was measured, 124 when killed at 450 s (the rows so far are in the JSON).
# Arguments go to bench/gpu_check.py: `bash bench/gpu_check.sh --dry-run` runs the same on a CPU
# (bench/results/gpu_check_dry_run-*.txt: the dry run in a venv that reproduces the machine).
# Then commit the GPU output under bench/results/ and calibrate lowvram.plan.memory.memory.cuda_overheads().
set -u -o pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
SITE=${LOWVRAM_SITE:-/tmp/site}
WHEELS=${LOWVRAM_WHEELS:-.whl}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  # the device README's install line; --no-deps: each wheel's needs are either carried or there
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl || exit 1
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
else
  echo "no wheels in $WHEELS/: using the installed packages only (bench/gpu_wheels.sh makes .whl/)" >&2
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
  TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv 2>/dev/null \
  || echo "nvidia-smi: not available"
out=${OUT:-/tmp}
timeout 450 "$PYTHON" bench/gpu_check.py "$@" 2>&1 | tee "$out/gpu_check.txt"
