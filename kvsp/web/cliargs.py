"""Command-line plumbing shared by every ``kvsp serve …`` service (DESIGN.md §3 auth, TLS).

Each service module exposes ``configure_parser(parser)`` to add its own options and
``run(args) -> int`` to serve; this module adds the options they all share and turns them
into a :class:`~kvsp.web.runner.ServeConfig` and a principals table.
:func:`with_logging` wraps a service's ``run`` so that its logs go to stderr as JSON lines
(``--log-format json``, the default for ``kvsp serve``) or plain text, at ``--log-level``.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import math
import re
import signal
import ssl
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization

from kvsp.errors import BadRequest
from kvsp.lifecycle import DEFAULT_MAX_EPOCH_SKEW_MS
from kvsp.web.auth import Principals, PrincipalsError, ensure_default_principals
from kvsp.web.logs import LOG_FORMATS, configure_logging
from kvsp.web.runner import ReadTimeouts, ServeConfig
from kvsp.web.trust import Trust

_log = logging.getLogger("kvsp.web.cliargs")

DEFAULT_STATE = Path("state")


def add_common_arguments(parser: argparse.ArgumentParser, default_port: int) -> None:
    """Add ``--listen``, ``--state``, ``--principals``, ``--ready-file``, TLS, the read
    timeouts (:class:`~kvsp.web.runner.ReadTimeouts`) and logging."""
    parser.add_argument(
        "--listen",
        default=f"127.0.0.1:{default_port}",
        metavar="HOST:PORT",
        help=f"address to serve on; port 0 picks a free one (default 127.0.0.1:{default_port})",
    )
    parser.add_argument(
        "--state",
        type=Path,
        default=DEFAULT_STATE,
        metavar="DIR",
        help="state folder (principals, admin token, disk tier, certificates); default ./state",
    )
    parser.add_argument(
        "--principals",
        type=Path,
        metavar="FILE",
        help="principals file (TOML); default: STATE/principals.toml, made with one admin token",
    )
    parser.add_argument("--ready-file", type=Path, metavar="FILE", help=argparse.SUPPRESS)
    parser.add_argument("--cert", type=Path, metavar="PEM", help="TLS certificate")
    parser.add_argument("--key", type=Path, metavar="PEM", help="TLS private key")
    add_trust_arguments(parser)
    timeouts = ReadTimeouts()
    parser.add_argument(
        "--head-timeout",
        type=positive_float,
        default=timeouts.head_s,
        metavar="S",
        help="close a connection whose request head takes longer (default %(default)s s)",
    )
    parser.add_argument(
        "--body-timeout",
        type=positive_float,
        default=timeouts.body_idle_s,
        metavar="S",
        help="close a connection whose request body pauses longer (default %(default)s s)",
    )
    parser.add_argument(
        "--keep-alive-timeout",
        type=positive_int,
        default=timeouts.keep_alive_s,
        metavar="S",
        help="close an idle connection between requests (default %(default)s s)",
    )
    parser.add_argument(
        "--log-level",
        default="warning",
        metavar="LEVEL",
        help="debug, info (one access record per request), warning (default), error",
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default="json",
        help="stderr log records: one JSON object per line (default) or plain text",
    )


def parse_listen(text: str, flag: str = "--listen") -> tuple[str, int]:
    """Split ``HOST:PORT`` (``[::1]:PORT`` for IPv6), the value of ``flag``.

    Raises:
        BadRequest: not of that form or the port is out of range (naming ``flag``).
    """
    host, sep, port_text = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise BadRequest(f"{flag}: expected HOST:PORT, got {text!r}")
    return host, int(port_text)


def is_wildcard(host: str) -> bool:
    """Whether ``host`` is an "any address" (``0.0.0.0``, ``::``, empty)."""
    try:
        return host == "" or ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


_SIZE = re.compile(r"([0-9]+)\s*([KMGT]i?B|B)?", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS |= {"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(text: str) -> int:
    """Octets from ``2GiB``, ``512MB``, ``4096``.

    Raises:
        argparse.ArgumentTypeError: not of that form.
    """
    found = _SIZE.fullmatch(text.strip())
    if found is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 2GiB or 512MB, got {text!r}")
    return int(found.group(1)) * _UNITS[(found.group(2) or "").upper()]


def positive_int(text: str) -> int:
    """An integer >= 1 written in ASCII digits (an ``argparse`` type).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def positive_float(text: str) -> float:
    """A finite number > 0 such as ``0.5`` or ``10`` (an ``argparse`` type).

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return value


def positive_size(text: str) -> int:
    """A :func:`parse_size` of at least one octet (an ``argparse`` type).

    Raises:
        argparse.ArgumentTypeError: not a size, or zero.
    """
    size = parse_size(text)
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return size


def serve_config(args: argparse.Namespace) -> ServeConfig:
    """The :class:`ServeConfig` the common options describe.

    A service that advertises its own URL (one with ``--public-url``) refuses a wildcard
    ``--listen`` address without ``--public-url``: it would name a loopback URL that no other
    host can reach.

    Raises:
        BadRequest: bad ``--listen``, a wildcard one without ``--public-url``, or a bad
            ``--cert``/``--key`` pair (:func:`check_tls_pair`).
    """
    host, port = parse_listen(args.listen)
    if is_wildcard(host) and hasattr(args, "public_url") and args.public_url is None:
        raise BadRequest(
            f"--listen {args.listen} is a wildcard address: other hosts cannot reach this "
            "service by it; give --public-url with the URL they use"
        )
    check_tls_pair(args)
    return ServeConfig(
        host=host,
        port=port,
        ready_file=args.ready_file,
        ssl_certfile=args.cert,
        ssl_keyfile=args.key,
        log_level=args.log_level,
        timeouts=read_timeouts(args),
    )


def check_tls_pair(args: argparse.Namespace) -> tuple[Path, Path] | None:
    """``--cert`` and ``--key`` (None when neither is given), checked as a TLS server will
    load them, so that a wrong file stops the start with one line, not a traceback from the
    first handshake's setup.

    Raises:
        BadRequest: only one of them, a file that cannot be read, a certificate or key that is
            not PEM (or a key with a passphrase), or a key that is not the certificate's.
    """
    if (args.cert is None) != (args.key is None):
        raise BadRequest("--cert and --key go together")
    if args.cert is None:
        return None
    cert, key = Path(args.cert), Path(args.key)
    texts = {}
    for flag, path in (("--cert", cert), ("--key", key)):
        try:
            texts[flag] = path.read_bytes()
        except OSError as exc:
            raise BadRequest(f"{flag} {path}: {exc.strerror or exc}") from None
    try:
        x509.load_pem_x509_certificate(texts["--cert"])
    except ValueError:
        raise BadRequest(f"--cert {cert}: not a PEM certificate") from None
    try:
        serialization.load_pem_private_key(texts["--key"], password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise BadRequest(f"--key {key}: not a PEM private key without a passphrase") from None
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise BadRequest(f"--key {key} is not the private key of --cert {cert}") from None
        raise BadRequest(f"--cert {cert} with --key {key}: {exc.reason or exc}") from None
    return cert, key


def read_timeouts(args: argparse.Namespace) -> ReadTimeouts:
    """The :class:`ReadTimeouts` of ``--head-timeout``, ``--body-timeout`` and
    ``--keep-alive-timeout``."""
    return ReadTimeouts(
        head_s=args.head_timeout,
        body_idle_s=args.body_timeout,
        keep_alive_s=args.keep_alive_timeout,
    )


def load_principals(args: argparse.Namespace) -> Principals:
    """The principals of ``--principals``, or the embedded default's (made on first start).

    With no principals file the service never runs open: it makes one with a single admin
    token and says on stderr where the token is. SIGHUP reloads the file
    (:func:`reload_on_sighup`).

    Raises:
        BadRequest: the file is malformed.
    """
    if args.principals is not None:
        path = Path(args.principals)
    else:
        path, token_path = ensure_default_principals(args.state)
        print(f"kvsp: principals {path}; admin token in {token_path}", file=sys.stderr)
    principals = Principals.load(path)
    reload_on_sighup(principals, path)
    return principals


def reload_principals(principals: Principals, path: Path) -> bool:
    """Read ``path`` again into ``principals`` (in place, so every app holding it sees the new
    tokens); a file that does not load keeps the old principals and logs an error.

    Returns:
        Whether the new principals are in force.
    """
    try:
        fresh = Principals.load(path)
    except PrincipalsError as exc:
        _log.error("principals not reloaded; keeping the old ones: %s", exc)
        return False
    principals.replace_with(fresh)
    _log.warning("principals reloaded from %s (%d)", path, len(fresh))
    return True


def reload_on_sighup(principals: Principals, path: Path) -> None:
    """Reload ``principals`` from ``path`` on SIGHUP (as Redis ``ACL LOAD``): a token minted
    with ``kvsp token`` works without a restart. Installed only from the main thread."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGHUP"):
        return

    def on_hangup(sig: int, frame: FrameType | None) -> None:
        try:  # between two steps of the event loop, never inside a request's lookup
            loop = asyncio.get_running_loop()
        except RuntimeError:
            reload_principals(principals, path)
        else:
            loop.call_soon_threadsafe(reload_principals, principals, path)

    signal.signal(signal.SIGHUP, on_hangup)


