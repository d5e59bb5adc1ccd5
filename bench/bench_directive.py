"""Benchmark the prefetch directive path end to end (spec §6.5 directives, §6.6 leases, §6.7
verified retrieval, §6.1 publishing; DESIGN.md §4 KV blocks over MOQT), in blocks per second.

Run: ``.venv/bin/python bench/bench_directive.py [--quick] [--blocks N] [--reps N]``.

Every part is a real process on 127.0.0.1, as ``kvsp demo`` runs them: ``kvsp serve control``
(IS + PC), ``kvsp serve relay --index`` (the caching MOQT relay, a holder at the IS, listening
on QUIC, on QMux over TLS and, as in the demo, on QMux over a Unix socket), a source
``kvsp serve instance --relay`` whose holder face takes the blocks (PUT, §6.7) and mirrors each
to the relay, and three target instances, one per variant:

``after``
    The defaults: ``--prefetch-pipeline on`` (batched leases and publications, transfers
    overlapped with placing), MOQT over the fastest carrier the relay's records offer (its Unix
    socket), QUIC on the default backend.
``off``
    ``--prefetch-pipeline off`` (block after block: lookup, lease, GET or FETCH, verify, place,
    release, publish, one after another) with the new transports of the ``after`` target, so
    that the pipeline's share and the transports' share of the gain show apart.
``before``
    The path as it was before the pipeline and the QMux carriers, rebuilt from options that
    remain operator choices: ``--prefetch-pipeline off``, ``--moqt-carriers off`` (MOQT over
    QUIC only), ``--moqt-backend aioquic --moqt-datagram-size 1200`` (aioquic at its library
    defaults), against a relay that runs ``--moqt-backend aioquic --moqt-datagram-size 1200``
    (the relay's QUIC side is used by this target alone: the others reach it over the Unix
    socket). Fixes that cannot be switched off are in it too, so it is faster than the old
    code was: the web runner answers keep-alive requests without Nagle's delay, and the
    verification, relay cache and record code are today's. Over HTTP ``before`` and ``off``
    are the same path (the HTTP client has no such options); the table shows ``before``.
``filed``
    The code as it was when issue #20 was filed (:data:`FILED_COMMIT`, the last commit before
    its work), not a rebuild: :func:`filed_tree` extracts that commit from this clone's git
    history into a temporary folder and builds its C extensions there, and a cluster of its
    own (control, relay, source, target, all that code, run from that folder with this
    environment's packages) serves the directive, with the flags that code took (QUIC on
    aioquic only, no pipeline). That code has no long poll, so the status is polled every
    :data:`FILED_POLL_S` (an error of at most that much, against it). ``kvsp demo`` at that
    commit printed the issue's figures (MOQT 4.2 MB/s, HTTP 5.1 here on 2026-12-06).

One measurement (:func:`measure_directive`): fresh blocks (new keys) are stored at the source
and published, at the source's HTTP face and, through the relay, as ``moqt://`` replicas; then
a directive naming them all is posted to a target with the one source of the transport (the
source instance for HTTP, the relay for MOQT), and the clock runs from the POST until a GET of
its status (a long poll, ``?wait_ms=``, answered as the directive stops) says ``complete``. The
figure is blocks divided by those seconds. The clusters are started once per block size and
process, and stopped at exit. With ``KVSP_BENCH_PROFILE=DIR`` in the environment every process
runs under cProfile and writes ``DIR/NAME.prof`` as it stops.

The CLI prints one row per block size, transport and variant, each the median of ``--reps``
runs, and its ratio to ``before`` and to ``filed``. ``bench/bench_moqt.py`` imports
:func:`measure_directive` for its line ``ratio directive-64k/directive-64k-before``: ``after``
against ``filed`` (against ``before`` where this clone lacks that commit, and says so).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import hashlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402

from kvsp.compat import CompatibilityDescriptor, compat_id  # noqa: E402
from kvsp.container import encode_container  # noqa: E402
from kvsp.engine.toy import toy_descriptor  # noqa: E402
from kvsp.ids import BlockKey  # noqa: E402
from kvsp.keys import scope_id  # noqa: E402
from kvsp.transfer.block_client import BlockClient  # noqa: E402
from kvsp.web.auth import principal_entry, write_principals  # noqa: E402
from kvsp.web.http import repr_digest  # noqa: E402
from kvsp.web.testing import RunningService, start_process  # noqa: E402

TOKEN = "bench-directive-admin-token-0123456789ab"
AUTH = {"authorization": f"Bearer {TOKEN}"}
SCOPE_KEY = bytes(range(7, 47))
SCOPE = scope_id(SCOPE_KEY)
BLOCK_TOKENS = 16
TRANSPORTS = ("http", "moqt")
VARIANTS: dict[str, tuple[str, ...]] = {
    "after": ("--prefetch-pipeline", "on"),
    "off": ("--prefetch-pipeline", "off"),
    "before": (
        "--prefetch-pipeline",
        "off",
        "--moqt-carriers",
        "off",
        "--moqt-backend",
        "aioquic",
        "--moqt-datagram-size",
        "1200",
    ),
}
"""Each target instance's options (see the module docstring)."""
FILED = "filed"
FILED_COMMIT = "20ffc221d33fdf287d1342ebb689644487d63495"
"""The last commit before issue #20's work: the directive path the issue measured."""
FILED_POLL_S = 0.01
WAIT_S = 120.0
PROFILE_ENV = "KVSP_BENCH_PROFILE"
"""Set to a folder: every process runs under cProfile and leaves ``NAME.prof`` there."""


