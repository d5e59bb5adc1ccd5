"""``kvsp serve relay``: the caching MOQT relay and KVSP holder as a process (DESIGN.md §1, §4).

Usage (``python -m relay.app`` takes the same options)::

    kvsp serve relay --listen 127.0.0.1:4443 [--cert C --key K]
                     [--index URL --index-token-file F]
                     [--qmux-listen HOST:PORT|off] [--qmux-tcp-listen HOST:PORT]
                     [--qmux-unix PATH] [--trusted-network]
                     [--upstream moqt://origin:4443/] [--cafile PEM | --insecure]
                     [--holder-listen 127.0.0.1:0] [--cache-size 1GiB] [--open]

* MOQT draft-16 over raw QUIC (ALPN ``moqt-16``) on ``--listen`` (UDP). Without ``--cert`` and
  ``--key`` it uses a self-signed pair kept in ``STATE/relay-tls`` (made on first start, made
  again when it nears expiry); clients pin that ``cert.pem``.
* MOQT over QMux (draft-ietf-quic-qmux-01) at the same time, one cache and one authorization
  path for all: over TLS 1.3 on ``--qmux-listen`` (TCP; default the ``--listen`` host, a free
  port; ``off`` disables it), over plain TCP on ``--qmux-tcp-listen`` (refused beyond loopback
  without ``--trusted-network``) and over a Unix socket at ``--qmux-unix`` (mode 0600). Records
  list these as ``moqt_carriers`` (fastest first) beside the ``moqt://`` holder URI.
* Peers authenticate with the AUTHORIZATION TOKEN setup parameter (USE_VALUE) against the
  principals file (``--principals``, default ``STATE/principals.toml`` made with one admin
  token). ``--open`` runs without principals (interop testing): every peer may do everything.
* The holder face (leases, healthz, readyz, metrics) listens on ``--holder-listen`` (TCP,
  default port 0): HTTPS with ``--cert``/``--key`` (the certificate of the MOQT face), plain
  HTTP without them.
* ``--cafile PEM`` (or ``--insecure``, tests only) is what every outbound TLS connection trusts:
  the upstream relay's MOQT face and the IS.
* ``--index URL`` makes it a KVSP holder: every complete stored replica track in its cache is
  published there as a Replica Record (its token read from ``--index-token-file``); without it
  the relay only relays and caches. At start one cheap authenticated request checks the IS
  and the token (:func:`check_index`): a refused token ends the relay with exit status 2; an
  IS that does not answer is logged and checked again in the background, since it may start
  later.
* Older spellings still work, hidden and logged once as deprecated: ``--token-file``
  (``--index-token-file``), ``--http-listen`` (``--holder-listen``), ``--backend``
  (``--moqt-backend``), ``--quic-datagram-size`` (``--moqt-datagram-size``),
  ``--upstream-cafile`` (``--cafile``), ``--upstream-insecure`` (``--insecure``).
* ``--ready-file F`` receives, once both listeners are up, one JSON line::

      {"moqt": "moqt://127.0.0.1:P/", "http": "http://127.0.0.1:Q/",
       "carriers": ["moqt+tls://127.0.0.1:R/", ...]}

  (``http`` is the holder face's base URL, ``https://`` with ``--cert``.)

Every flag may also come from a ``KVSP_<FLAG>`` variable or a ``--config FILE`` TOML file (its
``[relay]`` table; :mod:`kvsp.web.config_file`). SIGTERM or SIGINT stops it (records withdrawn
first); exit status 0. Exit status 2: bad options, or the IS refused the token.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography import x509

from kvsp.audience import audience_credential
from kvsp.errors import BadRequest, Forbidden, KVSPError, NotFound, RemoteError, Unauthorized
from kvsp.leases import LeaseQuota
from kvsp.transfer.moqt_carriers import is_loopback
from kvsp.transfer.relay_link import datagram_size
from kvsp.web.auth import Principals
from kvsp.web.cliargs import (
    add_common_arguments,
    add_deprecated_aliases,
    check_tls_pair,
    load_principals,
    parse_listen,
    positive_int,
    positive_size,
    read_timeouts,
    trust_from_args,
    warn_deprecated,
)
from kvsp.web.clock import SystemClock
from kvsp.web.config_file import ConfigArgumentParser
from kvsp.web.failover import add_url_list_argument
from kvsp.web.runner import freeze_startup_heap, write_ready_file
from kvsp.web.sites import add_site_arguments, site_labels
from kvsp.web.trust import Trust
from moqt.backend import (
    BACKENDS,
    DEFAULT_DATAGRAM_SIZE,
    TransportConfig,
    default_backend,
    transport_banner,
)
from moqt.certs import make_self_signed
from moqt.errors import ListenError

from .holder import DEFAULT_RECORD_TTL_MS, HolderConfig, RelayHolder
from .relay import Relay, RelayConfig
from .upstream import UpstreamConfig, parse_moqt_url
from .web import HttpFace, create_app

if TYPE_CHECKING:
    from kvsp.services.index.client import IndexClient

DEFAULT_PORT = 4443
TLS_FOLDER = "relay-tls"
RENEW_BEFORE = datetime.timedelta(days=2)
EXIT_REFUSED = 2
"""Exit status when the IS refuses the relay's token (a configuration error, as bad options)."""
INDEX_RETRY_S = (1.0, 30.0)
"""First and longest wait between checks of an IS that does not answer (doubling)."""
_PROBE_COMPAT = bytes(32)
"""The compat id :func:`check_index` asks the descriptor of: any answer but 401/403 will do."""

