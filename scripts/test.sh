#!/usr/bin/env bash
# Set up (with the dev, interop, kernels, ray, s3 and fp8 extras), lint (ruff) and type-check tokenloom/
# (mypy, configured in pyproject.toml; its cache in .mypy_cache makes reruns quick), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev,interop,kernels,ray,s3,fp8,tensorboard bash scripts/setup.sh
.venv/bin/ruff check tokenloom tests bench
.venv/bin/python -m mypy
# Three workers on two cores (TEST_WORKERS; a third fills the time the others wait on launched ranks,
# timeouts and sleeps) take whole modules each (--dist loadscope: a module's shared process
# groups and one-process baselines are computed once, on one worker); the 15 slowest tests are
# printed so the CI budget stays visible.
exec .venv/bin/python -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-3}" --dist loadscope --durations=15 "$@"
