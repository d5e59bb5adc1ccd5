"""An instance's (or holder's) MOQT session to its edge relay (DESIGN.md §1, §4; spec §4.4, §6.1).

:class:`RelayLink` keeps one MOQT session to the relay, reconnecting after a loss. On it:

* a :class:`~kvsp.transfer.moqt_publisher.MoqtBlockPublisher` answers the relay's FETCH and
  SUBSCRIBE for the blocks of a :class:`~kvsp.transfer.moqt_publisher.BlockSource` (the
  holder's store: :class:`HolderBlocks`);
* every scope it has blocks of is PUBLISH_NAMESPACEd as the four-field prefix
  ``("kvsp", "1", compat, scope)`` (DESIGN §4), so the relay routes a miss for any block of
  the scope here; after a reconnect every scope is announced again;
* every block handed to :meth:`RelayLink.push` is PUBLISHed as its stored track (name = the
  replica digest; group 0, object = layer, one ascending subgroup stream, FIN, PUBLISH_DONE),
  unless the relay already holds the whole track (TRACK_STATUS answers its Largest Location).
  The relay caches what it receives and, being a holder, publishes its own Replica Record
  (``moqt://`` holder, ``lease_base`` its HTTP face), so the block outlives this process.

:class:`MirroringIndex` is the :class:`~kvsp.index.ReplicaIndex` a
:class:`~kvsp.services.holder.Holder` publishes through: every record still goes to the IS, and
the first publication of each replica also pushes the block to the relay. The push happens in
the background and never fails the publication: the IS record is authoritative (§6.1), the
relay's copy an extra source.

:class:`RelayAttachment` reads the command line: ``--relay`` and the process's trust
(``--cafile``/``--insecure``, :mod:`kvsp.web.trust`; ``--relay-cafile`` is a deprecated alias of
``--cafile``), and how
the process's MOQT client reaches ``moqt://`` holders: ``--moqt-carriers off`` keeps it on QUIC
(no QMux carrier a record offers is used, DESIGN.md §4 Carriers), ``--moqt-backend`` and
``--moqt-datagram-size`` choose the QUIC library and the largest datagram it sends (RFC 9000
§14: at least 1,200 octets; §18.2: at most 65,527).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvsp.audience import AudienceSigner
from kvsp.errors import BadRequest, KVSPError, UnsupportedHolder
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.index import ReplicaIndex
from kvsp.moqt_mapping import KV_GROUP, kv_scope_prefix
from kvsp.records import ReplicaRecord
from kvsp.registries import Codec
from kvsp.stores.blocks import BlockRef, BlockStore
from kvsp.transfer.moqt_carriers import (
    CarrierPolicy,
    SessionOptions,
    check_allowed,
    open_session,
)
from kvsp.transfer.moqt_client import MoqtBlockClient, address_origin
from kvsp.transfer.moqt_publisher import BlockSource, MemoryBlocks, MoqtBlockPublisher, StoredBlock
from kvsp.transfer.moqt_transfer import parse_moqt_uri
from kvsp.web.background import raise_if_cancelling
from kvsp.web.cliargs import trust_from_args
from kvsp.web.trust import Trust
from moqt.asyncio import MOQTConnection, RequestRejected, SessionClosedError
from moqt.backend import BACKENDS, DEFAULT_DATAGRAM_SIZE, TransportConfig, transport_banner
from moqt.wire import Location

log = logging.getLogger(__name__)
OFFLOAD_OCTETS = 1 << 20
"""Blocks this large are read and checked (:meth:`BlockStore.container`) in a worker thread."""
_Item = tuple[CompatId, ScopeId, BlockKey | None]  # a block to push, or (key None) a scope


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayLinkConfig:
    """Where the relay is and how to reach it (``kvsp serve instance --relay``)."""

    url: str
    """The relay's URI: ``moqt://host:port/`` (QUIC), or a QMux carrier (``moqt+tls://``,
    ``moqt+tcp://``, ``moqt+unix://localhost/path.sock``) to publish over."""
    token: str | None = None
    """Bearer token (role instance/holder); the AUTHORIZATION TOKEN setup parameter carries
    its audience credential for ``url`` (:mod:`kvsp.audience`), not the token itself."""
    cafile: str | None = None
    """PEM certificate(s) to pin (the relay's self-signed ``relay-tls/cert.pem``)."""
    verify: bool = True
    backend: str | None = None
    """QUIC library; None: the measured default (:func:`moqt.backend.default_backend`)."""
    transport: TransportConfig | None = None
    qmux: bool = True
    """Whether ``url`` may be a QMux carrier (``--moqt-carriers``)."""
    trusted_network: bool = False
    """Allow ``moqt+tcp://`` to a non-loopback relay."""
    retry_s: float = 1.0
    """Pause before reconnecting after a failed or lost session."""
    timeout_s: float = 10.0
    """Bound on the handshake and on each request."""


