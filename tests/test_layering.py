"""The layer rules of DESIGN.md §2 and house rule 1 (STYLE.md), checked on the source.

Every module of ``kvsp``, ``moqt``, ``relay`` and ``interop`` is parsed with :mod:`ast`; each
import (function-level ones included, relative ones resolved) is an arrow from the importing
module to the imported one, and :func:`violation` says which rule an arrow breaks. The layers
are the table :data:`LAYERS`; the rules are :data:`FORBIDDEN` plus the few that name modules
rather than layers (a service part's neighbours, the relay's and interop's view of services).
A subprocess test checks what a walk of the source cannot: that the core imports without the
optional extras, and the stores without the web stack.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import REPO

PACKAGES = ("kvsp", "moqt", "relay", "interop")

LAYERS: tuple[tuple[str, str], ...] = (
    # (module or package, layer); the longest matching name wins.
    ("kvsp", "core"),  # the top-level kvsp/*.py modules: the protocol, sans-I/O
    ("kvsp.cli", "top"),  # shell: the `kvsp` command parses arguments and starts any part
    ("kvsp.__main__", "top"),  # shell: `python -m kvsp`
    ("kvsp.ops_cli", "top"),  # shell: the operator commands (instance, prefetch, replicas)
    ("kvsp.demo", "top"),
    ("kvsp.sim", "top"),
    ("kvsp.stores", "stores"),
    ("kvsp.engine", "engine"),
    ("kvsp.web", "web"),
    ("kvsp.transfer", "transfer"),
    ("kvsp.services", "services"),
    ("moqt", "moqt"),
    ("relay", "relay"),
    ("interop", "interop"),
    # bench/ drives whole systems and measures stores, engines and transfers directly: a tool
    # on top of everything, with no rule of its own.
    ("bench", "top"),
    ("tests", "top"),
)

FORBIDDEN: dict[str, frozenset[str]] = {
    # layer -> the layers it must not import; besides, only a tool or shell imports one
    # (TOOLS below).
    "core": frozenset({"stores", "engine", "web", "transfer", "services", "relay"}),
    "stores": frozenset({"engine", "web", "transfer", "services", "relay"}),
    "engine": frozenset({"stores", "web", "services", "relay"}),
    "web": frozenset({"stores", "engine", "transfer", "services", "relay"}),
    "transfer": frozenset({"services", "relay"}),
    "services": frozenset({"relay"}),
    "moqt": frozenset({"core", "stores", "engine", "web", "transfer", "services", "relay"}),
    # relay/ builds on moqt, the core, kvsp.web, kvsp.transfer and the parts' surfaces (below).
    "relay": frozenset({"stores", "engine"}),
    # interop/ (fuzz targets, conformance, vectors) exercises what a peer sees: the core, moqt,
    # kvsp.web's request parsing, and the parts' surfaces (below); never a store, an engine, a
    # transfer's internals or the kvsp commands.
    "interop": frozenset({"stores", "engine", "transfer", "top"}),
}
TOOLS = frozenset({"top", "interop"})

IO_PACKAGES = {"asyncio", "starlette", "httpx", "uvicorn", "aiohttp", "anyio", "socket"}
IO_MODULES = {"aioquic.asyncio"}
MOQT_SHELLS = {
    "moqt.asyncio",
    "moqt.transport",
    "moqt.udp_endpoint",
    "moqt.qmux_asyncio",
    "moqt.qmux_tls",
    "moqt.client",
    "moqt.server",
}
"""The moqt modules that do I/O; the rest of moqt is sans-I/O like the kvsp core."""
SERVICE_LEVEL = {"kvsp.services.control", "kvsp.services.frontend", "kvsp.services.descriptors"}
"""Modules beside the parts: ``control`` and ``frontend`` compose parts; ``descriptors`` is the
resource every part serves."""
COMPOSERS = {"kvsp.services.control", "kvsp.services.frontend"}

HISTORICAL_ARROWS = [
    ("kvsp.index", "kvsp.stores.base"),
    ("kvsp.stores.redis", "kvsp.services.descriptors"),
    ("kvsp.services.instance.sessions", "kvsp.services.pc.sessions"),
    ("kvsp.services.instance.reshard", "kvsp.services.holder.app"),
    ("kvsp.engine.reference", "kvsp.stores.blocks"),
    ("moqt.namespace", "kvsp.errors"),
    ("interop.fuzz.targets", "kvsp.services.instance.app"),
]
"""Arrows the source once had, each against a rule: the checker must report every one."""


def layer_of(module: str) -> str:
    """The layer of a dotted module name (the longest :data:`LAYERS` entry that names it or a
    package above it)."""
    best, found = "", "outside"
    for name, layer in LAYERS:
        if (module == name or module.startswith(name + ".")) and len(name) > len(best):
            best, found = name, layer
    return found


def _part(module: str) -> str | None:
    """``kvsp.services.<part>`` of a module inside a service part, else ``None``."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[:2] == ["kvsp", "services"]:
        package = ".".join(parts[:3])
        if package not in SERVICE_LEVEL:
            return package
    return None


