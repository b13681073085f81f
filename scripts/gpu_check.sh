#!/usr/bin/env bash
# The GPU check: trials through the trial layer (one process each), a real OOM on an emulated
# 24 GiB card and a clean trial after it in the same process, then one table. On a machine
# without CUDA it runs the reduced CPU version (what CI runs). Needs PyTorch only.
#   bash scripts/gpu_check.sh OUT_DIR [--mode auto|gpu|cpu-reduced] [--only TEXT]
set -euo pipefail
if [ $# -lt 1 ] || [ -z "$1" ] || [ "${1#-}" != "$1" ]; then
    echo "usage: bash scripts/gpu_check.sh OUT_DIR [--mode auto|gpu|cpu-reduced] [--only TEXT]" >&2
    exit 2
fi
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="$1"
shift
mkdir -p "$out"
out="$(cd "$out" && pwd)"
# $PYTHON if set, else the project's virtualenv when there is one, else python3.
if [ -n "${PYTHON:-}" ]; then
    python="$PYTHON"
elif [ -x "$repo/.venv/bin/python" ]; then
    python="$repo/.venv/bin/python"
else
    python="python3"
fi
echo "gpu-check: $python, JSON into $out/summary.json and $out/trials/"
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" scripts/gpu_check.py "$out" "$@"
