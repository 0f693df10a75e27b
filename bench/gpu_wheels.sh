#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) exactly the wheels bench/gpu_check.sh installs on the device
# machine. That machine (/work/.library/device/KINDS.md, nvidia-h200) has python 3.12, torch 2.11
# (CUDA 13), transformers 5.17, peft, accelerate 1.15, typer, rich, pyarrow, pandas ... but no
# pydantic, no datasets, no bitsandbytes and no package access; the tree that travels is at most
# 64 MiB, these wheels included. Run here, in the repo root, once per session:  bash bench/gpu_wheels.sh
#
# What travels and why (pinned: the versions lowvram is developed and tested with, /work/main/.venv):
#   transformers 5.24.0   5.17 is below lowvram's bound (TrainingArguments.activation_checkpointing
#                         and PreTrainedModel.activation_checkpointing_enable first in 5.23)
#   peft 0.21.2           the machine's peft version is not recorded; carry the one lowvram is tested on
#   bitsandbytes 0.50.2   absent; its wheel holds libbitsandbytes_cuda130.so for torch's CUDA 13
#   pydantic 2.14.4 + pydantic-core 2.50.5 + annotated-types 0.8.0 + typing-inspection 0.4.5
#                         absent (lowvram.recipe); typing-extensions 4.16.0 because pydantic needs
#                         >=4.16 and the machine's version is not recorded
#   datasets 5.2.0 + dill 0.4.1 + multiprocess 0.70.19
#                         absent (lowvram.train.data); its other needs (pyarrow, pandas, xxhash,
#                         fsspec, tqdm, huggingface-hub, pyyaml) are on the machine
# accelerate 1.15.0 is the machine's own. Size: about 61 MB of wheels (bitsandbytes 43 MB,
# transformers 13.5 MB) + the tree (about 3 MB): under the 64 MiB of one call; the script fails
# if the folder goes over 60 MiB so the tree keeps its room.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
WHEELS=(
  transformers==5.24.0 peft==0.21.2 bitsandbytes==0.50.2
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
)
rm -rf .whl && mkdir .whl
# The device README's download line (manylinux platforms listed; bitsandbytes is manylinux_2_24).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${WHEELS[@]}"
ls -l .whl
n=$(ls .whl/*.whl | wc -l)
kib=$(du -sk .whl | cut -f1)
echo "$n wheels, $((kib / 1024)) MiB"
if [ "$n" -ne "${#WHEELS[@]}" ]; then echo "error: expected ${#WHEELS[@]} wheels, got $n" >&2; exit 1; fi
if [ "$kib" -gt $((60 * 1024)) ]; then echo "error: .whl/ is over 60 MiB: the call's 64 MiB would not hold the tree" >&2; exit 1; fi
