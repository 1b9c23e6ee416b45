#!/bin/sh
# Checks and times sharkport's GPU modules on a machine with an NVIDIA GPU: each model gets 4 minutes.
# First, where sharkport is installed: python tools/gpu_check.py prepare (writes .gpu/). Then, on
# the GPU machine, from a copy of the repository with .gpu/ in it (Python 3.12 with numpy, torch,
# tokenizers, sentencepiece, safetensors, jinja2, pyyaml and tqdm; no network needed):
#     sh tools/gpu_check.sh [.gpu [--models smollm2,gemma3] [--timeout 240]]
# The table goes to $OUT (else .gpu/out): gpu_check.md and gpu_check.json.
set -eu
DIR=${1:-.gpu}
[ $# -gt 0 ] && shift
SITE=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$DIR"/wheels/*.whl
export PYTHONPATH="$SITE:$(pwd)" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
exec python3 tools/gpu_check.py run --dir "$DIR" "$@"