def _is_surface(module: str) -> bool:
    """A part's public surface: its package (``__init__``) or its ``client`` module."""
    part = _part(module)
    return part is not None and module in (part, part + ".client")


def violation(importer: str, imported: str) -> str | None:
    """The rule that the arrow ``importer -> imported`` breaks, or ``None``."""
    source, target = layer_of(importer), layer_of(imported)
    if target in FORBIDDEN.get(source, frozenset()):
        return f"{source} imports {target}"
    if source not in TOOLS and target in TOOLS:
        return f"{source} imports a tool or shell ({target})"
    if source == "core" and imported in MOQT_SHELLS:
        return "core imports a moqt I/O module"
    if source in {"relay", "interop"} and target == "services" and not _is_surface(imported):
        return f"{source} imports a service part's internals (use its package or client)"
    if source == "services":
        return _services_violation(importer, imported)
    return None


def _services_violation(importer: str, imported: str) -> str | None:
    mine, theirs = _part(importer), _part(imported)
    if mine is not None and imported in COMPOSERS:
        return "a service part imports a module that composes parts"
    if mine is not None and theirs is not None and mine != theirs and not _is_surface(imported):
        return "a service part imports another part's internals (use its package or client)"
    return None


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _source_modules() -> dict[str, Path]:
    return {
        _module_name(path): path
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
    }


MODULES = _source_modules()


def _resolve(module: str, path: Path, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str) -> Iterator[tuple[str, int]]:
    """Every module that ``module`` imports, with the line: ``from p import m`` names ``p.m``
    when that is a module of the repository, else ``p``."""
    path = MODULES[module]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, path, node)
            for alias in node.names:
                name = f"{base}.{alias.name}"
                yield (name if name in MODULES else base), node.lineno


def _is_io(name: str) -> bool:
    return name.split(".")[0] in IO_PACKAGES or any(
        name == m or name.startswith(m + ".") for m in IO_MODULES
    )


def _sans_io_modules() -> list[str]:
    return sorted(
        m
        for m in MODULES
        if layer_of(m) == "core" or (layer_of(m) == "moqt" and m not in MOQT_SHELLS)
    )


@pytest.mark.parametrize("module", _sans_io_modules())
def test_core_module_imports_no_io(module: str) -> None:
    bad = sorted({name for name, _ in imports_of(module) if _is_io(name)})
    assert not bad, f"{module} imports I/O packages: {bad}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_keeps_the_layer_rules(module: str) -> None:
    broken = sorted(
        {
            f"line {line}: {module} -> {name}: {reason}"
            for name, line in imports_of(module)
            if (reason := violation(module, name)) is not None
        }
    )
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize(("importer", "imported"), HISTORICAL_ARROWS)
def test_checker_reports_historical_arrow(importer: str, imported: str) -> None:
    assert violation(importer, imported) is not None


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("kvsp.index", "kvsp.records"),
        ("kvsp.stores.redis", "kvsp.index"),
        ("kvsp.services.instance.app", "kvsp.services.holder"),
        ("kvsp.services.instance.service", "kvsp.services.pc.client"),
        ("kvsp.services.control", "kvsp.services.pc.app"),
        ("relay.app", "kvsp.services.index.client"),
        ("relay.app", "kvsp.web.cliargs"),
        ("interop.fuzz.targets", "kvsp.services.instance"),
        ("kvsp.cli", "relay.app"),
    ],
)
def test_checker_allows_the_arrows_the_design_wants(importer: str, imported: str) -> None:
    assert violation(importer, imported) is None


def test_imports_are_resolved() -> None:
    # A relative import names its module; a function-level import counts like any other.
    assert "interop.fuzz.targets" in {name for name, _ in imports_of("interop.fuzz.harness")}
    assert "kvsp.services.index.client" in {name for name, _ in imports_of("relay.app")}


def _import_blocked(
    modules: list[str], blocked: tuple[str, ...]
) -> subprocess.CompletedProcess[str]:
    code = (
        "import sys\n"
        f"for blocked in {blocked!r}:\n"
        "    sys.modules[blocked] = None\n"
        f"for name in {modules!r}:\n"
        "    __import__(name)\n"
    )
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False
    )


def test_core_imports_without_optional_extras() -> None:
    core = sorted(m for m in MODULES if layer_of(m) == "core")
    result = _import_blocked(core, ("torch", "redis", "safetensors", "starlette", "httpx"))
    assert result.returncode == 0, result.stderr


def test_stores_import_without_the_web_stack() -> None:
    pytest.importorskip("redis")  # the Redis stores need their optional extra
    stores = sorted(m for m in MODULES if layer_of(m) == "stores")
    result = _import_blocked(stores, ("starlette", "prometheus_client", "httpx", "uvicorn"))
    assert result.returncode == 0, result.stderr
