"""Shared fixtures: where the external test data lives, and small helpers."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def shared_dir() -> Path:
    """The ``shared/`` folder beside the checkout (or ``$KVSP_SHARED``)."""
    return Path(os.environ.get("KVSP_SHARED", REPO.parent / "shared"))


@pytest.fixture(scope="session")
def shared() -> Path:
    """The shared folder; tests that need it skip with a reason when it is absent."""
    path = shared_dir()
    if not path.is_dir():
        pytest.skip(f"shared data folder not found at {path} (set KVSP_SHARED)")
    return path


@pytest.fixture(scope="session")
def vectors_dir() -> Path:
    """The project's interop vectors (``interop/vectors``)."""
    return REPO / "interop" / "vectors"
