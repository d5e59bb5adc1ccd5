"""The parts of ``kvsp demo`` / ``up`` / ``status`` that need no cluster: the process group
(stop, the whole group, death with the parent), the front end's stream rules, what the
scenario waits on (the state watcher, the session in flight), the console, ``GET replicas``
at the IS, and the command line's errors."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.cli import main
from kvsp.demo.client import DemoClient, Generation, StateWatcher
from kvsp.demo.console import Console, render_table
from kvsp.demo.failover import Stream
from kvsp.demo.procs import ProcessGroup
from kvsp.demo.scenario import BackgroundGeneration
from kvsp.demo.summary import Figures, print_report
from kvsp.errors import ClusterError
from kvsp.ids import CompatId, ScopeId
from kvsp.records import ReplicaRecord
from kvsp.services.index.app import IndexConfig, create_index_app
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.stores.memory import MemoryStore
from kvsp.web.auth import Principals, principal_entry
from kvsp.web.clock import ManualClock
from kvsp.web.testing import InProcessClient

NOW = 1_800_000_000_000
PROC = Path("/proc/self/cmdline").exists()


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def blocked_stop_signals(pid: int) -> set[int]:
    """SIGINT and SIGTERM if ``pid`` blocks them (``SigBlk`` of /proc/PID/status)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(
        next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk")), 16
    )
    return {sig for sig in (signal.SIGINT, signal.SIGTERM) if mask & (1 << (sig - 1))}


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


SERVICE = textwrap.dedent(
    """
    import os, pathlib, signal, subprocess, sys, time
    ready = pathlib.Path(sys.argv[sys.argv.index("--ready-file") + 1])
    if "--child" in sys.argv:  # a child of the service that ignores SIGTERM
        kid = subprocess.Popen([sys.executable, "-c",
            "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
        (ready.parent / "kid").write_text(str(kid.pid))
    if "--stubborn" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ready.write_text("http://127.0.0.1:1/")
    time.sleep(60)
    """
)


def spawn(group: ProcessGroup, tmp_path: Path, name: str, *flags: str) -> int:
    # Written once: rewriting it truncates the file under a service that is still reading it,
    # which then runs an empty script and exits 0 before it is ready.
    script = tmp_path / "service.py"
    if not script.exists():
        script.write_text(SERVICE)
    service = group.spawn(name, [sys.executable, str(script), *flags], tmp_path / name)
    return service.pid


# --- the process group -------------------------------------------------------------------------


