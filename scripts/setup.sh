#!/usr/bin/env bash
# Create ./.venv (once) and install tokenloom into it: torch first (TORCH_SPEC decides which
# build; the project's own install then finds torch satisfied and pulls no other), then the
# project (editable, with the native C++ build).
#   EXTRAS=dev,interop   optional extras to install (default: dev,interop; the test command adds kernels,ray,s3,fp8)
#   TORCH_SPEC=...        torch requirement, reinstalled whenever the installed torch does not satisfy it
#                         (default torch==2.13.0). A CPU-only machine that reaches PyPI only gets the
#                         CUDA wheel from PyPI; add the CPU index: TORCH_SPEC="torch==2.13.0 --index-url
#                         https://download.pytorch.org/whl/cpu". On a GPU cluster name your CUDA build the same way.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
EXTRAS=${EXTRAS-dev,interop}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@" 2> >(grep -v 'is ignored: it is neither' >&2); }
uv_install() {
    # pip's configuration (files and PIP_* variables), which uv does not read: indexes, find-links, constraints
    local args=(--python .venv/bin/python --compile-bytecode --index-strategy unsafe-best-match -q) key value url
    while IFS='=' read -r key value; do
        value=${value#\'}; value=${value%\'}
        case "$key" in
            *.index-url) args+=(--default-index "$value") ;;
            *.extra-index-url) for url in $value; do args+=(--index "$url"); done ;;
            *.find-links) for url in $value; do args+=(--find-links "$url"); done ;;
            *.constraint) for url in $value; do args+=(--constraint "$url"); done ;;
        esac
    done < <(.venv/bin/python -m pip config list 2>/dev/null)
    .venv/bin/uv pip install "${args[@]}" -e "$1"
}
# TORCH_SPEC's first word is the requirement; the rest are pip options (an index URL).
read -r -a torch_args <<< "$TORCH_SPEC"
.venv/bin/python - "${torch_args[0]}" <<'PY' 2>/dev/null || pip install "${torch_args[@]}"
import sys
from importlib.metadata import version
try:
    from packaging.requirements import Requirement
except ImportError:  # a fresh venv has pip's copy only
    from pip._vendor.packaging.requirements import Requirement
req = Requirement(sys.argv[1])
sys.exit(0 if req.specifier.contains(version("torch"), prereleases=True) else 1)
PY
# The project and its extras (about 170 packages, 3 GB unpacked) with uv where it can be had (one wheel
# from the same indexes): it downloads, unpacks and byte-compiles in parallel, where pip does each in
# turn (5 minutes on a slow 2-core machine). The same resolution (torch, installed above, satisfies the
# project's requirement and stays); pip's indexes, find-links and constraints are passed on; any failure
# of uv falls back to pip. USE_UV=0 skips uv.
spec=".${EXTRAS:+[$EXTRAS]}"
if [ "${USE_UV:-1}" != 0 ] && pip install uv 2>/dev/null && uv_install "$spec"; then
    :
else
    pip install -e "$spec"
fi
