"""The QUIC backends a test runs on: aioquic always, qh3 where the ``quic-fast`` extra is
installed (skipped with the reason elsewhere)."""

from __future__ import annotations

import importlib.util

import pytest

HAS_QH3 = importlib.util.find_spec("qh3") is not None
NEEDS_QH3 = pytest.mark.skipif(not HAS_QH3, reason="qh3 (extra quic-fast) not installed")
BACKENDS = ["aioquic", pytest.param("qh3", marks=NEEDS_QH3)]
"""For ``pytest.mark.parametrize("backend", BACKENDS)``."""