class HolderBlocks:
    """A :class:`BlockSource` over a holder's store: its complete raw-codec blocks."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store

    async def lookup(self, compat: CompatId, scope: ScopeId, key: BlockKey) -> StoredBlock | None:
        """The block when the store holds all of it in codec raw (DESIGN §4), else None."""
        stored = self.store.get(BlockRef(compat, scope, key), touch=False)
        if stored is None or not stored.meta.complete or stored.meta.codec != Codec.RAW:
            return None
        meta = stored.meta
        # a disk-tier block is read and hashed before it is served: off the loop when large
        if meta.size >= OFFLOAD_OCTETS:
            container = await asyncio.to_thread(self.store.container, stored)
        else:
            container = self.store.container(stored)
        return StoredBlock(
            compat=compat,
            scope=scope,
            key=key,
            container=container,
            layer_digests=meta.layer_digests,
            digest=meta.digest,
        )


class RelayLink:
    """One MOQT session to the relay (see the module docstring); ``start`` it, ``close`` it.

    ``pushed`` counts the blocks sent to the relay, ``skipped`` those it already held.

    Raises:
        UnsupportedHolder: ``config.url`` is not a MOQT URI, or one the link may not dial
            (plain TCP beyond loopback without ``trusted_network``).
    """

    def __init__(self, config: RelayLinkConfig, blocks: BlockSource) -> None:
        self.config = config
        policy = CarrierPolicy(qmux=config.qmux, trusted_network=config.trusted_network)
        self.address = check_allowed(parse_moqt_uri(config.url), policy)
        self.blocks = blocks
        self.pushed = 0
        self.skipped = 0
        self._scopes: dict[tuple[CompatId, ScopeId], None] = {}  # ordered set
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._pending: list[_Item] = []  # taken from the queue, not yet done (kept over a loss)
        self._task: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    def start(self) -> None:
        """Connect in the background (and reconnect after every loss)."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvsp-relay-link")

    async def close(self) -> None:
        """Close the session; pushes not yet done are dropped."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def announce(self, compat: CompatId, scope: ScopeId) -> None:
        """Have the scope prefix announced to the relay (now, and after every reconnect)."""
        self._put((compat, scope, None))

    def push(self, compat: CompatId, scope: ScopeId, key: BlockKey) -> None:
        """Publish the block to the relay in the background (announcing its scope first)."""
        self._put((compat, scope, key))

    async def idle(self) -> None:
        """Wait until every push and announcement asked for so far is done."""
        await self._idle.wait()

    def _put(self, item: _Item) -> None:
        self._idle.clear()
        self._queue.put_nowait(item)

    # --- the session --------------------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                await self._session()
            except (OSError, TimeoutError, SessionClosedError, RequestRejected) as exc:
                raise_if_cancelling()
                log.warning("relay link to %s: %s", self.config.url, exc)
            except Exception:  # noqa: BLE001 - keep linking; the next session retries
                raise_if_cancelling()
                log.exception("relay link to %s failed", self.config.url)
                self._pending.clear()  # not the session's fault: do not retry that item
            await asyncio.sleep(self.config.retry_s)

    async def _session(self) -> None:
        cfg = self.config
        options = SessionOptions(
            cafile=cfg.cafile,
            verify=cfg.verify,
            backend=cfg.backend,
            transport=cfg.transport,
            # A credential for the relay's URI, never the token (which opens the IS and PC).
            token=AudienceSigner(cfg.token).credential(address_origin(self.address)),
            timeout=cfg.timeout_s,
            policy=CarrierPolicy(qmux=cfg.qmux, trusted_network=cfg.trusted_network),
        )
        async with contextlib.AsyncExitStack() as stack:
            connection = await open_session(stack, self.address, options)
            publisher = MoqtBlockPublisher(connection, self.blocks)
            serving = asyncio.create_task(publisher.serve())
            try:
                for compat, scope in list(self._scopes):
                    await self._announce(publisher, compat, scope)
                await self._work(connection, publisher)
            finally:
                serving.cancel()

    async def _work(self, connection: MOQTConnection, publisher: MoqtBlockPublisher) -> None:
        closed = asyncio.ensure_future(connection.wait_closed())
        getter: asyncio.Future[_Item] | None = None
        try:
            while True:
                if not self._pending:
                    if self._queue.empty():
                        self._idle.set()
                    getter = asyncio.ensure_future(self._queue.get())
                    await asyncio.wait({getter, closed}, return_when=asyncio.FIRST_COMPLETED)
                    if not getter.done():
                        return  # the session ended
                    self._pending.append(getter.result())
                await self._do(connection, publisher, self._pending[0])
                self._pending.pop(0)
        finally:
            closed.cancel()
            if getter is not None and not getter.done():
                getter.cancel()

    async def _do(
        self, connection: MOQTConnection, publisher: MoqtBlockPublisher, item: _Item
    ) -> None:
        compat, scope, key = item
        if (compat, scope) not in self._scopes:
            self._scopes[(compat, scope)] = None
            await self._announce(publisher, compat, scope)
        if key is None:
            return
        block = await self.blocks.lookup(compat, scope, key)
        if block is None:
            return  # evicted meanwhile: nothing to push
        if await self._relay_holds(connection, block):
            self.skipped += 1
            return
        try:
            sent = await asyncio.wait_for(publisher.push(block), self.config.timeout_s * 6)
        except RequestRejected as exc:  # e.g. not authorized for the scope: do not retry
            log.warning("the relay refused block %s: %s", key.hex()[:16], exc)
            return
        except KVSPError as exc:
            log.warning("block %s cannot be pushed: %s", key.hex()[:16], exc)
            return
        self.pushed += sent

    async def _announce(
        self, publisher: MoqtBlockPublisher, compat: CompatId, scope: ScopeId
    ) -> None:
        try:
            await asyncio.wait_for(publisher.announce(compat, scope), self.config.timeout_s)
        except RequestRejected as exc:
            log.warning("the relay refused %r: %s", kv_scope_prefix(compat, scope), exc)

    async def _relay_holds(self, connection: MOQTConnection, block: StoredBlock) -> bool:
        """Whether the relay answers TRACK_STATUS with the block's last layer as Largest."""
        try:
            ok = await asyncio.wait_for(
                connection.track_status(block.namespace, block.track_name), self.config.timeout_s
            )
        except RequestRejected:
            return False
        last = Location(KV_GROUP, len(block.layer_digests) - 1)
        return ok.parameters.largest_object == last


