"""Several base URLs for one service, and failing over between them (DESIGN.md §1: any
number of control planes on one store answer alike, so a client may ask any of them).

A client of the IS, the PC or ``kvsp serve control`` is given a list of base URLs
(:func:`url_list`: ``--pc A --pc B`` or ``--pc A,B``). :class:`Failover` keeps
which one answered last and sends each request there first; the request moves on to the next
URL, in list order and wrapping round, each URL tried at most once, when the attempt ends in

* a transport failure (:class:`~kvsp.errors.TransportError`: refused, reset, timed out), or
* a ``500``, ``502``, ``503`` or ``504`` answer (the service or its store is down),

and the request is safe to send again. A request that never reached a service (the
connection was refused or did not open in time) is always safe. One that may have reached it
is safe when the caller says so (:meth:`Failover.call` ``resend``): GET, PUT and DELETE are
idempotent (HTTP semantics); of the POSTs, ``lookup`` reads, a batch publication is a set of
PUTs, and ``place`` and ``status`` name the session or the instance they are about, so a second
one is the same request again (:class:`~kvsp.web.client.BaseClient` decides per method). Any
other answer, a 4xx above all, is the service's answer and never failed over; so is a ``503
kvsp-not-active`` (a live PC saying no instance can take the request now).

When every URL failed, the error of the last attempt is raised (a
:class:`~kvsp.errors.TransportError` or :class:`~kvsp.errors.UpstreamError` subclass, or the
class of the problem the last service answered). Every move to the next URL is logged at
warning with its cause.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

from kvsp.errors import PROBLEM_PREFIX, BadRequest, KVSPError, RemoteError, TransportError

_log = logging.getLogger("kvsp.web.failover")

T = TypeVar("T")

FAILOVER_STATUSES = frozenset({500, 502, 503, 504})
"""Answers that say the service (or what it stands on) is down, not that the request is bad."""

ANSWER_PROBLEMS = frozenset({"kvsp-not-active"})
"""Problem types that are a live service's answer even with a 503."""


def url_list(values: str | Iterable[str]) -> tuple[str, ...]:
    """The base URLs in ``values`` (one URL, ``"A,B"``, or several such strings), each ending
    in ``/``, in order, without repeats.

    Raises:
        BadRequest: no URL at all, or an empty item between commas.
    """
    items = [values] if isinstance(values, str) else list(values)
    out: list[str] = []
    for item in items:
        for part in item.split(","):
            url = part.strip()
            if not url:
                raise BadRequest(f"empty URL in {item!r}")
            url = url if url.endswith("/") else url + "/"
            if url not in out:
                out.append(url)
    if not out:
        raise BadRequest("no URL given")
    return tuple(out)


class AppendUrls(argparse.Action):
    """An argparse action for a URL-list flag: each use adds its comma-separated URLs, so
    ``--pc A --pc B`` and ``--pc A,B`` give ``["A/", "B/"]``."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        """Extend the flag's list with the URLs of ``values``."""
        try:
            urls = url_list(str(values))
        except BadRequest as exc:
            parser.error(f"{option_string}: {exc}")
        previous = getattr(namespace, self.dest, None)
        merged = list(previous) if isinstance(previous, list | tuple) else []
        merged += [u for u in urls if u not in merged]
        setattr(namespace, self.dest, merged)


def add_url_list_argument(
    parser: argparse.ArgumentParser | Any,
    flag: str,
    *,
    help: str,
    required: bool = False,
    dest: str | None = None,
) -> argparse.Action:
    """Add ``flag`` taking one or several base URLs (repeat it, or separate by commas); returns
    its action (for :func:`kvsp.web.cliargs.add_deprecated_aliases`)."""
    extra = {} if dest is None else {"dest": dest}
    action: argparse.Action = parser.add_argument(
        flag,
        action=AppendUrls,
        required=required,
        metavar="URL[,URL...]",
        help=help + " (several: repeat the flag or separate by commas; the first that answers "
        "is used, the next on failure)",
        **extra,
    )
    return action


def fails_over(exc: KVSPError, *, resend: bool) -> bool:
    """Whether a request that ended in ``exc`` goes on to the next URL.

    ``resend`` says the request is safe to send again; a request that was never sent (the
    connection did not open) moves on regardless.
    """
    if isinstance(exc, TransportError):
        return resend or _not_sent(exc)
    if not resend:
        return False
    if isinstance(exc, RemoteError):
        return exc.remote_status in FAILOVER_STATUSES and exc.remote_type not in _ANSWER_TYPES
    return exc.status in FAILOVER_STATUSES and exc.problem not in ANSWER_PROBLEMS


_ANSWER_TYPES = frozenset(PROBLEM_PREFIX + p for p in ANSWER_PROBLEMS)


def _not_sent(exc: TransportError) -> bool:
    """Whether a transport failure happened before the request's first octet left: a
    :class:`NotSent`, or an httpx connect or pool failure (httpx imported here: the command
    line imports this module for its flags alone)."""
    import httpx

    cause = exc.__cause__
    return isinstance(exc, NotSent) or isinstance(
        cause, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout
    )


class NotSent(TransportError):
    """A transport failure before any octet of the request left (the connection could not be
    opened): a failover moves on from it even for a request that is not safe to resend."""


class Failover:
    """Several base URLs of one service, the one that answered last tried first.

    ``service`` names the service in log lines (``"PC"``, ``"IS"``).
    """

    def __init__(self, urls: str | Sequence[str], service: str = "service") -> None:
        self.urls = url_list(urls)
        self.service = service
        self._current = 0
        self.failovers = 0
        """How many times a request moved on to the next URL."""

    @property
    def current(self) -> str:
        """The base URL the next request goes to first."""
        return self.urls[self._current]

    def _order(self) -> list[int]:
        n = len(self.urls)
        return [(self._current + i) % n for i in range(n)]

    async def call(
        self, attempt: Callable[[str], Awaitable[T]], *, resend: bool, what: str = "request"
    ) -> T:
        """``attempt(base_url)`` at the current URL, then at the next ones while it fails over
        (:func:`fails_over`); the URL that answered becomes the current one.

        Raises:
            KVSPError: the error of the last attempt when none answered, or the answer of a
                service that refused the request.
        """
        order = self._order()
        for position, index in enumerate(order[:-1]):
            base = self.urls[index]
            try:
                result = await attempt(base)
            except KVSPError as exc:
                if not fails_over(exc, resend=resend):
                    raise
                self._moved(what, base, exc, self.urls[order[position + 1]])
                continue
            self._current = index
            return result
        result = await attempt(self.urls[order[-1]])
        self._current = order[-1]
        return result

    def _moved(self, what: str, base: str, exc: KVSPError, following: str) -> None:
        self.failovers += 1
        _log.warning(
            "%s %s at %s failed (%s: %s); failing over to %s",
            self.service,
            what,
            base,
            exc.problem,
            exc,
            following,
        )


__all__ = [
    "ANSWER_PROBLEMS",
    "FAILOVER_STATUSES",
    "AppendUrls",
    "Failover",
    "NotSent",
    "add_url_list_argument",
    "fails_over",
    "url_list",
]