_log = logging.getLogger("relay.app")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the relay's own options (the common ones come from ``add_common_arguments``)."""
    add = parser.add_argument
    holder_face = add(
        "--holder-listen",
        default="127.0.0.1:0",
        metavar="HOST:PORT",
        help="the holder face (leases, healthz, readyz, metrics): HTTPS with --cert/--key, "
        "else HTTP (default 127.0.0.1:0, a free port)",
    )
    add_deprecated_aliases(parser, holder_face, "--http-listen")
    add("--open", action="store_true", help="no principals: every peer may do everything")
    backend = add(
        "--moqt-backend",
        choices=BACKENDS,
        default=None,
        help="QUIC library of the relay's MOQT faces (default: the fastest installed, qh3 "
        "before aioquic)",
    )
    add_deprecated_aliases(parser, backend, "--backend")
    datagram = add(
        "--moqt-datagram-size",
        type=datagram_size,
        default=DEFAULT_DATAGRAM_SIZE,
        metavar="OCTETS",
        help=f"largest QUIC datagram the relay sends, 1200-65527 (default "
        f"{DEFAULT_DATAGRAM_SIZE}; 1200: aioquic's own default, safe on any path)",
    )
    add_deprecated_aliases(parser, datagram, "--quic-datagram-size")
    add(
        "--qmux-listen",
        default="",
        metavar="HOST:PORT|off",
        help="MOQT over QMux over TLS 1.3 (TCP); default: the --listen host, a free port",
    )
    add("--qmux-tcp-listen", metavar="HOST:PORT", help="MOQT over QMux over plain TCP")
    add("--qmux-unix", type=socket_path, metavar="PATH", help="MOQT over QMux over a Unix socket")
    add(
        "--trusted-network",
        action="store_true",
        help="allow plain-TCP QMux on a non-loopback address (see SECURITY.md)",
    )
    add(
        "--cache-size",
        type=positive_size,
        default=1 << 30,
        metavar="SIZE",
        help="object cache budget, LRU by track beyond it (default 1GiB)",
    )
    add("--upstream", metavar="URL", help="upstream relay, moqt://host:port/ (edge → origin)")
    add("--upstream-token-file", type=Path, metavar="FILE", help="token for the upstream relay")
    # deprecated aliases of --cafile/--insecure, read by trust_from_args
    add("--upstream-cafile", type=Path, metavar="PEM", help=argparse.SUPPRESS)
    add("--upstream-insecure", action="store_true", help=argparse.SUPPRESS)
    add_url_list_argument(parser, "--index", help="Index Service to publish Replica Records at")
    token = add(
        "--index-token-file",
        type=Path,
        metavar="FILE",
        help="bearer token it presents to the IS (role relay, or holder)",
    )
    add_deprecated_aliases(parser, token, "--token-file")
    add("--public-url", metavar="URL", help="moqt:// URI named in records (default: its own)")
    add_site_arguments(parser)
    add(
        "--record-ttl-ms",
        type=positive_int,
        default=DEFAULT_RECORD_TTL_MS,
        metavar="MS",
        help="cap on record TTLs; refreshed at a third (default 60000)",
    )
    add(
        "--lease-max-octets",
        type=positive_size,
        default=1 << 30,
        metavar="SIZE",
        help="per-client quota of leased octets (default 1GiB)",
    )
    add(
        "--lease-max-ttl-ms",
        type=positive_int,
        default=600_000,
        metavar="MS",
        help="longest lease TTL (default 600000)",
    )
    add(
        "--lease-max-count",
        type=positive_int,
        default=1024,
        metavar="N",
        help="most leases per client (default 1024)",
    )


