"""A front end for sessions that survive instance failures (spec §6.8 front-end duties;
DESIGN.md §3 ``place``, ``generate``, ``sessions/{session}/tokens``).

:meth:`FrontEnd.generate` places a request through the PC with a fresh session UUID (so the PC
records the session and can move it), opens ``POST generate`` at the chosen instance and
yields one gap-free, duplicate-free stream of :class:`Token`:

* tokens of a lower epoch than one already seen are dropped (§6.8 MUST), and so are indices
  already delivered (a resumed instance regenerates or re-serves them);
* when the stream breaks (an error line, a closed connection, a gap) or stalls for
  ``stall_s`` while the PC reports that the session moved, it asks the PC where the session
  lives now (``GET sessions/{session}``) and reattaches with ``GET
  sessions/{session}/tokens?from=next`` at that instance, polling with backoff until the PC
  reports an instance that serves it;
* a session that failed before its first token (its instance died before the first
  checkpoint, so the PC had nothing to resume) is started over as a new session, at most
  ``restarts`` times; one that failed later raises :class:`~kvsp.errors.SessionFailed`.

Given several PC URLs (PCs on one store), every request to the PC fails over between them
(:mod:`kvsp.web.failover`): a PC that dies mid-generation costs nothing while the stream runs,
and the next question about the session goes to the next PC.

The stream of a frozen instance does not break: it stalls. Only the PC knows whether the
session moved, so a stall is answered by asking it, and the old stream is dropped once the PC
names a later epoch; anything that old instance sends afterwards never reaches the caller.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvsp.audience import AudienceSigner
from kvsp.compat import compat_id
from kvsp.errors import BadRequest, NotActive, NotFound, SessionFailed, TransportError
from kvsp.ids import CompatId, ScopeId, parse_compat_id, parse_scope_id
from kvsp.keys import block_keys
from kvsp.keys import scope_id as scope_id_of
from kvsp.records import PlaceRequest, PlaceResponse
from kvsp.services.index.client import IndexClient
from kvsp.services.pc.client import PCClient, SessionView
from kvsp.stores.descriptors import read_descriptor_file
from kvsp.web.client import problem_error
from kvsp.web.problems import KVSP_JSON, PROBLEM_JSON, dumps_json

NDJSON = "application/x-ndjson"


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontendConfig:
    """Timing of a front end.

    ``stall_s``: a stream silent this long makes the front end ask the PC whether the session
    moved. ``poll_s``/``poll_max_s``: first and longest wait between reattach tries.
    ``reattach_s``: how long reattaching may go on without a token before giving up.
    ``place_s``: how long a placement answered ``503 kvsp-not-active`` (no instance can take
    it now, §6.3; the PC may be starting one) is tried again. ``restarts``: sessions started
    over after failing before their first token.
    """

    stall_s: float = 1.0
    poll_s: float = 0.05
    poll_max_s: float = 1.0
    reattach_s: float = 60.0
    place_s: float = 30.0
    restarts: int = 2
    timeout_s: float = 30.0


@dataclass(frozen=True, slots=True)
class Token:
    """One output token as delivered: its index, the epoch it carried and who sent it."""

    index: int
    epoch: int
    token: int
    instance: str


@dataclass(slots=True)
class FrontendStats:
    """What the front end dropped and how often it had to find the session again."""

    stale: int = 0
    """Tokens dropped for carrying a lower epoch than one already seen."""
    duplicates: int = 0
    """Tokens dropped for an index already delivered."""
    reattached: int = 0
    restarted: int = 0
    sessions: list[uuid.UUID] = field(default_factory=list)
    placement: PlaceResponse | None = None
    """The PC's last answer to ``POST place``: instance, matched blocks, directive."""
    loaded_blocks: int | None = None
    """``kvsp-loaded-blocks`` of the last ``POST generate`` answer (prompt blocks loaded)."""
    computed_blocks: int | None = None
    """``kvsp-computed-blocks`` of the same answer (prompt blocks computed)."""
    moves: int = 0
    """Times the stream was picked up at another instance or a later epoch (failovers)."""


class _StartOver(Exception):
    """The session failed before any token was delivered: place it again."""