class MirroringIndex:
    """A :class:`~kvsp.index.ReplicaIndex` that publishes at ``inner`` (the
    IS) and pushes each newly published replica to the relay through ``link``."""

    def __init__(self, inner: ReplicaIndex, link: RelayLink) -> None:
        self.inner = inner
        self.link = link
        self._mirrored: set[bytes] = set()  # replica digests already handed to the link

    async def publish(self, record: ReplicaRecord, /) -> int:
        """Publish at the IS, then mirror to the relay."""
        granted = await self.inner.publish(record)
        self._mirror(record)
        return granted

    async def publish_batch(self, records: Sequence[ReplicaRecord], /) -> list[int | KVSPError]:
        """Publish at the IS, then mirror every record it accepted."""
        outcomes = await self.inner.publish_batch(records)
        for record, outcome in zip(records, outcomes, strict=False):
            if not isinstance(outcome, KVSPError):
                self._mirror(record)
        return outcomes

    async def withdraw(
        self, compat: CompatId, scope: ScopeId, key: BlockKey, holder: str, /
    ) -> bool:
        """Withdraw at the IS (the relay keeps its copy and its own record)."""
        return await self.inner.withdraw(compat, scope, key, holder)

    def _mirror(self, record: ReplicaRecord) -> None:
        if record.codec != Codec.RAW or record.digest in self._mirrored:
            return
        self._mirrored.add(record.digest)
        self.link.push(record.compat_id, record.scope_id, record.block_key)


