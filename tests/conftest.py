"""Shared fixtures: where the external test data lives, and small helpers."""

from __future__ import annotations

import faulthandler
import os
import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.support import REPO

# The service-shell fixtures (clock, principals, client, service, start_service) serve the
# tests of kvsp.web, kvsp.transfer and every service part alike.
pytest_plugins = ["tests.support.service_fixtures"]

# Hypothesis profiles: "ci" (derandomized, so a CI run tries the same examples every time; the
# default when $CI is set) and "dev" (random, as hypothesis is by default). Choose with
# HYPOTHESIS_PROFILE=ci|dev; tests keep their own max_examples either way.
settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)


# A test stuck where pytest-timeout's alarm cannot reach it (a finalizer or C code that swallows
# the exception) would hold the whole run until CI cuts it. Past this bound, faulthandler's own
# thread, which needs no GIL, prints every thread's stack and ends the run.
HARD_TEST_LIMIT_S = 420


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    faulthandler.dump_traceback_later(HARD_TEST_LIMIT_S, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


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


# --- Redis (kvsp.stores.redis) ------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def _start_redis(exe: str, folder: Path) -> tuple[subprocess.Popen[bytes], int] | str:
    """A redis-server answering on a free loopback port, or why none would start."""
    why = ""
    for attempt in range(3):  # a port taken between choosing and binding: try another
        port = _free_port()
        log = folder / f"redis-{attempt}.log"
        argv = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly"]
        argv += ["no", "--dir", str(folder), "--logfile", str(log)]
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 15.0
        while proc.poll() is None and time.monotonic() < deadline:
            if _redis_answers(port):
                return proc, port
            time.sleep(0.05)
        proc.kill()
        proc.wait()
        tail = log.read_text(errors="replace")[-600:] if log.exists() else ""
        why = f"{exe} exited with status {proc.returncode}: {tail.strip()}"
    return why


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Redis URL (``redis://127.0.0.1:PORT/0``) for the tests that need one:
    ``$KVSP_REDIS_URL`` when set, else a ``redis-server`` started on a free loopback port
    without persistence and stopped at the end. Skips, saying why, only when none can start."""
    url = os.environ.get("KVSP_REDIS_URL")
    if url:
        yield url
        return
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (.ci/run installs the redis-server package)")
    started = _start_redis(exe, tmp_path_factory.mktemp("redis"))
    if isinstance(started, str):
        pytest.skip(f"redis-server could not start: {started}")
    proc, port = started
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def redis_url(redis_server: str) -> Iterator[str]:
    """``redis_server`` with a key prefix of this test's own (``?prefix=…``); its keys are
    deleted afterwards, so tests never see each other's records."""
    redis = pytest.importorskip("redis")
    prefix = f"test-{secrets.token_hex(6)}"
    yield f"{redis_server}{'&' if '?' in redis_server else '?'}prefix={prefix}"
    client = redis.Redis.from_url(redis_server)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.unlink(*keys)
    finally:
        client.close()


@pytest.fixture(params=["hashlib", "native"])
def lanes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """A test run with :mod:`kvsp.sha256x2`'s hashlib fallback and, where built, its native
    paired SHA lanes."""
    from kvsp import sha256x2

    if request.param == "hashlib":
        monkeypatch.setattr(sha256x2, "PAIRED", False)
    elif not sha256x2.PAIRED:
        pytest.skip("kvsp._sha256x2 offers no digest_pair here")
    return str(request.param)
