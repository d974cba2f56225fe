#!/usr/bin/env bash
# Set up (with the dev, interop, kernels, ray and s3 extras), type-check tokenloom/ (mypy, configured
# in pyproject.toml; its cache in .mypy_cache makes reruns quick), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev,interop,kernels,ray,s3 bash scripts/setup.sh
.venv/bin/python -m mypy
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=40 "$@"
