#!/usr/bin/env bash
# Set up (with the dev and interop extras), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=dev,interop bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