def _read_secret(path: Path, option: str) -> str:
    try:
        text = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise BadRequest(f"cannot read {option} {path}: {exc.strerror}") from None
    if not text:
        raise BadRequest(f"{option} {path} is empty")
    return text


def socket_path(text: str) -> Path:
    """A Unix socket path (an ``argparse`` type): not empty, which ``Path`` would read as the
    current folder, and not a folder.

    Raises:
        argparse.ArgumentTypeError: an empty path, or one ending in ``/``.
    """
    if not text or text.endswith("/"):
        raise argparse.ArgumentTypeError(f"expected the path of a socket file, got {text!r}")
    return Path(text)


def _certificates(args: argparse.Namespace) -> tuple[Path, Path]:
    """``--cert``/``--key`` (checked: :func:`~kvsp.web.cliargs.check_tls_pair`), or the
    self-signed pair in the state folder."""
    given = check_tls_pair(args)
    if given is not None:
        return given
    folder = Path(args.state) / TLS_FOLDER
    cert, key = folder / "cert.pem", folder / "key.pem"
    if cert.exists() and key.exists():
        with contextlib.suppress(ValueError, OSError):
            loaded = x509.load_pem_x509_certificate(cert.read_bytes())
            now = datetime.datetime.now(datetime.UTC)
            if loaded.not_valid_after_utc - RENEW_BEFORE > now:
                return cert, key
    return make_self_signed("localhost", folder)


def _upstream(args: argparse.Namespace, trust: Trust) -> UpstreamConfig | None:
    if args.upstream is None:
        return None
    try:
        parse_moqt_url(args.upstream)
    except ValueError as exc:
        raise BadRequest(f"--upstream: {exc}") from None
    token = None
    if args.upstream_token_file is not None:
        secret = _read_secret(args.upstream_token_file, "--upstream-token-file")
        # The upstream relay gets a credential for its own URI, never the token itself.
        token = audience_credential(secret, args.upstream)
    return UpstreamConfig(
        url=args.upstream,
        token=token,
        cafile=None if trust.cafile is None else Path(trust.cafile),
        verify=trust.verify,
        backend=args.moqt_backend or default_backend(),
    )


def _principals(args: argparse.Namespace) -> Principals | None:
    if args.open:
        if args.principals is not None:
            raise BadRequest("--open runs without principals; drop --principals")
        return None
    return load_principals(args)


def _index_token(args: argparse.Namespace) -> str | None:
    # Secrets come from files only: a command line is readable by every local user.
    if args.index is None and args.index_token_file is not None:
        raise BadRequest("--index-token-file needs --index")
    if args.index is not None and args.index_token_file is None:
        raise BadRequest("--index needs --index-token-file: the IS takes records from no one else")
    if args.index_token_file is not None:
        return _read_secret(args.index_token_file, "--index-token-file")
    return None


