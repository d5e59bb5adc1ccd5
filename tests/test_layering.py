"""House rule 1 (STYLE.md): the protocol core is sans-I/O.

The top-level ``kvsp`` modules and the ``moqt`` wire/session modules import nothing from asyncio,
Starlette, httpx, uvicorn, aiohttp or aioquic's asyncio layer, and the core imports without the
optional extras (torch, redis) installed.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
IO_PACKAGES = {"asyncio", "starlette", "httpx", "uvicorn", "aiohttp", "anyio", "socket"}
IO_MODULES = {"aioquic.asyncio"}
SHELLS = {"cli.py", "__main__.py"}
MOQT_SHELLS = {"asyncio.py", "transport.py", "client.py", "server.py"}


def _core_modules() -> list[Path]:
    kvsp = [p for p in (REPO / "kvsp").glob("*.py") if p.name not in SHELLS]
    moqt = [p for p in (REPO / "moqt").glob("*.py") if p.name not in MOQT_SHELLS]
    return sorted(kvsp + moqt)


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("path", _core_modules(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_core_module_imports_no_io(path: Path) -> None:
    bad = {
        name
        for name in _imports(path)
        if name.split(".")[0] in IO_PACKAGES or any(name.startswith(m) for m in IO_MODULES)
    }
    assert not bad, f"{path.name} imports I/O packages: {sorted(bad)}"


def test_core_imports_without_optional_extras() -> None:
    modules = sorted(
        f"kvsp.{p.stem}" for p in (REPO / "kvsp").glob("*.py") if p.name != "__main__.py"
    )
    code = (
        "import sys\n"
        "for blocked in ('torch', 'redis', 'safetensors', 'starlette', 'httpx'):\n"
        "    sys.modules[blocked] = None\n"
        f"for name in {modules!r}:\n"
        "    if name != 'kvsp.cli':\n"
        "        __import__(name)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False
    )
    assert result.returncode == 0, result.stderr