def descriptor_for(block_bytes: int) -> CompatibilityDescriptor:
    """A toy descriptor whose blocks hold ``block_bytes`` octets of K and V (fp16, 16 tokens):
    16 layers up to 256 KiB, 32 above.

    Raises:
        ValueError: a size that does not split into layers of whole fp16 heads of 16 tokens.
    """
    layers = 16 if block_bytes <= 256 * 1024 else 32
    per_k = block_bytes // layers // 2
    width, rest = divmod(per_k, BLOCK_TOKENS * 2)  # kv_heads * head_dim
    if rest or width == 0 or block_bytes != width * BLOCK_TOKENS * 2 * 2 * layers:
        raise ValueError(f"{block_bytes} octets do not make a block of whole fp16 heads")
    kv_heads = max(1, width // 128)
    if width % kv_heads:
        kv_heads = 1
    return toy_descriptor(
        layers=layers,
        kv_heads=kv_heads,
        head_dim=width // kv_heads,
        kv_dtype="fp16",
        block_tokens=BLOCK_TOKENS,
    )


def _container(descriptor: CompatibilityDescriptor, seed: bytes) -> bytes:
    section = BLOCK_TOKENS * descriptor.kv_heads * descriptor.head_dim * 2
    base = (seed * (2 * section // len(seed) + 1))[: 2 * section]
    pairs = [(base[:section], base[section:]) for _ in range(descriptor.layers)]
    return encode_container(pairs, first_layer=0, token_count=BLOCK_TOKENS)


@dataclass
class DirectiveCluster:
    """Control, relay, a source instance and a target per variant for one block size, as
    processes under ``folder``."""

    block_bytes: int
    folder: Path
    tree: Path | None = None
    """Where the code runs from (``python -m kvsp`` there); None: this checkout."""
    services: list[RunningService] = field(default_factory=list)
    urls: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.descriptor = descriptor_for(self.block_bytes)
        self.compat = compat_id(self.descriptor)

    def _start(self, name: str, *argv: str) -> RunningService:
        work = self.folder / name
        work.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "kvsp", "serve", *argv]
        profile = os.environ.get(PROFILE_ENV)
        if profile:  # cProfile writes the statistics when the process exits (SIGTERM at stop)
            command[1:1] = ["-m", "cProfile", "-o", str(Path(profile) / f"{name}.prof")]
        command += ["--listen", "127.0.0.1:0", "--principals", str(self.folder / "p.toml")]
        command += ["--state", str(work / "state"), "--log-level", "warning"]
        service = start_process(command, workdir=work, cwd=self.tree, ready_timeout=90)
        self.services.append(service)
        return service

    def _files(self) -> tuple[Path, Path]:
        """The principals, token, scope key and descriptor files; (token, descriptor)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        write_principals(self.folder / "p.toml", [principal_entry("admin", TOKEN, ["admin"], None)])
        token = self.folder / "admin.token"
        token.write_text(TOKEN)
        (self.folder / "scope.key").write_text(SCOPE_KEY.hex())
        descriptor = self.folder / "descriptor.json"
        descriptor.write_text(json.dumps(self.descriptor.to_json()))
        return token, descriptor

    def start(self) -> None:
        """Start every process (control and relay first, the instances after)."""
        token, descriptor = self._files()
        control = self._start("control", "control").base_url
        socket = self.folder / "relay.sock"
        relay = self._start(
            "relay",
            "relay",
            "--index",
            control,
            "--token-file",
            str(token),
            "--qmux-unix",
            str(socket),
            *("--moqt-backend", "aioquic", "--moqt-datagram-size", "1200"),  # "before" QUIC
        )
        faces = json.loads(relay.base_url)
        cert = self.folder / "relay" / "state" / "relay-tls" / "cert.pem"
        common: tuple[str, ...] = ("--pc", control, "--token-file", str(token))
        common += ("--descriptor", str(descriptor))
        common += ("--cafile", str(cert), "--tier", "host=4GiB")
        common += (
            "--kv-capacity-blocks",
            "65536",
            "--scope-key-file",
            str(self.folder / "scope.key"),
        )
        unix = f"moqt+unix://localhost{socket}"
        source = self._start("source", "instance", *common, "--relay", unix).base_url
        self.urls = {"control": control, "http": source, "moqt": faces["moqt"]}
        for variant, options in VARIANTS.items():
            target = self._start(f"target-{variant}", "instance", *common, *options)
            self.urls[variant] = target.base_url

    def stop(self) -> None:
        """Stop every process, the last started first, and remove the folder."""
        for service in reversed(self.services):
            service.stop()
        self.services.clear()
        shutil.rmtree(self.folder, ignore_errors=True)

    async def store_blocks(self, count: int) -> list[BlockKey]:
        """Store ``count`` new blocks at the source; returns their keys once the IS has both
        the source's record and the relay's of each."""
        keys = [BlockKey(os.urandom(32)) for _ in range(count)]
        await self._put_all(keys)
        holders = {self.urls["http"], self.urls["moqt"]}
        async with httpx.AsyncClient(headers=AUTH, timeout=30) as http:
            deadline = time.monotonic() + WAIT_S
            while True:
                body = {
                    "scope_id": SCOPE.hex(),
                    "compat_id": self.compat.hex(),
                    "block_keys": [k.hex() for k in keys],
                }
                answer = (await http.post(self.urls["control"] + "lookup", json=body)).json()
                found = [{r["holder"] for r in rs} for rs in answer.get("replicas") or []]
                if len(found) == count and all(holders <= f for f in found):
                    return keys
                if time.monotonic() > deadline:
                    raise RuntimeError("the blocks were not published at the source and relay")
                await asyncio.sleep(0.05)

    async def _put_all(self, keys: list[BlockKey]) -> None:
        """PUT a container for each of ``keys`` at the source, 8 at a time."""
        async with BlockClient(TOKEN) as client:
            sem = asyncio.Semaphore(8)

            async def put(key: BlockKey) -> None:
                async with sem:
                    data = _container(self.descriptor, key)
                    await client.put_block(self.urls["http"], self.compat, SCOPE, key, data)

            await asyncio.gather(*(put(k) for k in keys))

    async def run_directive(self, keys: list[BlockKey], *, variant: str, transport: str) -> float:
        """Post a directive for ``keys`` from ``transport``'s source to ``variant``'s target;
        the seconds from the POST until the status GET says complete.

        Raises:
            RuntimeError: the directive ended otherwise, or not within the wait.
        """
        target = self.urls[variant]
        directive = str(uuid.uuid4())
        body = {
            "directive": directive,
            "scope_id": SCOPE.hex(),
            "compat_id": self.compat.hex(),
            "blocks": [{"block_key": k.hex(), "sources": [self.urls[transport]]} for k in keys],
            "layer_order": "ascending",
            "deadline_ms": int(WAIT_S * 1000),
            "lease_ms": 30_000,
        }
        async with httpx.AsyncClient(headers=AUTH, timeout=30) as http:
            began = time.perf_counter()
            answer = await http.post(target + "prefetch", json=body)
            if answer.status_code != 202:
                raise RuntimeError(f"directive refused: {answer.status_code} {answer.text}")
            status = await self._stopped(http, f"{target}prefetch/{directive}")
            seconds = time.perf_counter() - began
        if status["state"] != "complete":
            raise RuntimeError(f"directive ended {status['state']}: {status.get('detail')}")
        return seconds

    async def _stopped(self, http: httpx.AsyncClient, url: str) -> dict[str, object]:
        """The directive's status once it is no longer pending: a long poll, answered as the
        directive stops."""
        while True:
            status: dict[str, object] = (await http.get(f"{url}?wait_ms=10000")).json()
            if status["state"] != "pending":
                return status


class FiledCluster(DirectiveCluster):
    """The ``filed`` variant's cluster: control, relay, source and one target, all running the
    code of :data:`FILED_COMMIT` from ``tree`` with the flags that code took."""

    def start(self) -> None:
        """Start every process (control and relay first, the instances after)."""
        token, descriptor = self._files()
        control = self._start("control", "control").base_url
        relay = self._start("relay", "relay", "--index", control, "--token-file", str(token))
        faces = json.loads(relay.base_url)
        cert = self.folder / "relay" / "state" / "relay-tls" / "cert.pem"
        common: tuple[str, ...] = ("--control", control, "--token-file", str(token))
        common += ("--descriptor", str(descriptor), "--tier", "host=4GiB")
        common += ("--kv-capacity-blocks", "65536")
        common += ("--scope-key-file", str(self.folder / "scope.key"))
        relay_args = ("--relay", faces["moqt"], "--relay-cafile", str(cert))
        source = self._start("source", "instance", *common, *relay_args).base_url
        self.urls = {"control": control, "http": source, "moqt": faces["moqt"]}
        target = self._start(f"target-{FILED}", "instance", *common, "--relay-cafile", str(cert))
        self.urls[FILED] = target.base_url

    async def _put_all(self, keys: list[BlockKey]) -> None:
        """PUT a container for each of ``keys`` at the source with the bearer token itself
        (that code predates audience-bound credentials), 8 at a time."""
        base = f"{self.urls['http']}blocks/{self.compat.hex()}/{SCOPE.hex()}/"
        async with httpx.AsyncClient(headers=AUTH, timeout=30) as http:
            sem = asyncio.Semaphore(8)

            async def put(key: BlockKey) -> None:
                data = _container(self.descriptor, key)
                headers = {
                    "content-type": "application/kvsp-block",
                    "if-none-match": "*",
                    "repr-digest": repr_digest(hashlib.sha256(data).digest()),
                }
                async with sem:
                    answer = await http.put(base + key.hex(), content=data, headers=headers)
                if answer.status_code != 201:
                    raise RuntimeError(f"PUT refused: {answer.status_code} {answer.text}")

            await asyncio.gather(*(put(k) for k in keys))

    async def _stopped(self, http: httpx.AsyncClient, url: str) -> dict[str, object]:
        """The directive's status once it is no longer pending, polled (no long poll then)."""
        while True:
            status: dict[str, object] = (await http.get(url)).json()
            if status["state"] != "pending":
                return status
            await asyncio.sleep(FILED_POLL_S)


_clusters: dict[tuple[int, bool], DirectiveCluster] = {}
_filed: dict[str, Path | str] = {}


def filed_tree() -> Path:
    """:data:`FILED_COMMIT`'s tree, extracted from this clone's git history into a temporary
    folder (removed at exit) with its C extensions built in place; made once a process.

    Raises:
        RuntimeError: git or the commit is missing (a shallow clone, an archive), or the
            extensions did not build; the message says which (and again on later calls).
    """
    known = _filed.get("tree")
    if isinstance(known, Path):
        return known
    if known is None:
        folder = Path(tempfile.mkdtemp(prefix="kvsp-filed-"))
        atexit.register(shutil.rmtree, folder, True)
        try:
            known = _extract_filed(folder) or folder
        except (OSError, tarfile.TarError) as exc:
            known = f"{FILED_COMMIT[:7]} could not be extracted: {exc}"
        _filed["tree"] = known
    if isinstance(known, str):
        raise RuntimeError(known)
    return known


def _extract_filed(folder: Path) -> str | None:
    """Extract :data:`FILED_COMMIT` into ``folder`` and build its extensions; why not, if
    either failed."""
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "--format=tar", FILED_COMMIT],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        why = archive.stderr.decode(errors="replace").strip()
        return f"this clone has no commit {FILED_COMMIT[:7]}: {why}"
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(folder, filter="data")
    built = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=folder,
        capture_output=True,
        check=False,
    )
    if built.returncode != 0:
        return f"{FILED_COMMIT[:7]}'s C extensions did not build: {built.stderr[-500:]!r}"
    return None