@pytest.mark.skipif(not PROC, reason="reads /proc")
def test_stop_ends_every_service_and_what_they_started(tmp_path: Path) -> None:
    group = ProcessGroup()
    try:
        first = spawn(group, tmp_path, "first")
        second = spawn(group, tmp_path, "second", "--child")
        stubborn = spawn(group, tmp_path, "stubborn", "--stubborn")
        group.wait_ready(["first", "second", "stubborn"], 20)
    except BaseException:
        group.stop(grace_s=1.0)  # no service outlives a failed start
        raise
    kid = int((tmp_path / "second" / "kid").read_text())
    assert os.getpgid(second) == os.getpgid(kid) == first  # one group, led by the first
    assert os.getpgid(first) != os.getpgid(0)  # apart from ours: a Ctrl-C reaches us only
    assert not blocked_stop_signals(first)  # held back in us while forking, not in them
    group.stop(grace_s=1.0)
    for pid in (first, second, stubborn, kid):
        assert wait_gone(pid), pid
    group.stop()  # again: nothing left to do


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_services_die_with_a_parent_that_was_killed(tmp_path: Path) -> None:
    script = tmp_path / "service.py"
    script.write_text(SERVICE)
    parent = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from kvsp.demo.procs import ProcessGroup
        group = ProcessGroup()
        s = group.spawn("s", [sys.executable, {str(script)!r}], Path({str(tmp_path / "s")!r}))
        group.wait_ready(["s"], 20)
        print(s.pid, flush=True)
        time.sleep(60)
        """
    )
    argv = [sys.executable, "-c", parent]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        assert alive(child)
        proc.send_signal(signal.SIGKILL)  # no cleanup runs in the parent
        proc.wait()
    assert wait_gone(child), "the service outlived its killed parent"


def test_a_service_that_exits_early_is_reported_with_its_log(tmp_path: Path) -> None:
    group = ProcessGroup()
    argv = [sys.executable, "-c", "import sys; print('cannot bind'); sys.exit(3)"]
    group.spawn("broken", argv, tmp_path / "broken")
    with pytest.raises(ClusterError, match=r"(?s)broken exited \(3\).*cannot bind"):
        group.wait_ready(["broken"], 20)
    group.stop()


# --- the front end's stream rules (§6.8) --------------------------------------------------------


def test_the_stream_delivers_each_index_once_and_drops_lower_epochs() -> None:
    stream = Stream()
    for index, token in enumerate((5, 6, 7)):
        stream.offer({"index": index, "epoch": 1, "token": token})
    stream.offer({"index": 1, "epoch": 2, "token": 6})  # the resumed instance repeats
    stream.offer({"index": 3, "epoch": 2, "token": 8})
    stream.offer({"index": 4, "epoch": 1, "token": 99})  # the old epoch, late: dropped
    stream.offer({"index": 9, "epoch": 2, "token": 1})  # a gap is never filled out of order
    assert stream.tokens == [5, 6, 7, 8]
    assert (stream.duplicates, stream.mismatched, stream.epochs) == (2, 0, [1, 2])
    stream.offer({"index": 0, "epoch": 2, "token": 4})  # a repeat that differs is counted
    assert stream.mismatched == 1


# --- a directive's outcome ---------------------------------------------------------------------


def demo_client(handler: Any) -> DemoClient:
    """A DemoClient whose admin requests ``handler`` answers (an ``httpx.MockTransport``)."""
    client = DemoClient(
        "http://control/",
        client_token="c" * 40,
        admin_token="a" * 40,
        scope_key=bytes(32),
        scope=ScopeId(bytes(16)),
        compat=CompatId(bytes(32)),
        block_tokens=16,
    )
    client._admin.close()
    client._admin = httpx.Client(transport=httpx.MockTransport(handler))
    return client


def test_a_directive_outcome_is_long_polled_and_seen_as_the_directive_stops() -> None:
    asked: list[httpx.URL] = []
    states = iter(["pending", "pending", "complete"])

    def handler(request: httpx.Request) -> httpx.Response:
        asked.append(request.url)
        return httpx.Response(200, json={"directive": "d", "state": next(states), "loaded": []})

    with demo_client(handler) as client:
        outcome = client.directive_outcome("http://a/", "d", timeout_s=30)
    assert outcome["state"] == "complete" and len(asked) == 3
    # each GET waits at the instance, which answers as the directive stops: no poll interval
    # of the client's own lies between the end and the answer
    for url in asked:
        assert url.path == "/prefetch/d"
        assert 0 < int(url.params["wait_ms"]) <= 10_000


def test_a_directive_still_pending_at_the_timeout_is_a_timeout_error() -> None:
    waits: list[int] = []

    def handler(request: httpx.Request) -> httpx.Response:
        waits.append(int(request.url.params["wait_ms"]))
        time.sleep(waits[-1] / 1000)  # the instance holds the request that long
        return httpx.Response(200, json={"directive": "d", "state": "pending", "loaded": []})

    with demo_client(handler) as client, pytest.raises(TimeoutError, match="directive d"):
        client.directive_outcome("http://a/", "d", timeout_s=0.3)
    assert waits and all(0 < w <= 300 for w in waits)  # never asks to wait past the timeout


# --- what the scenario waits on -----------------------------------------------------------------


class ScriptedPC:
    """Stands in for :class:`DemoClient` where the scenario only polls or generates."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.answer = Generation(status=200)
        self.lines = 0
        self.release = threading.Event()

    def instances(self) -> list[dict[str, Any]]:
        return list(self.rows)

    def state(self, state: str, reported: str) -> None:
        self.rows = [{"instance": "http://a/", "state": state, "reported_state": reported}]

    def generate(self, instance: str, prompt: Any, max_tokens: int, on_line: Any) -> Generation:
        for index in range(self.lines):
            on_line({"index": index, "token": 1})
        self.release.wait(10)
        return self.answer