@dataclass(slots=True)
class _Stream:
    """One NDJSON stream from one instance, read by a task into a queue; ``put_back`` holds
    an item looked at before the reader took it."""

    instance: str
    epoch: int
    queue: asyncio.Queue[tuple[str, Any]]
    task: asyncio.Task[None]
    put_back: list[tuple[str, Any]] = field(default_factory=list)

    async def get(self, timeout: float) -> tuple[str, Any]:
        """The next item, waiting at most ``timeout`` seconds.

        Raises:
            TimeoutError: nothing came.
        """
        if self.put_back:
            return self.put_back.pop()
        return await asyncio.wait_for(self.queue.get(), timeout)

    async def close(self) -> None:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self.task


class FrontEnd:
    """Generation through the PC with failover (see the module docstring).

    ``pc_url`` is the PC's base URL, or several of PCs sharing one store: requests to the PC
    fail over between them (:mod:`kvsp.web.failover`), so a session placed through a PC that
    died is followed through the next (its state is in the shared store, §6.8).
    ``scope_key`` lets it compute the prompt's Block Keys (§4.2) so placement can find cached
    blocks; without it the request is placed by its length alone. The instances must know the
    scope key themselves (``--scope-key-file``): the request names the scope by ``scope_id``.
    """

    def __init__(
        self,
        pc_url: str | Sequence[str],
        token: str | None,
        *,
        scope_id: ScopeId,
        compat_id: CompatId,
        block_tokens: int,
        scope_key: bytes | None = None,
        config: FrontendConfig | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.config = config or FrontendConfig()
        self.scope_id = scope_id
        self.compat_id = compat_id
        self.block_tokens = block_tokens
        self.scope_key = scope_key
        self.stats = FrontendStats()
        timeout = httpx.Timeout(self.config.timeout_s, connect=min(self.config.timeout_s, 5.0))
        self._owns_client = client is None
        self._http = client or httpx.AsyncClient(timeout=timeout)
        self._token = token
        self._signer = AudienceSigner(token)
        self.pc = PCClient(pc_url, token, client=self._http)
        self.current: str | None = None
        """The instance whose stream is being read now."""

    async def aclose(self) -> None:
        """Close the connection pool (only if made here)."""
        if self._owns_client:
            await self._http.aclose()

    async def __aenter__(self) -> FrontEnd:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def generate(
        self, prompt: Sequence[int], max_tokens: int, sampler: Mapping[str, Any] | None = None
    ) -> AsyncIterator[Token]:
        """Place and run one generation; yields tokens 0..max_tokens-1, each exactly once.

        Raises:
            SessionFailed: the session failed after tokens were delivered, or could not be
                found again in time.
            NotActive: no instance could take it within ``place_s``.
            KVSPError: the PC refused to place it otherwise, or an instance refused the
                request itself (400, 403).
        """
        for attempt in range(self.config.restarts + 1):
            session = uuid.uuid4()
            self.stats.sessions.append(session)
            run = _Run(self, session, list(prompt), max_tokens, sampler)
            try:
                async for token in run.tokens():
                    yield token
                return
            except _StartOver as exc:
                if attempt == self.config.restarts:
                    raise SessionFailed(f"session failed before its first token: {exc}") from None
                self.stats.restarted += 1
            finally:
                await run.close()

    # -- plumbing used by _Run -------------------------------------------------------------------

    def _headers(self, accept: str, url: str) -> dict[str, str]:
        headers = {"accept": f"{accept}, {PROBLEM_JSON}"}
        # An instance gets a credential for its own origin, never the token (kvsp.audience).
        authorization = self._signer.authorization(url)
        if authorization is not None:
            headers["authorization"] = authorization
        return headers

    def place_request(self, session: uuid.UUID, prompt: Sequence[int]) -> PlaceRequest:
        """The ``POST place`` body of a session (with keys when the scope key is known)."""
        keys = (
            ()
            if self.scope_key is None
            else tuple(block_keys(self.scope_key, self.compat_id, prompt, self.block_tokens))
        )
        return PlaceRequest(
            scope_id=self.scope_id,
            compat_id=self.compat_id,
            block_keys=keys,
            prompt_tokens=len(prompt),
            session=session,
        )

    def open_stream(
        self, instance: str, epoch: int, method: str, path: str, body: Any = None
    ) -> _Stream:
        """Start reading an NDJSON token stream from ``instance`` in a task."""
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        task = asyncio.create_task(self._read(instance + path, method, body, queue))
        return _Stream(instance, epoch, queue, task)

    async def _read(
        self, url: str, method: str, body: Any, queue: asyncio.Queue[tuple[str, Any]]
    ) -> None:
        headers = self._headers(NDJSON, url)
        content = None
        if body is not None:
            headers["content-type"] = KVSP_JSON
            content = dumps_json(body)
        try:
            async with self._http.stream(method, url, content=content, headers=headers) as answer:
                if not answer.is_success:
                    await answer.aread()
                    queue.put_nowait(("refused", problem_error(answer)))
                    return
                if method == "POST":  # a generation: how much of the prompt was loaded
                    self.stats.loaded_blocks = _count_header(answer, "kvsp-loaded-blocks")
                    self.stats.computed_blocks = _count_header(answer, "kvsp-computed-blocks")
                async for line in answer.aiter_lines():
                    if line.strip():
                        queue.put_nowait(("line", _token_line(json.loads(line))))
            queue.put_nowait(("end", None))
        except (httpx.HTTPError, ValueError) as exc:
            queue.put_nowait(("broken", TransportError(f"{type(exc).__name__}: {exc}")))


def _count_header(answer: httpx.Response, name: str) -> int | None:
    value = answer.headers.get(name, "")
    return int(value) if value.isdigit() else None


def _token_line(obj: object) -> dict[str, Any]:
    """A stream line: ``{"index", "epoch", "token"}`` (unsigned integers) or ``{"error"}``.

    Raises:
        ValueError: anything else (the stream is then treated as broken).
    """
    if isinstance(obj, dict) and "error" in obj:
        return obj
    if isinstance(obj, dict) and all(
        type(obj.get(name)) is int and obj[name] >= 0 for name in ("index", "epoch", "token")
    ):
        return obj
    raise ValueError(f"not a token line: {str(obj)[:200]}")


class _Run:
    """One session's tokens: the current stream, the next index, the highest epoch seen."""

    def __init__(
        self,
        fe: FrontEnd,
        session: uuid.UUID,
        prompt: list[int],
        max_tokens: int,
        sampler: Mapping[str, Any] | None,
    ) -> None:
        self.fe = fe
        self.session = session
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.sampler = sampler
        self.next = 0
        self.epoch = 0
        self.stream: _Stream | None = None
        self.serving: tuple[str, int] | None = None  # instance and epoch of the last stream

    async def close(self) -> None:
        if self.stream is not None:
            await self.stream.close()
            self.stream = None

    async def _place(self) -> str:
        """The instance the PC places the session at, asking again (with backoff) while it
        answers that no instance is active, up to ``place_s``."""
        cfg = self.fe.config
        deadline = time.monotonic() + cfg.place_s
        delay = cfg.poll_s
        request = self.fe.place_request(self.session, self.prompt)
        while True:
            try:
                placed = await self.fe.pc.place(request)
                self.fe.stats.placement = placed
                return placed.instance
            except NotActive:
                if time.monotonic() + delay > deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(2 * delay, cfg.poll_max_s)

    async def tokens(self) -> AsyncIterator[Token]:
        instance = await self._place()
        body: dict[str, Any] = {
            "prompt": self.prompt,
            "max_tokens": self.max_tokens,
            "scope_id": self.fe.scope_id.hex(),
            "session": str(self.session),
        }
        if self.sampler is not None:
            body["sampler"] = dict(self.sampler)
        await self._switch(self.fe.open_stream(instance, 1, "POST", "generate", body))
        while self.next < self.max_tokens:
            stream = self.stream
            if stream is None:
                raise RuntimeError("no stream")
            try:
                kind, value = await stream.get(self.fe.config.stall_s)
            except TimeoutError:
                if await self._moved(stream):
                    await self._reattach(stream)
                continue
            if kind == "line" and "token" in value:
                token = self._take(value, stream)
                if token is not None:
                    yield token
                elif value.get("index", 0) > self.next:  # a gap: read again from next
                    await self._reattach(stream)
                continue
            if kind == "refused" and value.status < 500 and value.status not in (404, 409):
                raise value  # the instance refused the request itself
            if kind == "refused" and self.next == 0 and stream.epoch == 1:
                raise _StartOver(f"{stream.instance} refused the session: {value}")
            await self._reattach(stream)  # an error line, the end, a broken connection

    def _take(self, line: Mapping[str, Any], stream: _Stream) -> Token | None:
        index, epoch, token = int(line["index"]), int(line["epoch"]), int(line["token"])
        if epoch < self.epoch:  # §6.8 MUST discard tokens of a lower epoch than one seen
            self.fe.stats.stale += 1
            return None
        self.epoch = epoch
        if index < self.next:
            self.fe.stats.duplicates += 1
            return None
        if index > self.next:
            return None
        self.next += 1
        return Token(index=index, epoch=epoch, token=token, instance=stream.instance)

    async def _switch(self, stream: _Stream) -> None:
        last = self.serving
        if last is not None and (last[0] != stream.instance or stream.epoch > last[1]):
            self.fe.stats.moves += 1
        self.serving = (stream.instance, stream.epoch)
        await self.close()
        self.stream = stream
        self.fe.current = stream.instance

    async def _view(self) -> SessionView | None:
        try:
            return await self.fe.pc.get_session(self.session)
        except (NotFound, TransportError):
            return None

    async def _moved(self, stream: _Stream) -> bool:
        """Whether the PC names another epoch or instance than the stream's (a stall)."""
        view = await self._view()
        if view is None:
            return False
        self._check_failed(view)
        return view.epoch > stream.epoch or view.instance != stream.instance

    def _check_failed(self, view: SessionView) -> None:
        if view.state != "failed":
            return
        if self.next == 0:
            raise _StartOver(view.detail or "failed")
        raise SessionFailed(f"session {self.session} failed: {view.detail or 'no detail'}")

    async def _reattach(self, broken: _Stream) -> None:
        """Find the session again and read on from ``next`` (poll with backoff)."""
        await self.close()
        self.fe.stats.reattached += 1
        cfg = self.fe.config
        deadline = time.monotonic() + cfg.reattach_s
        delay = cfg.poll_s
        while time.monotonic() < deadline:
            view = await self._view()
            if view is not None and view.instance is not None:
                self._check_failed(view)
                path = f"sessions/{self.session}/tokens?from={self.next}"
                stream = self.fe.open_stream(view.instance, view.epoch, "GET", path)
                if await self._opened(stream):
                    await self._switch(stream)
                    return
                await stream.close()
            await asyncio.sleep(delay)
            delay = min(2 * delay, cfg.poll_max_s)
        raise SessionFailed(f"session {self.session} not found again within {cfg.reattach_s} s")

    async def _opened(self, stream: _Stream) -> bool:
        """Whether the stream delivers: its first item is a token line, or nothing came yet
        (connected, waiting for the next token). A refusal (404: not there yet), an error
        line or an immediate end means "try again"."""
        try:
            item = await stream.get(self.fe.config.poll_s)
        except TimeoutError:
            return True
        kind, value = item
        if kind == "line" and "token" in value:
            stream.put_back.append(item)  # the reader takes it first
            return True
        return False


# --- kvsp generate ------------------------------------------------------------------------------


def _read_text(path: Path, what: str) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise BadRequest(f"cannot read {what} {path}: {exc.strerror}") from None
    if not text:
        raise BadRequest(f"{what} {path} is empty")
    return text


def _prompt_of(args: argparse.Namespace) -> list[int]:
    if args.prompt is not None:
        return list(args.prompt.encode("utf-8"))  # byte-level tokens (kvsp model init's)
    try:
        return [int(part, 10) for part in args.tokens.split(",") if part.strip()]
    except ValueError:
        raise BadRequest("--tokens: expected comma-separated decimal integers") from None


def _sampler_of(args: argparse.Namespace) -> dict[str, Any]:
    params = {
        name: value
        for name, value in (("p", args.p), ("k", args.k), ("temperature", args.temperature))
        if value is not None
    }
    sampler: dict[str, Any] = {"method": args.sampler, "params": params, "seed": args.seed}
    if args.non_deterministic:
        sampler["deterministic"] = False
    return sampler


async def _model(
    args: argparse.Namespace, pc: str | Sequence[str], token: str
) -> tuple[CompatId, int]:
    if args.descriptor is not None:
        descriptor = read_descriptor_file(args.descriptor)
        return compat_id(descriptor), descriptor.block_tokens
    cid = parse_compat_id(args.compat_id, "--compat-id")
    async with IndexClient(pc, token) as index:
        return cid, (await index.get_descriptor(cid)).block_tokens


async def _generate(args: argparse.Namespace) -> int:
    token = _read_text(args.token_file, "--token-file")
    key = None
    if args.scope_key_file is not None:
        key = bytes.fromhex(_read_text(args.scope_key_file, "--scope-key-file"))
        scope = scope_id_of(key)
    else:
        scope = ScopeId(parse_scope_id(args.scope_id, "--scope-id"))
        print(
            "kvsp: warning: --scope-id without the scope key: the prompt's Block Keys cannot be "
            "computed (§4.2), so placement finds no cached blocks for it; give "
            "--scope-key-file to reuse them",
            file=sys.stderr,
        )
    compat, block_tokens = await _model(args, args.pc, token)
    prompt = _prompt_of(args)
    out = sys.stdout
    started = time.monotonic()
    first: float | None = None
    async with FrontEnd(
        args.pc, token, scope_id=scope, compat_id=compat, block_tokens=block_tokens, scope_key=key
    ) as fe:
        try:
            async for t in fe.generate(prompt, args.max_tokens, _sampler_of(args)):
                if first is None:
                    first = time.monotonic() - started
                if args.text:
                    out.write(bytes([t.token]).decode("latin-1") if t.token < 256 else "")
                else:
                    out.write(json.dumps({"index": t.index, "epoch": t.epoch, "token": t.token}))
                    out.write("\n")
                out.flush()
        finally:
            if getattr(args, "verbose", False):
                _report(fe, first)
    if args.text:
        out.write("\n")
    return 0


def _report(fe: FrontEnd, ttft_s: float | None) -> None:
    """``--verbose``: how the generation went, as ``kvsp: NAME: VALUE`` lines on stderr (stdout
    keeps only the tokens)."""
    stats = fe.stats
    placed = stats.placement
    blocks = (
        "unknown"
        if stats.loaded_blocks is None or stats.computed_blocks is None
        else f"{stats.loaded_blocks} loaded, {stats.computed_blocks} computed"
    )
    lines = {
        "instance": fe.current or (placed.instance if placed else "none"),
        "placed at": placed.instance if placed else "none",
        "matched blocks": placed.matched if placed else "unknown",
        "directive": placed.directive if placed and placed.directive else "none",
        "blocks": blocks,
        "TTFT": "no token" if ttft_s is None else f"{1000 * ttft_s:.1f} ms",
        "session": stats.sessions[-1] if stats.sessions else "none",
        "failovers": stats.moves,
        "PC failovers": fe.pc.failover.failovers,
        "restarts": stats.restarted,
        "dropped tokens": f"{stats.stale} stale, {stats.duplicates} duplicate",
    }
    for name, value in lines.items():
        print(f"kvsp: {name}: {value}", file=sys.stderr)


def run_generate(args: argparse.Namespace) -> int:
    """``kvsp generate``: place through the PC and print the tokens as they come (NDJSON
    ``{"index", "epoch", "token"}`` lines, or ``--text`` for byte tokens).

    Raises:
        KVSPError: bad options or files, or the session could not be served.
    """
    if args.max_tokens < 0:
        raise BadRequest("--max-tokens must be >= 0")
    try:
        return asyncio.run(_generate(args))
    except ValueError as exc:  # a scope key file that is not hex
        raise BadRequest(f"bad input: {exc}") from None
