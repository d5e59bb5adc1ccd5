"""Time to first token of the reference engine with 0 %, 50 % and 95 % of the prompt loaded
over HTTP from a real ``kvsp serve holder`` (verified by BlockClient, §6.7) against full
recompute, and the overlap ratio of layer-wise loading (DESIGN.md §6).

One run, one tiny seeded model (``init_model``), the engine in this process:

* ``recompute``: prefill the whole prompt, take the greedy first token;
* ``http+load``: GET the cached blocks with :class:`BlockClient` (16 in flight, each verified
  against its layer digests), copy them into pages, prefill the rest (load-then-compute);
* ``overlap``: :meth:`Engine.load_prefix` streams each block's body from the holder on a
  background thread, verifying and committing it layer by layer, while prefill runs; layer l
  of the new tokens waits only for layer l of the loaded pages. ``ratio`` = overlap ÷
  load-then-compute (below 1: the overlap paid).

Usage: ``.venv/bin/python bench/bench_ttft.py [--long] [--reps N]`` (``--long`` adds 16k and
32k tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch

from kvsp.compat import compat_id
from kvsp.container import Geometry, replica_digest
from kvsp.engine.checkpoint import descriptor_for, init_model
from kvsp.engine.engine import Engine, ExportedBlock
from kvsp.ids import BlockKey, ScopeId
from kvsp.records import ReplicaRecord
from kvsp.services.auth import principal_entry, write_principals
from kvsp.services.block_client import BlockClient
from kvsp.services.testing import RunningService, start_process

TOKEN = "bench-ttft-token-0123456789abcdefghijkl"
SCOPE = ScopeId(bytes(range(16)))
B = 64
CHUNK = 512
INFLIGHT = 16


def start_holder(folder: Path, descriptor_json: str) -> RunningService:
    principals = folder / "principals.toml"
    write_principals(principals, [principal_entry("bench", TOKEN, ["admin"], None)])
    descriptor = folder / "descriptor.json"
    descriptor.write_text(descriptor_json)
    argv = [sys.executable, "-m", "kvsp", "serve", "holder", "--listen", "127.0.0.1:0"]
    argv += ["--principals", str(principals), "--state", str(folder / "state")]
    argv += ["--descriptor", str(descriptor), "--tier", "host=2GiB"]
    return start_process(argv, workdir=folder)


class Bench:
    """The engine, the holder and the blocks stored there."""

    def __init__(self, model: Path, holder: RunningService, pages: int) -> None:
        self.engine = Engine(model, num_pages=pages, block_tokens=B, prefill_chunk=CHUNK)
        self.compat = compat_id(self.engine.descriptor)
        self.geometry = Geometry.from_descriptor(self.engine.descriptor)
        self.base = holder.base_url
        self.records: dict[bytes, ReplicaRecord] = {}

    def key(self, prompt_id: int, index: int) -> BlockKey:
        return BlockKey(prompt_id.to_bytes(16, "big") + index.to_bytes(16, "big"))

    async def store(self, prompt_id: int, blocks: list[ExportedBlock]) -> None:
        async with BlockClient(TOKEN) as client:
            for block in blocks:
                key = self.key(prompt_id, block.index)
                await client.put_block(self.base, self.compat, SCOPE, key, block.container)
                self.records[key] = ReplicaRecord(
                    block_key=key,
                    compat_id=self.compat,
                    scope_id=SCOPE,
                    holder=self.base,
                    codec=1,
                    size=len(block.container),
                    digest=replica_digest(block.layer_digests),
                    layer_digests=block.layer_digests,
                    residency=None,
                    ttl_ms=3_600_000,
                )

    def first_token(self, prompt: list[int], pages: list[int] | None) -> int:
        seq = self.engine.new_sequence()
        try:
            logits = self.engine.prefill(seq, prompt, loaded_prefix_pages=pages)
            return int(torch.argmax(logits))
        finally:
            self.engine.free(seq)

    def recompute(self, prompt: list[int]) -> tuple[float, int]:
        began = time.perf_counter()
        token = self.first_token(prompt, None)
        return time.perf_counter() - began, token

    def load_then_compute(self, prompt_id: int, prompt: list[int], n: int) -> tuple[float, int]:
        keys = [self.key(prompt_id, i) for i in range(n)]
        began = time.perf_counter()
        blocks = asyncio.run(self._fetch(keys))
        pages = [self.engine.import_block(block.encode()) for block in blocks]
        token = self.first_token(prompt, pages)
        return time.perf_counter() - began, token

    async def _fetch(self, keys: list[BlockKey]) -> list[object]:
        gate = asyncio.Semaphore(INFLIGHT)
        async with BlockClient(TOKEN) as client:

            async def one(key: BlockKey) -> object:
                async with gate:
                    record = self.records[key]
                    return await client.get_block(self.base, record, geometry=self.geometry)

            return list(await asyncio.gather(*(one(k) for k in keys)))

    def overlapped(self, prompt_id: int, prompt: list[int], n: int) -> tuple[float, int]:
        keys = [self.key(prompt_id, i) for i in range(n)]
        began = time.perf_counter()
        with httpx.Client(headers={"authorization": f"Bearer {TOKEN}"}, timeout=60) as http:
            sources = [self._stream(http, key) for key in keys]
            digests = [self.records[key].layer_digests for key in keys]
            load = self.engine.load_prefix(sources, digests)
            token = self.first_token(prompt, load.pages)
            load.join()
        if load.error is not None:
            raise load.error
        return time.perf_counter() - began, token

    def _stream(self, http: httpx.Client, key: BlockKey) -> Iterator[bytes]:
        url = f"{self.base}blocks/{self.compat.hex()}/{SCOPE.hex()}/{key.hex()}"
        with http.stream("GET", url) as answer:
            answer.raise_for_status()
            yield from answer.iter_raw(1 << 16)


def best(runs: list[tuple[float, int]]) -> tuple[float, int]:
    tokens = {t for _, t in runs}
    if len(tokens) != 1:
        raise SystemExit(f"first tokens differ between runs: {tokens}")
    return min(s for s, _ in runs), runs[0][1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="add 16k and 32k tokens")
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(2)
    lengths = [1024, 4096, 8192] + ([16384, 32768] if args.long else [])
    folder = Path(tempfile.mkdtemp(prefix="kvsp-ttft-"))
    model = init_model(
        folder / "model", seed=7, layers=4, hidden=128, heads=4, kv_heads=2, max_positions=32768
    )
    descriptor = descriptor_for(model, block_tokens=B)
    holder = start_holder(folder, json.dumps(descriptor.to_json()))
    try:
        bench = Bench(model, holder, pages=3 * max(lengths) // B + 8)
        g = Geometry.from_descriptor(descriptor)
        size = g.section_length(B) * 2 * g.layers
        print(
            f"model: {descriptor.layers} layers, {descriptor.kv_heads} kv heads x "
            f"{descriptor.head_dim}, fp32 KV, block {B} tokens = {size // 1024} KiB; "
            f"prefill chunk {CHUNK}; best of {args.reps}; torch threads 2"
        )
        header = f"{'tokens':>7} {'cached':>6} {'recompute':>10} {'http+load':>10} "
        header += f"{'overlap':>9} {'ratio':>6} {'speedup':>8}"
        print(header)
        rng = random.Random(1)
        for pid, length in enumerate(lengths):
            prompt = [rng.randrange(256) for _ in range(length)]
            blocks = bench.engine.export_prompt_blocks(prompt)
            asyncio.run(bench.store(pid, blocks))
            full, want = best([bench.recompute(prompt) for _ in range(args.reps)])
            for share in (0.0, 0.5, 0.95):
                n = int(length * share) // B
                loaded, t1 = best(
                    [bench.load_then_compute(pid, prompt, n) for _ in range(args.reps)]
                )
                lap, t2 = best([bench.overlapped(pid, prompt, n) for _ in range(args.reps)])
                if {t1, t2} != {want}:
                    raise SystemExit(f"{length}/{share}: first token {t1}/{t2}, recompute {want}")
                print(
                    f"{length:>7} {share:>6.0%} {full * 1e3:>8.1f}ms {loaded * 1e3:>8.1f}ms "
                    f"{lap * 1e3:>7.1f}ms {lap / loaded:>6.2f} {full / loaded:>7.2f}x"
                )
        print("moqt: n/a (MoqtBlockClient exists; a MOQT publisher is not wired into this bench)")
    finally:
        holder.stop()


if __name__ == "__main__":
    main()