def relay_config(args: argparse.Namespace, trust: Trust | None = None) -> RelayConfig:
    """The :class:`RelayConfig` the options describe; ``trust`` (default: read from ``args``)
    is the process's one TLS trust (``--cafile``/``--insecure``), the upstream's included.

    Raises:
        BadRequest: inconsistent or malformed options.
    """
    host, port = parse_listen(args.listen, "--listen")
    cert, key = _certificates(args)
    if args.public_url is not None and not args.public_url.startswith("moqt://"):
        raise BadRequest("--public-url must be a moqt:// URI")
    qmux_tls: tuple[str, int] | None = (host, 0)
    if args.qmux_listen == "off":
        qmux_tls = None
    elif args.qmux_listen:
        qmux_tls = parse_listen(args.qmux_listen, "--qmux-listen")
    qmux_tcp = None
    if args.qmux_tcp_listen is not None:
        qmux_tcp = parse_listen(args.qmux_tcp_listen, "--qmux-tcp-listen")
        if not args.trusted_network and not is_loopback(qmux_tcp[0]):
            raise BadRequest(
                f"--qmux-tcp-listen {args.qmux_tcp_listen}: plain TCP carries tokens and KV in "
                "the clear; listen on loopback, use --qmux-listen (TLS), or pass "
                "--trusted-network"
            )
    return RelayConfig(
        certificate=cert,
        private_key=key,
        host=host,
        port=port,
        qmux_tls=qmux_tls,
        qmux_tcp=qmux_tcp,
        qmux_unix=args.qmux_unix,
        trusted_network=args.trusted_network,
        backend=args.moqt_backend or default_backend(),
        datagram_size=args.moqt_datagram_size,
        cache_bytes=args.cache_size,
        principals=_principals(args),
        upstream=_upstream(args, trust_from_args(args) if trust is None else trust),
        public_url=args.public_url,
    )


