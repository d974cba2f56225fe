#!/usr/bin/env bash
# Set up (with the dev, interop, kernels, ray, s3 and fp8 extras), lint (ruff) and type-check tokenloom/
# (mypy, configured in pyproject.toml; its cache in .mypy_cache makes reruns quick), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev,interop,kernels,ray,s3,fp8,tensorboard bash scripts/setup.sh
.venv/bin/ruff check tokenloom tests bench
# The checkout's bytecode, written once: an environment with PYTHONDONTWRITEBYTECODE set would
# otherwise compile the imported modules from source again in every process a test starts (torchrun's
# ranks, cli.py runs), a few tenths of a second of CPU each.
.venv/bin/python -m compileall -q tokenloom tests bench scripts cli.py >/dev/null
# mypy (single-threaded, about 100 s from a cold cache on a slow machine) checks beside the tests
# instead of before the first of them; its report follows theirs and either failing fails the run.
mypy_log=$(mktemp)
.venv/bin/python -m mypy >"$mypy_log" 2>&1 &
mypy_pid=$!
# Three workers on two cores (TEST_WORKERS; a third fills the time the others wait on launched ranks,
# timeouts and sleeps) take whole modules each (--dist loadscope: a module's shared process
# groups and one-process baselines are computed once, on one worker); the 15 slowest tests are
# printed so the CI budget stays visible.
status=0
.venv/bin/python -m pytest -q -p no:cacheprovider -n "${TEST_WORKERS:-3}" --dist loadscope --durations=15 "$@" || status=$?
mypy_status=0
wait "$mypy_pid" || mypy_status=$?
cat "$mypy_log"
rm -f "$mypy_log"
if [ "$mypy_status" -ne 0 ]; then
    echo "scripts/test.sh: mypy failed (exit $mypy_status)" >&2
    status=1
fi
exit "$status"
