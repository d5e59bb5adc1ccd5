"""The demo's HTTP side: a synchronous client of the PC, the IS and the instances of a local
cluster (DESIGN.md §3 resource table), and a watcher of the instances' lifecycle states.

It speaks as two parties: the front end (the ``client`` principal: ``POST place``, ``POST
generate``, ``POST lookup``) and the operator (``admin``: ``GET instances``, ``PUT state``,
prefetch directives sent straight to an instance as the PC would, ``GET replicas``). Generation
streams are read line by line, so the time to first token is measured where a front end sees
it, and a callback may act mid-stream (the failover step kills the instance there).
"""

from __future__ import annotations

import bisect
import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from kvsp.ids import BlockKey, CompatId, ScopeId, uri_id
from kvsp.keys import block_keys
from kvsp.web.client import AudienceAuth

PROBLEM = "urn:ietf:params:kvsp:problem:"
LONG_POLL_S = 10.0
"""How long one ``GET prefetch/{directive}?wait_ms=`` may wait (the client's read timeout is
60 s)."""
T = TypeVar("T")


@dataclass(slots=True)
class Generation:
    """What one ``POST generate`` gave: the prompt blocks loaded and computed, every NDJSON
    line, the time to the first token and to the end, and how it ended."""

    status: int
    loaded_blocks: int = 0
    computed_blocks: int = 0
    lines: list[dict[str, Any]] = field(default_factory=list)
    ttft_s: float | None = None
    total_s: float = 0.0
    problem: str | None = None
    broken: str | None = None
    """Why the stream ended early (the connection broke), if it did."""

    @property
    def tokens(self) -> list[int]:
        """The output tokens in order of arrival."""
        return [line["token"] for line in self.lines if "token" in line]


@dataclass(frozen=True, slots=True)
class Transition:
    """One lifecycle change seen at the PC: seconds since the watch began, instance, state."""

    at_s: float
    instance: str
    state: str
    reported: str


