"""Trim llama-cpp-python's sdist to what its CUDA (and CPU) build compiles, small enough to carry.

    python tests/gpu/trim_sdist.py llama_cpp_python-0.3.36.tar.gz --out tests/gpu/carry/

The sdist (77 MB for 0.3.36) carries the git data of both repositories and vendors all of
llama.cpp: its models (vocabularies for its tests), docs, tests, examples, tools (the web
UI, the server), benchmarks, scripts, the gguf-py package, and the backends edgellm never
builds (Metal, Vulkan, SYCL, ...). None of
them is compiled when llama.cpp is a subproject, as it is here (LLAMA_STANDALONE is off:
no tests, tools, examples or server; each ggml backend's folder is added only when its
GGML_<NAME> option is on). What stays: llama-cpp-python's package and build files, and
llama.cpp's CMake files, licences, include/, src/, common/, vendor/, ggml/ with its CPU and
CUDA backends, and tools/mtmd (llama-cpp-python adds it unless -DLLAVA_BUILD=off).

The result keeps the original's file name and version, so pip takes it for that release
(`pip install --no-binary llama-cpp-python path/to/llama_cpp_python-0.3.36.tar.gz`).
"""

from __future__ import annotations

import argparse
import io
import sys
import tarfile
from collections.abc import Sequence
from pathlib import Path, PurePosixPath
from typing import Final

VENDOR: Final = "vendor/llama.cpp/"
# Paths below the sdist's top folder (llama_cpp_python-X/) that are left out.
DROPPED: Final = (
    # The upstream repositories' git data (39 MB for 0.3.36): llama.cpp's build number and
    # commit then read "unknown" in its build info, which edgellm does not use.
    ".git/",
    "docs/",
    "examples/",
    "tests/",
    "docker/",
    "scripts/",
    ".github/",
    VENDOR + "models/",
    VENDOR + "docs/",
    VENDOR + "tests/",
    VENDOR + "examples/",
    VENDOR + "media/",
    VENDOR + "benches/",
    VENDOR + "pocs/",
    VENDOR + "ci/",
    VENDOR + "scripts/",
    VENDOR + "conversion/",
    VENDOR + "gguf-py/",
    VENDOR + "requirements/",
    VENDOR + "grammars/",
    VENDOR + "skills/",
    VENDOR + "app/",
    VENDOR + ".devops/",
    VENDOR + ".github/",
    # Every tool but mtmd, which llama-cpp-python builds unless told not to.
    *(
        VENDOR + f"tools/{name}/"
        for name in (
            "ui",
            "server",
            "cli",
            "completion",
            "perplexity",
            "llama-bench",
            "quantize",
            "imatrix",
            "tuning",
            "cvector-generator",
            "export-lora",
            "gguf-split",
            "batched-bench",
            "tokenize",
            "tts",
            "rpc",
            "run",
            "fit-params",
            "results",
            "parser",
        )
    ),
    # ggml backends edgellm does not build (CPU and CUDA stay; HIP and MUSA reuse CUDA's sources).
    *(
        VENDOR + f"ggml/src/ggml-{name}/"
        for name in (
            "metal",
            "vulkan",
            "sycl",
            "opencl",
            "cann",
            "hexagon",
            "webgpu",
            "openvino",
            "et",
            "virtgpu",
            "zdnn",
            "kompute",
            "musa",
            "rpc",
            "blas",
            "zendnn",
        )
    ),
)
# Top-level llama.cpp files that are neither build input nor licence.
DROPPED_FILES: Final = (
    ".git",
    "convert_hf_to_gguf.py",
    "convert_hf_to_gguf_update.py",
    "convert_lora_to_gguf.py",
)
MAX_BYTES: Final = 20 * 1024 * 1024  # what tests/gpu/README.md promises to carry


def kept(name: str) -> bool:
    """Whether a member (named below the sdist's top folder) is needed to build."""
    inner = PurePosixPath(name)
    rel = "/".join(inner.parts[1:])
    if not rel:
        return True
    if any((rel + "/").startswith(prefix) for prefix in DROPPED):
        return False
    return not (rel.startswith(VENDOR) and rel.removeprefix(VENDOR) in DROPPED_FILES)


def trim(source: Path, out_dir: Path) -> Path:
    """Write the trimmed copy of `source` into `out_dir` under the same name; return its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / source.name
    if target.resolve() == source.resolve():
        raise SystemExit(f"{target} would overwrite the sdist it is made from")
    with tarfile.open(source, "r:gz") as src, tarfile.open(target, "w:gz", compresslevel=9) as dst:
        for member in src:
            if not kept(member.name):
                continue
            data = src.extractfile(member) if member.isfile() else None
            dst.addfile(member, io.BytesIO(data.read()) if data is not None else None)
    return target


def main(argv: Sequence[str] | None = None) -> int:
    """Trim one sdist; exit 1 when the result is still over MAX_BYTES."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sdist", type=Path, help="llama_cpp_python-X.tar.gz (pip download --no-binary :all:)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the trimmed copy")
    args = parser.parse_args(argv)
    target = trim(args.sdist, args.out)
    before, after = args.sdist.stat().st_size, target.stat().st_size
    print(f"{target}: {after / 2**20:.1f} MiB (from {before / 2**20:.1f} MiB)")
    if after > MAX_BYTES:
        print(f"still over {MAX_BYTES // 2**20} MiB: trim more (see DROPPED)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