def run(args: argparse.Namespace) -> int:
    """Serve the relay until SIGTERM/SIGINT; returns the exit status.

    Raises:
        BadRequest: inconsistent options.
    """
    logging.basicConfig(level=str(args.log_level).upper())
    warn_deprecated(args)
    trust = trust_from_args(args)
    config = relay_config(args, trust)
    token = _index_token(args)
    labels = site_labels(args)
    holder_config = HolderConfig(
        record_ttl_ms=args.record_ttl_ms,
        lease_quota=LeaseQuota(
            max_octets_per_client=args.lease_max_octets,
            max_ttl_ms=args.lease_max_ttl_ms,
            max_leases_per_client=args.lease_max_count,
        ),
        capacity=config.cache_bytes,
        site=labels.site,
        zone=labels.zone,
    )
    http_host, http_port = parse_listen(args.holder_listen, "--holder-listen")
    try:
        asyncio.run(_serve(args, config, holder_config, token, (http_host, http_port), trust))
    except IndexRefused as exc:
        print(f"relay: error: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    return 0


class IndexRefused(Exception):
    """The IS refused the relay's token (401 or 403): a configuration error, not a fault that
    passes."""


async def check_index(index: IndexClient) -> None:
    """Ask the IS one cheap authenticated question (``GET descriptors/{compat}`` for an id
    nobody registers, which every relay or holder token may read): any answer but 401 or 403
    shows that the IS is there and takes the token.

    Raises:
        IndexRefused: the IS answered 401 or 403.
        KVSPError: it did not answer (unreachable, 5xx).
    """
    try:
        await index.get_descriptor(_PROBE_COMPAT)
    except NotFound:
        _log.info("the Index Service at %s answers and takes the token", index.base_url)
        return
    except (Unauthorized, Forbidden) as exc:
        raise IndexRefused(_refusal(index.base_url, exc.status, exc)) from None
    except RemoteError as exc:
        if exc.remote_status in (401, 403):
            raise IndexRefused(_refusal(index.base_url, exc.remote_status, exc)) from None
        if exc.remote_status >= 500:
            raise
    _log.info("the Index Service at %s answers and takes the token", index.base_url)


def _refusal(url: str, status: int, exc: KVSPError) -> str:
    return (
        f"the Index Service at {url} refused the token of --index-token-file ({status}: "
        f"{exc}); give a token it knows, with role relay (kvsp token --role relay ...)"
    )


async def watch_index(index: IndexClient, refused: list[IndexRefused]) -> None:
    """Check an IS that did not answer at start again, waiting longer each time
    (:data:`INDEX_RETRY_S`), until it answers; a refusal then is put in ``refused``."""
    delay = INDEX_RETRY_S[0]
    while True:
        await asyncio.sleep(delay)
        try:
            await check_index(index)
        except IndexRefused as exc:
            _log.error("%s", exc)
            refused.append(exc)
            return
        except KVSPError as exc:
            delay = min(delay * 2, INDEX_RETRY_S[1])
            _log.warning("the Index Service at %s does not answer yet: %s", index.base_url, exc)
            continue
        return


async def _serve(
    args: argparse.Namespace,
    config: RelayConfig,
    holder_config: HolderConfig,
    token: str | None,
    http_address: tuple[str, int],
    trust: Trust,
) -> None:
    from kvsp.services.index.client import IndexClient

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    clock = SystemClock()
    refused: list[IndexRefused] = []
    async with contextlib.AsyncExitStack() as stack:
        index = None
        if args.index is not None:
            index = await stack.enter_async_context(IndexClient(args.index, token, trust=trust))
            try:
                await check_index(index)  # IndexRefused: ends the relay at once
            except KVSPError as exc:
                _log.warning(
                    "the Index Service at %s does not answer (%s): serving, and publishing "
                    "once it does",
                    ", ".join(args.index),
                    exc,
                )
                watch = asyncio.create_task(watch_index(index, refused))
                watch.add_done_callback(lambda _t: stop.set() if refused else None)
                stack.callback(watch.cancel)
        holder = RelayHolder(holder_config, clock, index)
        tls = args.cert is not None
        face = HttpFace(
            create_app(holder, config.principals, clock),
            *http_address,
            certfile=str(args.cert) if tls else None,
            keyfile=str(args.key) if tls else None,
            log_level=args.log_level,
            timeouts=read_timeouts(args),
        )
        holder.lease_base = face.url
        relay = Relay(config, holder=holder, clock=clock)
        face.app.state.relay = relay  # the face's /metrics reads its MOQT octets
        moqt_url = await relay.start()
        try:
            await face.start()
            freeze_startup_heap()
            if args.ready_file is not None:
                ready = {"moqt": moqt_url, "http": face.url, "carriers": list(relay.carriers)}
                write_ready_file(Path(args.ready_file), json.dumps(ready))
            quic = TransportConfig(max_datagram_size=config.datagram_size)
            print(
                f"kvsp relay: {moqt_url} (QUIC: {transport_banner(config.backend, quic)}); QMux: "
                f"{', '.join(relay.carriers) or 'off'}; holder face {face.url}",
                file=sys.stderr,
            )
            await stop.wait()
        finally:
            await relay.close()
            await face.stop()
    if refused:
        raise refused[0]


def build_parser() -> ConfigArgumentParser:
    """The parser of ``python -m relay.app``: ``kvsp serve relay``'s flags, which may also come
    from ``KVSP_*`` variables and ``--config FILE`` (:mod:`kvsp.web.config_file`)."""
    # no abbreviations: "--token SECRET" must not pass for "--token-file SECRET"
    parser = ConfigArgumentParser(
        prog="relay", description=__doc__.splitlines()[0], allow_abbrev=False, service="relay"
    )
    add_common_arguments(parser, DEFAULT_PORT)
    configure_parser(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m relay.app``: the same options as ``kvsp serve relay``."""
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (KVSPError, ListenError) as exc:
        print(f"relay: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
