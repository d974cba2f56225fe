#!/usr/bin/env bash
# The main job on an embedded default: set up, then run `tokenloom demo` (see README).
# TOKENLOOM_SKIP_SETUP=1 skips the set-up when .venv is known to be current (the test suite
# sets it: reinstalling would rebuild the native library under the running test process).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${TOKENLOOM_SKIP_SETUP:-}" ] || [ ! -x .venv/bin/python ]; then
    EXTRAS=${EXTRAS-} bash scripts/setup.sh
fi
exec .venv/bin/python cli.py demo "$@"
