"""Helpers the tests share, kept apart from the tests themselves (STYLE.md rule 12).

``polling`` waits for a condition; the other modules build what a family of tests runs
against: in-process service apps (``operations``, ``authz``, ``apps``), real processes on
127.0.0.1 (``cluster``, ``crash``, ``fake_instance``, ``bulk_server``, ``reshard_peers``,
``pc_race``), relays and lossy links (``relay_kit``, ``loss``) and hypothesis strategies
(``fuzz_strategies``). A module a test starts as a program has a ``__main__`` block and
imports nothing from ``tests``, so that ``python PATH`` runs it without the repository root on
``sys.path``; :data:`SUPPORT` is the folder to take its path from, :data:`REPO` the repository
root.

The repository root is importable under pytest through ``pythonpath`` in ``pyproject.toml``.
"""

from __future__ import annotations

from pathlib import Path

SUPPORT = Path(__file__).resolve().parent
"""This folder: ``SUPPORT / "apps.py"`` is the program a test starts."""

REPO = SUPPORT.parents[1]
"""The repository root: the working folder of ``python -m interop.…`` and ``bench/`` runs."""