# --- the command line (``kvsp serve instance``) ------------------------------------------------


MIN_DATAGRAM = 1200
"""The smallest QUIC datagram a path must carry (RFC 9000 §14); also aioquic's own default."""
MAX_DATAGRAM = 65527
"""The largest max_udp_payload_size (RFC 9000 §18.2)."""


def datagram_size(text: str) -> int:
    """A QUIC datagram size in octets, 1200 to 65527 (an ``argparse`` type).

    Raises:
        argparse.ArgumentTypeError: not an integer in that range.
    """
    if not (text.isascii() and text.isdigit()) or not MIN_DATAGRAM <= int(text) <= MAX_DATAGRAM:
        raise argparse.ArgumentTypeError(
            f"expected a datagram size of {MIN_DATAGRAM} to {MAX_DATAGRAM} octets, got {text!r}"
        )
    return int(text)


def add_relay_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--relay URL``, ``--relay-cafile PEM`` (deprecated: ``--cafile``),
    ``--trusted-network`` and the MOQT client's
    transport choices: ``--moqt-carriers on|off``, ``--moqt-backend NAME``,
    ``--moqt-datagram-size OCTETS``."""
    parser.add_argument(
        "--relay",
        metavar="URL",
        help="edge relay: announce scopes, publish computed blocks there; moqt://host:port/ "
        "(QUIC) or a QMux carrier: moqt+tls://host:port/, moqt+unix://localhost/PATH, "
        "moqt+tcp://host:port/",
    )
    parser.add_argument(
        "--trusted-network",
        action="store_true",
        help="allow MOQT over plain-TCP QMux (moqt+tcp) beyond loopback (see SECURITY.md)",
    )
    parser.add_argument(
        "--relay-cafile",
        type=Path,
        metavar="PEM",
        help=argparse.SUPPRESS,  # deprecated alias of --cafile (kvsp.web.cliargs)
    )
    parser.add_argument(
        "--moqt-carriers",
        choices=("on", "off"),
        default="on",
        help="on: reach a moqt:// holder over the QMux carriers its record offers (Unix socket, "
        "TLS, TCP) before QUIC (default); off: QUIC only, e.g. where a middlebox passes only UDP "
        "or to compare the carriers",
    )
    parser.add_argument(
        "--moqt-backend",
        choices=BACKENDS,
        default=None,
        help="QUIC library for MOQT sessions (default: the fastest installed, qh3 before aioquic)",
    )
    parser.add_argument(
        "--moqt-datagram-size",
        type=datagram_size,
        metavar="OCTETS",
        default=None,
        help=f"largest QUIC datagram this process sends, {MIN_DATAGRAM}-{MAX_DATAGRAM} "
        f"(default {DEFAULT_DATAGRAM_SIZE}, with path-MTU probing where the library does it; "
        f"{MIN_DATAGRAM}: aioquic's own default, safe on any path)",
    )


def relay_transport(args: argparse.Namespace) -> TransportConfig | None:
    """The QUIC transport ``--moqt-datagram-size`` asks for; None: the defaults."""
    size = getattr(args, "moqt_datagram_size", None)
    return None if size is None else TransportConfig(max_datagram_size=size)


def carrier_policy(args: argparse.Namespace) -> CarrierPolicy:
    """The :class:`CarrierPolicy` of ``--moqt-carriers`` and ``--trusted-network``."""
    return CarrierPolicy(
        qmux=getattr(args, "moqt_carriers", "on") != "off",
        trusted_network=bool(getattr(args, "trusted_network", False)),
    )


def check_relay_argument(args: argparse.Namespace) -> None:
    """Check ``--relay`` before a process starts anything: a MOQT URI that the carrier
    options let it dial.

    Raises:
        BadRequest: it is not, naming ``--relay``.
    """
    relay = getattr(args, "relay", None)
    if relay is None:
        return
    try:
        check_allowed(parse_moqt_uri(relay), carrier_policy(args))
    except UnsupportedHolder as exc:
        raise BadRequest(f"--relay: {exc.detail}") from None


class RelayAttachment:
    """What ``--relay``, the process's ``trust`` and the ``--moqt-*`` options add to a process
    with a
    holder face: a MOQT block client for ``moqt://`` replicas (over the carriers, QUIC library
    and datagram size asked for), and (with ``--relay``) the link that mirrors the holder's
    publications to the relay.

    Raises:
        UnsupportedHolder: ``--relay`` is not a MOQT URI, or a QMux carrier while
            ``--moqt-carriers off``.
    """

    def __init__(
        self, args: argparse.Namespace, token: str | None, trust: Trust | None = None
    ) -> None:
        relay = getattr(args, "relay", None)
        self.token = token
        self.trust = trust_from_args(args) if trust is None else trust
        self.policy = carrier_policy(args)
        self.backend: str | None = getattr(args, "moqt_backend", None)
        self.transport = relay_transport(args)
        self.link: RelayLink | None = None
        if relay is not None:
            config = RelayLinkConfig(
                url=relay,
                token=token,
                cafile=self.trust.cafile,
                verify=self.trust.verify,
                backend=self.backend,
                transport=self.transport,
                qmux=self.policy.qmux,
                trusted_network=self.policy.trusted_network,
            )
            self.link = RelayLink(config, MemoryBlocks())
        log.info("MOQT over QUIC: %s", transport_banner(self.backend, self.transport))
        if not self.policy.qmux:
            log.info("MOQT over QMux: off (--moqt-carriers off)")

    def moqt_client(self) -> MoqtBlockClient:
        """The client :class:`~kvsp.transfer.block_client.BlockClient` hands ``moqt://``
        replicas to (over the fastest carrier each record offers)."""
        return MoqtBlockClient(
            cafile=self.trust.cafile,
            verify=self.trust.verify,
            auth_token=self.token,
            backend=self.backend,
            transport=self.transport,
            policy=self.policy,
        )

    def index(self, index: ReplicaIndex) -> ReplicaIndex:
        """The index the holder publishes through: mirrored to the relay with ``--relay``."""
        return index if self.link is None else MirroringIndex(index, self.link)

    def start(self, store: BlockStore, stack: contextlib.AsyncExitStack) -> None:
        """Serve the blocks of the holder's ``store`` on the link and start it (closed with
        ``stack``)."""
        if self.link is not None:
            self.link.blocks = HolderBlocks(store)
            self.link.start()
            stack.push_async_callback(self.link.close)


__all__ = [
    "HolderBlocks",
    "MirroringIndex",
    "RelayAttachment",
    "RelayLink",
    "RelayLinkConfig",
    "add_relay_arguments",
    "datagram_size",
    "relay_transport",
]
