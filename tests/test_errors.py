"""The error tree has one home (STYLE.md rule 3, DESIGN.md §2): every class that declares an RFC
9457 problem type lives in :mod:`kvsp.errors`, each problem name is declared by one class only,
and the module imports nothing that could pull a layer above the core into it."""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from collections.abc import Iterator
from pathlib import Path

from kvsp import errors
from kvsp.errors import KVSPError
from tests.support import REPO

PACKAGES = ("kvsp", "relay")
"""Walked from their folders: under pytest ``import relay`` may find ``tests/relay`` first."""
OPTIONAL = frozenset({"torch", "redis"})
"""Packages a module may need that an install can leave out; such a module is skipped."""
ALLOWED_IMPORTS = frozenset({"__future__", "typing", "collections.abc"})
"""What :mod:`kvsp.errors` may import (``collections.abc`` for annotations only)."""


def _modules(package: str) -> Iterator[str]:
    for info in pkgutil.walk_packages([str(REPO / package)], package + "."):
        if info.name.rsplit(".", 1)[-1] != "__main__":
            yield info.name


def _import_all() -> None:
    """Import every module of kvsp and relay but those that need a missing optional package."""
    for name in [module for package in PACKAGES for module in _modules(package)]:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] not in OPTIONAL:
                raise


def _subclasses(cls: type[KVSPError]) -> Iterator[type[KVSPError]]:
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def _catalogue() -> list[type[KVSPError]]:
    """The error classes defined in kvsp.errors, in the order they are written."""
    found = [
        value
        for value in vars(errors).values()
        if inspect.isclass(value)
        and issubclass(value, KVSPError)
        and value.__module__ == errors.__name__
    ]
    return sorted(found, key=lambda cls: inspect.getsourcelines(cls)[1])


def test_every_problem_type_is_declared_in_kvsp_errors() -> None:
    _import_all()
    strays = sorted(
        f"{cls.__module__}.{cls.__qualname__} ({cls.problem})"
        for cls in set(_subclasses(KVSPError))
        if "problem" in vars(cls) and cls.__module__ != errors.__name__
    )
    assert strays == [], "problem types declared outside kvsp.errors"


def test_each_problem_name_is_declared_once() -> None:
    declared: dict[str, list[str]] = {}
    for cls in _catalogue():
        if "problem" in vars(cls):
            declared.setdefault(cls.problem, []).append(cls.__name__)
    twice = {name: owners for name, owners in declared.items() if len(owners) > 1}
    assert twice == {}, "a problem name declared by more than one class"


def test_catalogue_classes_say_when_they_are_raised() -> None:
    undocumented = [cls.__name__ for cls in _catalogue() if not (cls.__doc__ or "").strip()]
    assert undocumented == []


def test_catalogue_classes_carry_problem_status_and_title() -> None:
    odd = [
        cls.__name__
        for cls in _catalogue()
        if not (cls.problem.startswith("kvsp-") and 400 <= cls.status <= 599 and cls.title)
    ]
    assert odd == []


def test_kvsp_errors_imports_only_typing() -> None:
    tree = ast.parse(Path(errors.__file__).read_text(encoding="utf-8"))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
    assert imported <= ALLOWED_IMPORTS
