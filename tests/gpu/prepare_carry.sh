#!/usr/bin/env bash
# On a machine that reaches the package index: fill tests/gpu/carry/ with what a GPU machine
# without registry access needs for tests/gpu/device_check.sh, about 10 MB in all:
#   - llama-cpp-python's sdist, trimmed (tests/gpu/trim_sdist.py: 77 MB -> under 5 MB),
#   - wheels of edgellm's dependencies that such a machine may lack, at the versions this
#     venv runs, for its Python (default 3.12) on x86-64 Linux.
#   tests/gpu/prepare_carry.sh [PYTHON_VERSION]
# Carry the folder along with the checkout (it is not ignored by git, so it travels with an
# untracked working tree; or scp/rsync it into the same place on the GPU machine).
set -euo pipefail
cd "$(dirname "$0")/../.."

PYV=${1:-3.12}
CARRY=tests/gpu/carry
PY=${PYTHON:-.venv/bin/python}
# What edgellm (and llama-cpp-python) import that a CUDA/PyTorch image rarely has, plus the
# build backend of llama-cpp-python for machines without one.
NEEDED=(gguf cryptography cffi pycparser watchdog diskcache sdnotify scikit-build-core pathspec packaging)

# The version this venv runs (what the tests ran), or "" for one it lacks (the build backend).
version() {
    "$PY" -c "from importlib.metadata import version as v, PackageNotFoundError as E
try: print(v('$1'))
except E: print('')"
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$CARRY/wheels"
llama=$(version llama-cpp-python)
"$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$llama" -d "$tmp"
"$PY" tests/gpu/trim_sdist.py "$tmp/llama_cpp_python-$llama.tar.gz" --out "$CARRY"

binary=() source=()
for name in "${NEEDED[@]}"; do
    installed=$(version "$name")
    pinned=$name${installed:+==$installed}
    case "$name" in sdnotify) source+=("$pinned") ;; *) binary+=("$pinned") ;; esac
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$CARRY/wheels" "${binary[@]}"
# sdnotify publishes an sdist only: a pure-Python wheel of it.
"$PY" -m pip wheel -q --no-deps -w "$CARRY/wheels" "${source[@]}"
du -sh "$CARRY" "$CARRY"/* "$CARRY"/wheels/* | sed 's/^/  /'