def _stop_all() -> None:
    for cluster in _clusters.values():
        cluster.stop()
    _clusters.clear()


def cluster_for(block_bytes: int, *, filed: bool = False) -> DirectiveCluster:
    """The running cluster for ``block_bytes``, of this checkout or (``filed``) of
    :data:`FILED_COMMIT` (started on first use; stopped at exit).

    Raises:
        RuntimeError: the filed code is not at hand (:func:`filed_tree`).
    """
    cluster = _clusters.get((block_bytes, filed))
    if cluster is None:
        folder = Path(tempfile.mkdtemp(prefix=f"kvsp-directive-{block_bytes}-"))
        if filed:
            cluster = FiledCluster(block_bytes, folder, filed_tree())
        else:
            cluster = DirectiveCluster(block_bytes, folder)
        if not _clusters:
            atexit.register(_stop_all)
        _clusters[block_bytes, filed] = cluster
        try:
            cluster.start()
        except BaseException:
            cluster.stop()
            del _clusters[block_bytes, filed]
            raise
    return cluster


async def measure_directive(
    block_bytes: int,
    blocks: int,
    *,
    pipeline: bool = True,
    transport: str,
    variant: str | None = None,
) -> float:
    """Blocks per second of one directive for ``blocks`` new blocks of ``block_bytes``, from
    the POST to the state ``complete``, at ``variant``'s target (:data:`VARIANTS`, or
    :data:`FILED`; by default ``after`` with ``pipeline`` and ``before`` without), from the
    source instance over HTTP (``transport="http"``) or from the relay over MOQT (``"moqt"``).

    Raises:
        ValueError: an unknown transport or variant, or a block size :func:`descriptor_for`
            cannot make.
        RuntimeError: a process did not start, the directive did not complete, or (``filed``)
            this clone lacks :data:`FILED_COMMIT`.
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
    variant = variant or ("after" if pipeline else "before")
    if variant not in VARIANTS and variant != FILED:
        raise ValueError(f"variant must be one of {(*VARIANTS, FILED)}, got {variant!r}")
    cluster = await asyncio.to_thread(cluster_for, block_bytes, filed=variant == FILED)
    keys = await cluster.store_blocks(blocks)
    seconds = await cluster.run_directive(keys, variant=variant, transport=transport)
    return blocks / seconds


async def _table(sizes: list[tuple[int, int]], reps: int) -> tuple[list[list[str]], list[str]]:
    """The rows (median rate of each variant, and its ratio to ``before`` and ``filed``) and
    a note for each variant that could not run."""
    rows = []
    notes: list[str] = []  # the filed code's failure: it is not tried again
    for block_bytes, blocks in sizes:
        for transport in TRANSPORTS:
            variants = ("before", "after") if transport == "http" else tuple(VARIANTS)[::-1]
            variants += (FILED,)
            rates: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(reps):
                for variant in variants:
                    if variant == FILED and notes:
                        continue
                    try:
                        rate = await measure_directive(
                            block_bytes, blocks, transport=transport, variant=variant
                        )
                    except RuntimeError as exc:
                        if variant != FILED:
                            raise
                        notes.append(f"{FILED}: not run: {exc}")
                        continue
                    rates[variant].append(rate)
            medians = {v: statistics.median(r) for v, r in rates.items() if r}
            mb = block_bytes / 1e6
            for variant, rate in medians.items():
                rows.append(
                    [
                        f"{block_bytes // 1024} KiB",
                        str(blocks),
                        transport.upper(),
                        variant,
                        f"{rate:.0f}",
                        f"{rate * mb:.1f}",
                        f"{rate / medians['before']:.1f}",
                        f"{rate / medians[FILED]:.1f}" if FILED in medians else "-",
                    ]
                )
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    """Print the table: blocks/s and MB/s per block size, transport and variant."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one run each, fewer 2 MiB blocks")
    parser.add_argument("--blocks", type=int, default=64, help="blocks per 64 KiB directive")
    parser.add_argument("--reps", type=int, default=3, help="runs per cell (median)")
    args = parser.parse_args(argv)
    reps = 1 if args.quick else args.reps
    sizes = [(64 * 1024, args.blocks), (2 << 20, 16 if args.quick else args.blocks)]
    try:
        rows, notes = asyncio.run(_table(sizes, reps))
    finally:
        _stop_all()
    head = ["block", "blocks", "transport", "variant", "blocks/s", "MB/s", "x before", "x filed"]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    for row in [head, *rows]:
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)))
    for note in notes:
        print(note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
