#!/usr/bin/env bash
# The live GPU check (tests/gpu/README.md): build llama-cpp-python with CUDA for this
# machine's GPU, install it with edgellm into a venv, then run tests/gpu/device_check.py
# (candidate shapes of the "illegal instruction", offload, speed against the CPU, VRAM
# against auto's plan, the NVML monitor against nvidia-smi). Exit 0: no mismatch.
#
#   tests/gpu/device_check.sh [all|build|run]    all (default) = build, then run
#
# build keeps its wheel in tests/gpu/out/wheels/ and is skipped when that wheel was made
# with the same CMake flags, so a second `all`, or `run` alone, starts at the measuring.
# Offline: with tests/gpu/carry/ present (the trimmed sdist, the wheels edgellm needs that
# the machine lacks; the README says how to make it), pip never reaches an index.
# Environment: EDGELLM_CHECK_MODEL=FILE.gguf serves that model (default: the demo model if
# its package is installed, else a generated stand-in); EDGELLM_CHECK_QUICK=1 halves the
# bench runs; EDGELLM_CUDA_ARCHS overrides the architectures (default: this GPU's).
set -euo pipefail
cd "$(dirname "$0")/../.."

HERE=tests/gpu
WORK=${EDGELLM_CHECK_WORK:-$HERE/out}
CARRY=${EDGELLM_CHECK_CARRY:-$HERE/carry}
VENV=${EDGELLM_CHECK_VENV:-$WORK/venv}
PY=$VENV/bin/python
STEP=${1:-all}
STARTED=$(date +%s)

log() { echo "== $(( $(date +%s) - STARTED ))s $*"; }

case "$STEP" in all|build|run) ;; *) echo "usage: $0 [all|build|run]" >&2; exit 2 ;; esac
command -v nvidia-smi >/dev/null || { echo "no nvidia-smi: this check needs an NVIDIA GPU and its driver" >&2; exit 2; }
mkdir -p "$WORK"

offline=()
if [ -d "$CARRY" ]; then
    offline=(--no-index --find-links "$CARRY" --find-links "$CARRY/wheels")
fi

make_venv() {
    [ -x "$PY" ] && return
    # The machine's own packages (aiohttp, numpy, scikit-build-core, ...) are reused: only
    # what it lacks comes from the carried wheels or the index.
    log "virtual environment $VENV"
    python3 -m venv --system-site-packages "$VENV"
}

build() {
    make_venv
    local archs cmake_args sdist isolation=()
    archs=${EDGELLM_CUDA_ARCHS:-$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | tr -d '. ' | sort -u | paste -sd';')}
    cmake_args=$("$PY" ops/cudabuild.py cmake-args --archs "$archs")  # a refusal is one line, exit 2
    echo "$cmake_args" >"$WORK/cmake_args.txt"
    if ls "$WORK"/wheels/llama_cpp_python-*.whl >/dev/null 2>&1 \
        && [ "$(cat "$WORK/wheels/cmake_args.txt" 2>/dev/null)" = "$cmake_args" ]; then
        log "reusing $(ls "$WORK"/wheels/llama_cpp_python-*.whl) ($cmake_args)"
        return
    fi
    sdist=$(ls "$CARRY"/llama_cpp_python-*.tar.gz 2>/dev/null | head -n1 || true)
    [ -n "$sdist" ] || sdist=$("$PY" ops/cudabuild.py requirement)
    # The machine's scikit-build-core when it has one (offline, an isolated build would need
    # its wheel carried too).
    if "$PY" -c 'import scikit_build_core, pathspec' 2>/dev/null; then isolation=(--no-build-isolation); fi
    log "building llama-cpp-python with CUDA from $sdist: $cmake_args"
    rm -rf "$WORK/wheels" && mkdir -p "$WORK/wheels"
    CMAKE_ARGS="$cmake_args" FORCE_CMAKE=1 CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
        "$PY" -m pip wheel --no-deps --no-cache-dir --no-binary llama-cpp-python "${isolation[@]}" \
        "${offline[@]}" -w "$WORK/wheels" "$sdist" >"$WORK/build.log" 2>&1 \
        || { tail -n 40 "$WORK/build.log" >&2; echo "the CUDA build failed: $WORK/build.log" >&2; exit 1; }
    echo "$cmake_args" >"$WORK/wheels/cmake_args.txt"
    log "built $(ls "$WORK"/wheels/llama_cpp_python-*.whl)"
}

install() {
    make_venv
    log "installing the CUDA wheel and edgellm into $VENV"
    "$PY" -m pip install -q --no-deps --force-reinstall "$WORK"/wheels/llama_cpp_python-*.whl
    # edgellm and what of its dependencies the machine lacks; its own build needs only setuptools.
    "$PY" -m pip install -q "${offline[@]}" --no-build-isolation -e .
    "$PY" -m edgellmctl.cudabuild check --cmake-args "$(cat "$WORK/cmake_args.txt")"
}

measure() {
    local status=0 args=(run --out "$WORK")
    [ -z "${EDGELLM_CHECK_MODEL:-}" ] || args+=(--model "$EDGELLM_CHECK_MODEL")
    [ "${EDGELLM_CHECK_QUICK:-0}" != 1 ] || args+=(--quick)
    log "measuring (tests/gpu/device_check.py ${args[*]})"
    EDGELLM_CHECK_CMAKE_ARGS="$(cat "$WORK/cmake_args.txt")" PYTHONUNBUFFERED=1 \
        "$PY" "$HERE/device_check.py" "${args[@]}" || status=$?
    cp "$WORK/report.md" "$HERE/report.md" 2>/dev/null || true
    # The device tool of the workplace this was written in returns what lands in $OUT.
    if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then
        cp "$WORK"/report.md "$WORK"/results.json "$WORK"/{gpu,auto,cpu}.log "$OUT"/ 2>/dev/null || true
        [ ! -f "$WORK/build.log" ] || tail -n 200 "$WORK/build.log" >"$OUT/build.tail.log"
    fi
    log "done: $HERE/report.md (exit $status)"
    return "$status"
}

if [ "$STEP" != run ]; then build; fi
if [ "$STEP" != build ]; then install; measure; fi
