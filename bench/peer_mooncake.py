"""A Mooncake Store peer for ``bench/bench_moqt.py``: the Redis-like comparison row "Mooncake
Store ``get_into`` + SHA-256 over TCP" (what a Mooncake-backed KV connector does per block,
with the hash a KVSP client would add).

Runs under the separate virtual environment ``bench_moqt`` makes for ``mooncake-transfer-
engine`` (stdlib and ``mooncake`` only; it never imports kvsp). Two roles, each its own
process, both against a ``mooncake_master`` with its HTTP metadata server that the bench
started:

* ``holder``: mounts a memory segment, puts one block of each given size (random octets,
  their SHA-256 written to stdout as JSON), then keeps the segment until stdin closes;
* ``client``: mounts nothing, and for each size reads the block with ``get_into`` into a
  registered buffer and hashes it, blocks one after another for about ``--seconds``; prints
  ``{"<size>": MB/s, ...}`` as one JSON line.

Usage: ``python peer_mooncake.py holder|client --master H:P --metadata URL --sizes N,M
[--seconds S] [--digests JSON]``.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import os
import sys
import time
from typing import Any


def _store(args: argparse.Namespace, segment: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    code = store.setup(
        "127.0.0.1",
        args.metadata,
        segment,
        256 << 20,
        "tcp",
        "",
        args.master,
    )
    if code != 0:
        raise SystemExit(f"mooncake setup failed: {code}")
    return store


def holder(args: argparse.Namespace, sizes: list[int]) -> None:
    store = _store(args, 1 << 30)
    digests = {}
    for size in sizes:
        data = os.urandom(size)
        code = store.put(f"kvsp-bench-{size}", data)
        if code != 0:
            raise SystemExit(f"mooncake put failed: {code}")
        digests[str(size)] = hashlib.sha256(data).hexdigest()
    print(json.dumps(digests), flush=True)
    sys.stdin.read()
    store.close()


def client(args: argparse.Namespace, sizes: list[int]) -> None:
    store = _store(args, 16 << 20)
    digests = json.loads(args.digests)
    rates = {}
    for size in sizes:
        buffer = bytearray(size)
        pointer = ctypes.addressof((ctypes.c_char * size).from_buffer(buffer))
        if store.register_buffer(pointer, size) != 0:
            raise SystemExit("mooncake register_buffer failed")
        key = f"kvsp-bench-{size}"
        view = memoryview(buffer)
        count, started = 0, time.perf_counter()
        while count < 8 or time.perf_counter() - started < args.seconds:
            got = store.get_into(key, pointer, size)
            if got != size or hashlib.sha256(view).hexdigest() != digests[str(size)]:
                raise SystemExit(f"mooncake get_into gave {got} octets or a wrong digest")
            count += 1
        rates[str(size)] = count * size / (time.perf_counter() - started) / 1e6
        store.unregister_buffer(pointer)
    print(json.dumps(rates), flush=True)
    store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", choices=("holder", "client"))
    parser.add_argument("--master", required=True)
    parser.add_argument("--metadata", required=True)
    parser.add_argument("--sizes", required=True)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--digests", default="{}")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    (holder if args.role == "holder" else client)(args, sizes)


if __name__ == "__main__":
    main()
