"""Fixtures for the service-shell tests (kvsp.web, kvsp.transfer, kvsp.services): the test app
in-process and as a real process. A pytest plugin, loaded by ``tests/conftest.py``."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvsp.web.auth import Principals, principal_entry
from kvsp.web.clock import ManualClock
from kvsp.web.testing import InProcessClient, RunningService, start_process
from tests.support import SUPPORT, apps

APP_SCRIPT = SUPPORT / "apps.py"

CLIENT_TOKEN = "client-token-0123456789abcdefghijklmnop"
SCOPE = bytes(range(16))


@pytest.fixture
def clock() -> ManualClock:
    """A clock the test moves by hand, starting at 1,000,000 ms."""
    return ManualClock(1_000_000)


@pytest.fixture
def client_auth() -> dict[str, str]:
    """The Authorization header of the ``principals`` fixture's client."""
    return {"authorization": f"Bearer {CLIENT_TOKEN}"}


@pytest.fixture
def client_scope() -> bytes:
    """The one scope the ``principals`` fixture's client may use."""
    return SCOPE


@pytest.fixture
def principals() -> Principals:
    """One client principal (scope ``SCOPE``) that expires at 2,000,000 ms."""
    entry = principal_entry("c1", CLIENT_TOKEN, ["client"], [SCOPE], expires_ms=2_000_000)
    return Principals.from_entries([entry])


@pytest.fixture
def client(principals: Principals, clock: ManualClock) -> InProcessClient:
    """The test app in-process; server exceptions become responses, as on a real server."""
    return InProcessClient(apps.create_app(principals, clock))


@pytest.fixture
def start_service(tmp_path: Path) -> Iterator[Callable[..., RunningService]]:
    """Start the test app as a real uvicorn process; every one started is stopped at teardown."""
    started: list[RunningService] = []

    def start(*args: str) -> RunningService:
        folder = tmp_path / f"service-{len(started)}"
        folder.mkdir()
        service = start_process([sys.executable, str(APP_SCRIPT), *args], workdir=folder)
        started.append(service)
        return service

    yield start
    for service in started:
        service.stop()


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningService]:
    """One real test-app process shared by a module's tests."""
    folder = tmp_path_factory.mktemp("service")
    with start_process([sys.executable, str(APP_SCRIPT)], workdir=folder) as running:
        yield running
