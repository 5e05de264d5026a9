"""edgellmd: the edgellm daemon that serves GGUF models over an OpenAI-compatible API."""

from __future__ import annotations


def __getattr__(name: str) -> str:
    # The version is read from the installed metadata only when asked for: importlib.metadata
    # costs tens of milliseconds, and `edgellmd`'s command imports this package before it can
    # hold its stop and reload signals (edgellmd.__main__).
    if name != "__version__":
        raise AttributeError(f"module 'edgellmd' has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415 - see above

    try:
        found = version("edgellm")  # written once, in pyproject.toml
    except PackageNotFoundError:  # pragma: no cover - run from a checkout that was never installed
        found = "0+unknown"
    globals()["__version__"] = found
    return found