def watching_an_active_instance() -> tuple[ScriptedPC, StateWatcher, float]:
    """A watcher that has seen instance ``http://a/`` active, and the time after that."""
    pc = ScriptedPC()
    client: Any = pc  # the watcher calls instances() only
    watcher = StateWatcher(client)
    pc.state("active", "active")
    watcher.poll()
    return pc, watcher, watcher.now()


def test_the_watcher_keeps_a_state_the_pc_answered_that_no_poll_saw() -> None:
    # a drained instance with nothing in flight goes on to sleeping at once: the PC's row can
    # be draining for less than a poll period, as on a loaded machine
    pc, watcher, asked = watching_an_active_instance()
    pc.state("sleeping", "sleeping")
    watcher.note("http://a/", "draining", asked)  # PUT state answered draining
    watcher.poll()
    assert [t.state for t in watcher.history("http://a/")] == ["active", "draining", "sleeping"]
    assert watcher.wait_state("http://a/", "draining", 0.1, after=asked).at_s == asked
    # a state a poll saw after the question is not recorded twice
    woken = watcher.now()
    pc.state("active", "active")
    watcher.poll()
    watcher.note("http://a/", "active", woken)
    watcher.poll()
    states = [t.state for t in watcher.history("http://a/")]
    assert states == ["active", "draining", "sleeping", "active"]
    times = [t.at_s for t in watcher.transitions]
    assert times == sorted(times)


def test_the_watcher_notes_a_state_no_poll_has_reached_yet_once() -> None:
    pc, watcher, asked = watching_an_active_instance()
    watcher.note("http://a/", "draining", asked)
    pc.state("draining", "active")  # the PC's row, before the instance reported it
    watcher.poll()
    assert [t.state for t in watcher.history("http://a/")] == ["active", "draining"]


def background(pc: ScriptedPC) -> BackgroundGeneration:
    client: Any = pc  # the background session calls generate() only
    demo: DemoClient = client
    return BackgroundGeneration(demo, "http://a/", [1, 2, 3], 8)


def until_streaming(session: BackgroundGeneration) -> bool | None:
    """What :meth:`BackgroundGeneration.streaming` says once it says something (10 s at most)."""
    deadline = time.monotonic() + 10
    while (streaming := session.streaming()) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return streaming


def test_a_session_in_flight_is_known_by_its_first_line_not_by_the_pcs_view() -> None:
    pc = ScriptedPC()
    pc.lines = 1
    with background(pc) as session:
        assert until_streaming(session) is True
        pc.release.set()
    assert session.result().status == 200


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (Generation(status=503, problem="kvsp-not-active"), "kvsp-not-active"),
        (Generation(status=200, broken="RemoteProtocolError"), "RemoteProtocolError"),
        (Generation(status=200), "ended before its first line"),
    ],
)
def test_a_session_that_ends_before_a_line_says_why_at_once(answer: Generation, why: str) -> None:
    pc = ScriptedPC()
    pc.answer = answer
    pc.release.set()
    with pytest.raises(RuntimeError, match=why), background(pc) as session:
        until_streaming(session)


# --- console and report -------------------------------------------------------------------------


def test_tables_align_numbers_right_and_text_left() -> None:
    lines = render_table(["name", "n"], [["a", 5], ["longer", 1234]])
    assert lines == ["name       n", "------  ----", "a          5", "longer  1234"]


