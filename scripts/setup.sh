#!/usr/bin/env bash
# Create ./.venv (once) and install tokenloom into it: torch first, so pip never pulls a
# CUDA build for a CPU machine, then the project (editable, with the native C++ build).
#   EXTRAS=dev,interop   optional extras to install (default: dev,interop; the test command adds kernels)
#   TORCH_SPEC=...        torch requirement (default torch==2.13.0; on a GPU cluster use your CUDA build)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS-dev,interop}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2> >(grep -v 'is ignored: it is neither' >&2); }
.venv/bin/python -c "import torch" 2>/dev/null || pip install "$TORCH_SPEC"
pip install -e ".${EXTRAS:+[$EXTRAS]}"
