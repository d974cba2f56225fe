#!/usr/bin/env bash
# The main job on an embedded default: set up, then run `tokenloom demo` (see README).
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=${EXTRAS-} bash scripts/setup.sh
exec .venv/bin/python cli.py demo "$@"