def with_logging(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """``run`` preceded by :func:`~kvsp.web.logs.configure_logging` from ``--log-format``
    and ``--log-level`` (what ``kvsp serve`` runs for each service), then by the warnings
    of :func:`warn_deprecated`.

    Raises:
        BadRequest: an unknown log level (from the wrapped handler).
    """

    def handler(args: argparse.Namespace) -> int:
        try:
            configure_logging(args.log_format, args.log_level)
        except ValueError as exc:
            raise BadRequest(f"--log-level: {exc}") from None
        warn_deprecated(args)
        return run(args)

    return handler


def add_epoch_skew_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--max-epoch-skew-ms`` (the IS's, the PC's, and one for both in ``kvsp serve
    control``)."""
    parser.add_argument(
        "--max-epoch-skew-ms",
        type=positive_int,
        default=DEFAULT_MAX_EPOCH_SKEW_MS,
        metavar="MS",
        help="refuse an instance status whose epoch is more than MS ahead of this clock; a "
        "kept epoch beyond it yields to the next status (default "
        f"{DEFAULT_MAX_EPOCH_SKEW_MS})",
    )


def add_trust_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--cafile PEM`` and ``--insecure``: the trust of every outbound TLS connection
    (HTTPS and MOQT alike, :mod:`kvsp.web.trust`)."""
    parser.add_argument(
        "--cafile",
        type=Path,
        metavar="PEM",
        help="trust only these CA (or pinned) certificates for every outbound TLS connection: "
        "HTTPS (IS, PC, holders, leases) and MOQT (QUIC, QMux over TLS); default: the system "
        "trust store",
    )
    parser.add_argument(
        "--insecure",
        action="store_true",
        help="do not verify any outbound TLS certificate (tests only; logged as a warning)",
    )


_TRUST_ALIASES = ("relay_cafile", "upstream_cafile")
"""Older per-connection options that now mean ``--cafile`` (accepted, with a warning)."""


def trust_from_args(args: argparse.Namespace) -> Trust:
    """The process's one :class:`~kvsp.web.trust.Trust` from ``--cafile``/``--insecure``.

    ``--relay-cafile`` and ``--upstream-cafile`` are deprecated aliases of ``--cafile`` (and
    ``--upstream-insecure`` of ``--insecure``): one given alone means ``--cafile`` (with a
    warning); given beside a different ``--cafile`` it is refused. ``--insecure`` is logged as a
    warning.

    Raises:
        BadRequest: ``--cafile`` and an alias name different files, ``--insecure`` with a
            CA file, or a CA file that cannot be loaded.
    """
    cafile: Path | None = getattr(args, "cafile", None)
    for dest in _TRUST_ALIASES:
        alias: Path | None = getattr(args, dest, None)
        if alias is None:
            continue
        option = "--" + dest.replace("_", "-")
        if cafile is not None and Path(alias) != Path(cafile):
            raise BadRequest(f"{option} {alias} differs from --cafile {cafile}; give --cafile")
        _log.warning("%s is deprecated and means --cafile (every outbound TLS connection)", option)
        cafile = alias
    insecure = bool(getattr(args, "insecure", False))
    if getattr(args, "upstream_insecure", False):
        _log.warning("--upstream-insecure is deprecated and means --insecure")
        insecure = True
    if insecure and cafile is not None:
        raise BadRequest("--insecure verifies nothing; drop --cafile or --insecure")
    trust = Trust(cafile=None if cafile is None else str(cafile), verify=not insecure)
    try:
        trust.ssl_context()
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise BadRequest(f"--cafile {cafile}: cannot load it: {exc}") from None
    if insecure:
        _log.warning("--insecure: outbound TLS certificates are NOT verified (tests only)")
    return trust


# --- one name per concept -----------------------------------------------------------------------

_DEPRECATED_USED = "_kvsp_deprecated_options"
"""The namespace attribute where :class:`DeprecatedAlias` notes the old spellings it read."""
_warned: set[str] = set()


class DeprecatedAlias(argparse.Action):
    """A hidden older spelling of an option: what it is given is stored exactly as its
    ``canonical`` option would store it (same type, nargs, choices, destination), and the use
    is noted for :func:`warn_deprecated`. Made by :func:`add_deprecated_aliases`."""

    def __init__(
        self,
        option_strings: list[str],
        dest: str,
        canonical: argparse.Action,
        **_ignored: object,
    ) -> None:
        super().__init__(
            option_strings,
            dest,
            nargs=canonical.nargs,
            const=canonical.const,
            default=argparse.SUPPRESS,
            type=None if isinstance(canonical.type, str) else canonical.type,
            choices=canonical.choices,
            required=False,
            help=argparse.SUPPRESS,
            metavar=canonical.metavar,
        )
        self.canonical = canonical

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        """Store as the canonical option and note the old spelling."""
        used: list[tuple[str, str]] = getattr(namespace, _DEPRECATED_USED, [])
        pair = (option_string or self.option_strings[0], self.canonical.option_strings[0])
        if pair not in used:
            used.append(pair)
        setattr(namespace, _DEPRECATED_USED, used)
        self.canonical(parser, namespace, values, self.canonical.option_strings[0])


def add_deprecated_aliases(
    parser: argparse.ArgumentParser,
    canonical: argparse.Action,
    *old: str,
) -> None:
    """Keep the older spellings ``old`` of ``canonical`` working, hidden from ``--help``; each
    one used is logged once as a warning naming the option to use (:func:`warn_deprecated`).

    A required ``canonical`` must be added with ``required=False`` and checked after parsing
    (:func:`require_option`): argparse counts only the canonical spelling as given.
    """
    for name in old:
        parser.add_argument(name, action=DeprecatedAlias, dest=canonical.dest, canonical=canonical)


def require_option(args: argparse.Namespace, dest: str, option: str, what: str) -> None:
    """Refuse a run without option ``option`` (stored at ``dest``), given under any spelling.

    Raises:
        BadRequest: it was not given.
    """
    if getattr(args, dest, None) is None:
        raise BadRequest(f"{option} is required: {what}")


def warn_deprecated(args: argparse.Namespace) -> None:
    """Log, once per process, a warning for each deprecated option spelling ``args`` used."""
    used: list[tuple[str, str]] = getattr(args, _DEPRECATED_USED, [])
    for old, new in used:
        if old not in _warned:
            _warned.add(old)
            _log.warning("%s is deprecated; use %s (it means the same)", old, new)