class DemoClient:
    """HTTP calls of the demo against one cluster (close it, or use it as a context manager)."""

    def __init__(
        self,
        control: str,
        *,
        client_token: str,
        admin_token: str,
        scope_key: bytes,
        scope: ScopeId,
        compat: CompatId,
        block_tokens: int,
    ) -> None:
        self.control = control
        self.scope_key = scope_key
        self.scope = scope
        self.compat = compat
        self.block_tokens = block_tokens
        timeout = httpx.Timeout(60.0, connect=5.0)
        # the tokens go to the control plane only; instances get audience credentials
        self._client = httpx.Client(auth=AudienceAuth(client_token, [control]), timeout=timeout)
        self._admin = httpx.Client(auth=AudienceAuth(admin_token, [control]), timeout=timeout)

    def __enter__(self) -> DemoClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close both connection pools."""
        self._client.close()
        self._admin.close()

    # -- keys and the IS ------------------------------------------------------------------------

    def keys(self, prompt: Sequence[int]) -> list[BlockKey]:
        """The §4.2 Block Keys of ``prompt`` in the demo scope."""
        return block_keys(self.scope_key, self.compat, prompt, self.block_tokens)

    def lookup(self, keys: Sequence[BlockKey]) -> list[list[dict[str, Any]]]:
        """POST lookup (§6.2) as the front end: the records of each matched key."""
        body = {
            "scope_id": self.scope.hex(),
            "compat_id": self.compat.hex(),
            "block_keys": [k.hex() for k in keys],
        }
        answer = self._client.post(f"{self.control}lookup", json=body)
        _expect(answer, 200)
        replicas: list[list[dict[str, Any]]] = answer.json().get("replicas") or []
        return replicas

    def holders(self, keys: Sequence[BlockKey]) -> list[set[str]]:
        """The holders the IS names for each matched key, in prefix order."""
        return [{r["holder"] for r in records} for records in self.lookup(keys)]

    def census(self) -> httpx.Response:
        """GET replicas at the IS: live records per holder (admin)."""
        return self._admin.get(f"{self.control}replicas")

    # -- the PC ---------------------------------------------------------------------------------

    def instances(self) -> list[dict[str, Any]]:
        """GET instances at the PC (admin)."""
        answer = self._admin.get(f"{self.control}instances")
        _expect(answer, 200)
        rows: list[dict[str, Any]] = answer.json()["instances"]
        return rows

    def row(self, instance: str) -> dict[str, Any] | None:
        """The PC's row for one instance URL."""
        return next((r for r in self.instances() if r["instance"] == instance), None)

    def set_state(self, instance: str, state: str) -> dict[str, Any]:
        """PUT instances/{id}/state at the PC (operator; forwarded to the instance)."""
        answer = self._admin.put(
            f"{self.control}instances/{uri_id(instance)}/state", json={"state": state}
        )
        _expect(answer, 200)
        body: dict[str, Any] = answer.json()
        return body

    def place(self, prompt: Sequence[int], **extra: Any) -> dict[str, Any]:
        """POST place (§6.4) as the front end: ``{"instance", "matched", "cost", ...}``."""
        body = {
            "scope_id": self.scope.hex(),
            "compat_id": self.compat.hex(),
            "block_keys": [k.hex() for k in self.keys(prompt)],
            "prompt_tokens": len(prompt),
            **extra,
        }
        answer = self._client.post(f"{self.control}place", json=body)
        _expect(answer, 200)
        placed: dict[str, Any] = answer.json()
        return placed

    # -- instances ------------------------------------------------------------------------------

    def generate(
        self,
        instance: str,
        prompt: Sequence[int],
        max_tokens: int,
        on_line: Callable[[dict[str, Any]], None] | None = None,
        **extra: Any,
    ) -> Generation:
        """POST generate and read the NDJSON stream to its end (or until it breaks)."""
        body = {"prompt": list(prompt), "max_tokens": max_tokens, **extra}
        return self._read("POST", f"{instance}generate", on_line, json=body)

    def _read(
        self,
        method: str,
        url: str,
        on_line: Callable[[dict[str, Any]], None] | None,
        **kwargs: Any,
    ) -> Generation:
        """Send one request and read its NDJSON answer line by line."""
        result = Generation(status=0)
        began = time.perf_counter()
        try:
            with self._client.stream(method, url, **kwargs) as answer:
                result.status = answer.status_code
                if answer.status_code != 200:
                    answer.read()
                    result.problem = _problem(answer)
                else:
                    result.loaded_blocks = int(answer.headers.get("kvsp-loaded-blocks", 0))
                    result.computed_blocks = int(answer.headers.get("kvsp-computed-blocks", 0))
                    self._read_lines(answer, result, began, on_line)
        except httpx.TransportError as exc:
            result.broken = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        result.total_s = time.perf_counter() - began
        return result

    @staticmethod
    def _read_lines(
        answer: httpx.Response,
        result: Generation,
        began: float,
        on_line: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        for text in answer.iter_lines():
            if not text:
                continue
            line = json.loads(text)
            if result.ttft_s is None:
                result.ttft_s = time.perf_counter() - began
            result.lines.append(line)
            if "error" in line:
                result.problem = str(line["error"].get("type", "error"))
            if on_line is not None:
                on_line(line)

    def session(self, session: str) -> dict[str, Any] | None:
        """GET sessions/{session} at the PC (§6.8): where the session lives now; ``None``
        when the PC has no such session (or no sessions at all)."""
        answer = self._client.get(f"{self.control}sessions/{session}")
        if answer.status_code in (404, 405):
            return None
        _expect(answer, 200)
        body: dict[str, Any] = answer.json()
        return body

    def tokens(
        self,
        instance: str,
        session: str,
        start: int,
        on_line: Callable[[dict[str, Any]], None] | None = None,
    ) -> Generation:
        """GET sessions/{session}/tokens?from=N at an instance: the session's tokens from
        index ``start`` on (how a front end reattaches after a failover, §6.8)."""
        url = f"{instance}sessions/{session}/tokens"
        return self._read("GET", url, on_line, params={"from": start})

    def prefetch(self, instance: str, keys: Sequence[BlockKey], sources: Sequence[str]) -> str:
        """POST a §6.5 directive straight to ``instance`` (as the PC would); its id."""
        directive = str(uuid.uuid4())
        body = {
            "directive": directive,
            "scope_id": self.scope.hex(),
            "compat_id": self.compat.hex(),
            "blocks": [{"block_key": k.hex(), "sources": list(sources)} for k in keys],
            "layer_order": "ascending",
            "deadline_ms": 30_000,
            "lease_ms": 10_000,
        }
        answer = self._admin.post(f"{instance}prefetch", json=body)
        _expect(answer, 202)
        return directive

    def directive_outcome(
        self, instance: str, directive: str, timeout_s: float = 60.0
    ) -> dict[str, Any]:
        """GET prefetch/{directive} until it is no longer pending: long polls
        (``?wait_ms=``) that the instance answers as the directive stops, so that the time
        a caller measures around this is the directive's (a 50 ms poll made a 60 ms
        directive read as 100 ms).

        Raises:
            TimeoutError: it was still pending after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"waited {timeout_s:.0f} s for directive {directive} to finish")
            wait_ms = max(1, int(min(left, LONG_POLL_S) * 1000))
            answer = self._admin.get(
                f"{instance}prefetch/{directive}", params={"wait_ms": str(wait_ms)}
            )
            _expect(answer, 200)
            body: dict[str, Any] = answer.json()
            if body["state"] != "pending":
                return body

    def instance_status(self, instance: str) -> dict[str, Any]:
        """GET status at an instance: the record it would send now (§4.4)."""
        answer = self._admin.get(f"{instance}status")
        _expect(answer, 200)
        body: dict[str, Any] = answer.json()
        return body


class DemoHTTPError(RuntimeError):
    """A service answered the demo with an unexpected status."""


def _bearer(token: str) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"}


def _problem(answer: httpx.Response) -> str:
    try:
        body = answer.json()
    except ValueError:
        return f"HTTP {answer.status_code}"
    kind = str(body.get("type", "")) if isinstance(body, dict) else ""
    return kind.removeprefix(PROBLEM) or f"HTTP {answer.status_code}"


def _expect(answer: httpx.Response, status: int) -> None:
    if answer.status_code != status:
        detail = answer.text[:300]
        raise DemoHTTPError(
            f"{answer.request.method} {answer.request.url} answered {answer.status_code}: {detail}"
        )


def wait_for(check: Callable[[], T | None], timeout_s: float, what: str) -> T:
    """Poll ``check`` every 50 ms until it returns something other than ``None``.

    Raises:
        TimeoutError: it did not within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(0.05)


def _at(transition: Transition) -> float:
    return transition.at_s


class StateWatcher:
    """Polls ``GET instances`` on its own thread and keeps every change of state."""

    def __init__(self, client: DemoClient, period_s: float = 0.05) -> None:
        self.client = client
        self.period_s = period_s
        self.transitions: list[Transition] = []
        self.began = time.monotonic()
        self._seen: dict[str, tuple[str, str]] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvsp-demo-watch", daemon=True)

    def __enter__(self) -> StateWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.period_s)

    def poll(self) -> None:
        """One ``GET instances``: record each instance whose state changed (what the watch
        thread does every ``period_s``)."""
        try:
            rows = self.client.instances()
        except (httpx.HTTPError, DemoHTTPError):
            rows = []
        now = time.monotonic() - self.began
        with self._lock:
            for row in rows:
                now_state = (row["state"], row["reported_state"])
                if self._seen.get(row["instance"]) != now_state:
                    self._seen[row["instance"]] = now_state
                    self.transitions.append(Transition(now, row["instance"], *now_state))

    def note(self, instance: str, state: str, at_s: float) -> None:
        """Record that the PC put ``instance`` in ``state`` (its answer to ``PUT state``, asked
        at ``at_s``, :meth:`now`) unless a poll has seen that state since: a state the
        instance leaves at once (draining with nothing left in flight goes on to sleeping)
        can fall between two polls."""
        with self._lock:
            mine = [t for t in self.transitions if t.instance == instance and t.at_s >= at_s]
            if any(t.state == state for t in mine):
                return
            before = [t for t in self.transitions if t.instance == instance and t.at_s < at_s]
            reported = before[-1].reported if before else ""
            noted = Transition(at_s, instance, state, reported)
            self.transitions.insert(bisect.bisect_right(self.transitions, at_s, key=_at), noted)
            if not mine:  # the newest state known: the poll must not record it again
                self._seen[instance] = (state, reported)

    def history(self, instance: str) -> list[Transition]:
        """The changes seen for one instance, in order."""
        with self._lock:
            return [t for t in self.transitions if t.instance == instance]

    def now(self) -> float:
        """Seconds since the watch began (the time base of :class:`Transition`)."""
        return time.monotonic() - self.began

    def wait_state(
        self, instance: str, state: str, timeout_s: float, after: float = 0.0
    ) -> Transition:
        """Wait until the PC shows ``instance`` in ``state`` at or after ``after`` (seconds
        since the watch began, :meth:`now`); the transition that did.

        Raises:
            TimeoutError: not within ``timeout_s``.
        """

        def seen() -> Transition | None:
            found = (t for t in self.history(instance) if t.state == state and t.at_s >= after)
            return next(found, None)

        return wait_for(seen, timeout_s, f"{instance} to be {state}")
