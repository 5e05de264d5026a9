"""Fixtures of the reliability suite: a signed box, a /dev/shm preload root, and each test's figures."""

from __future__ import annotations

import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.harness import Figures, SignedBox

DEV_SHM = Path("/dev/shm")


@pytest.fixture
def box(tmp_path: Path) -> SignedBox:
    """A fresh signed box (models dir, signing key, keys file) in the test's temporary directory."""
    return SignedBox(tmp_path / "box")


@pytest.fixture
def shm_root(tmp_path: Path) -> Iterator[Path]:
    """A preload root on the real /dev/shm (a temporary directory where there is none), removed after."""
    root = (DEV_SHM if DEV_SHM.is_dir() else tmp_path) / f"edgellm-reliability-{secrets.token_hex(4)}"
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def figures(request: pytest.FixtureRequest) -> Iterator[Figures]:
    """The test's figures; printed at the end if the test did not print them itself."""
    found = Figures(request.node.nodeid)
    yield found
    if not found.shown and found.values:
        found.show()