def test_progress_redraws_on_a_tty_and_prints_quarters_elsewhere() -> None:
    plain = io.StringIO()
    with Console(plain, tty=False).progress("load", 8) as bar:
        for _ in range(8):
            bar.advance()
    lines = plain.getvalue().splitlines()
    assert lines[:4] == ["load: 2/8", "load: 4/8", "load: 6/8", "load: 8/8"]
    assert lines[4].startswith("load: done in")
    tty = io.StringIO()
    with Console(tty, tty=True).progress("load", 4) as bar:
        bar.advance(2)
    assert "\rload [############............] 2/4" in tty.getvalue().replace("\x1b[2K", "")


def test_the_report_says_what_it_could_not_show() -> None:
    out = io.StringIO()
    figures = Figures(prompt_tokens=512, ttft_recomputed_ms=[900.0], ttft_cached_ms=[90.0])
    figures.missing.append("failover: the reason")
    print_report(Console(out, tty=False), figures, {})
    text = out.getvalue()
    assert "cached is 10.0x faster than recomputing" in text
    assert "Failover: not measured in this run" in text and "- failover: the reason" in text


# --- GET replicas at the IS ---------------------------------------------------------------------


def _record(key: int, holder: str, size: int) -> ReplicaRecord:
    return ReplicaRecord.from_json(
        {
            "block_key": f"{key:064x}",
            "compat_id": "ab" * 32,
            "scope_id": "cd" * 16,
            "holder": holder,
            "codec": 1,
            "size": size,
            "digest": "sha-256:" + "00" * 32,
            "ttl_ms": 60_000,
        }
    )


def test_replicas_per_holder_counts_live_records_for_an_admin(tmp_path: Path) -> None:
    store = MemoryStore()
    a, b = "http://127.0.0.1:1/", "http://127.0.0.1:2/"

    async def seed() -> None:
        await store.put(_record(1, a, 100), NOW + 1000)
        await store.put(_record(2, a, 50), NOW + 1000)
        await store.put(_record(1, b, 100), NOW + 1000)
        await store.put(_record(3, b, 7), NOW - 1)  # expired, not swept yet

    asyncio.run(seed())
    principals = Principals.from_entries(
        [
            principal_entry("admin", "admin-token-0123456789", ["admin"], None),
            principal_entry("client", "client-token-0123456789", ["client", "pc"], None),
        ]
    )
    app = create_index_app(
        IndexConfig(gc_freeze_interval_s=None),  # no gc.collect() in the test process
        store=store,
        principals=principals,
        clock=ManualClock(NOW),
        descriptors=DescriptorRegistry(tmp_path / "d"),
    )
    client = InProcessClient(app)
    answer = client.get("/replicas", headers={"authorization": "Bearer admin-token-0123456789"})
    assert answer.status_code == 200, answer.text
    assert answer.json() == {
        "holders": [
            {"holder": a, "replicas": 2, "octets": 150},
            {"holder": b, "replicas": 1, "octets": 100},
        ]
    }
    refused = client.get("/replicas", headers={"authorization": "Bearer client-token-0123456789"})
    assert refused.status_code == 403
    assert refused.json()["type"].endswith("kvsp-forbidden")


# --- the command line ---------------------------------------------------------------------------


def test_status_without_a_running_cluster_says_how_to_start_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--state", str(tmp_path)]) == 1
    assert "no cluster runs from" in capsys.readouterr().err
    assert main(["status", "--pc", "http://127.0.0.1:9/"]) == 1
    assert "--pc and --token-file go together" in capsys.readouterr().err


def test_status_reports_a_control_plane_that_does_not_answer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    token = tmp_path / "token"
    token.write_text("some-token\n")
    port = _closed_port()
    assert main(["status", "--pc", f"http://127.0.0.1:{port}/", "--token-file", str(token)]) == 1
    assert "does not answer" in capsys.readouterr().out


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_demo_refuses_a_prompt_it_cannot_fit(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--prompt-tokens", "9000"])
    assert exited.value.code == 2
    assert "expected 256 to 3584 tokens" in capsys.readouterr().err
