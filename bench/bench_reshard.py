"""Benchmark resharding (§6.9) through ``kvsp serve control`` and ``kvsp serve instance``: what
keeping retained ranges in place saves, side by side with a change that moves everything.

Run by hand: ``.venv/bin/python bench/bench_reshard.py`` (about a minute on 2 cores).

A ``--tokens`` context (65,536) with geometry ``--layers`` × ``--kv-heads`` × ``--head-dim``
fp16 (4 × 2 × 64: 2 KiB a token, 128 MiB in all) starts as thirds on instances a, b, c. Each
round then makes two changes of the same shape, one after the other:

* **retain**: thirds on a, b, c → halves on a, b. a keeps [0, 1/3), b keeps [1/2, 2/3); only
  the tokens that change owner move (1/2 of the context);
* **move-all**: halves on a, b → halves on d, e. No instance is in both versions, so every
  token moves: what a reshard without ``retain`` would transfer;

and a reset (halves on d, e → thirds on a, b, c, moving everything again, not reported).
Reported per kind: the median wall time of ``POST shardmaps/{map}/versions`` (plans, fetches,
acknowledgements, commit), the octets the instances fetched (from their counters), the rate,
and the ratios retain / move-all.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from kvsp.container import Geometry
from kvsp.engine.shards import container_parts, seeded_kv, token_bytes
from kvsp.engine.toy import toy_descriptor
from kvsp.web.auth import principal_entry, write_principals
from kvsp.web.testing import RunningService, start_process

TOKEN = "bench-reshard-admin-token-0123456789abcdef"
MAP = "bench"


def serve(folder: Path, name: str, service: str, *argv: str) -> RunningService:
    work = folder / name
    work.mkdir()
    command = [
        *(sys.executable, "-m", "kvsp", "serve", service, "--listen", "127.0.0.1:0"),
        *("--state", str(work / "state"), "--principals", str(folder / "principals")),
        *argv,
    ]
    return start_process(command, workdir=work, ready_timeout=120)


def layout(urls: dict[str, str], names: str, tokens: int) -> list[dict[str, Any]]:
    cuts = [tokens * i // len(names) for i in range(len(names) + 1)]
    return [
        {"tokens": [a, b], "instance": urls[n]}
        for n, a, b in zip(names, cuts, cuts[1:], strict=False)
    ]


def fetched(http: httpx.Client, urls: dict[str, str]) -> int:
    return sum(http.get(u + "shards").json()["fetched_bytes"] for u in urls.values())


def change(
    http: httpx.Client, control: str, urls: dict[str, str], version: int, shards: list[Any]
) -> tuple[float, int]:
    before = fetched(http, urls)
    started = time.perf_counter()
    answer = http.post(
        control + f"shardmaps/{MAP}/versions",
        json={"from": version, "shards": shards, "deadline_ms": 600_000},
    )
    elapsed = time.perf_counter() - started
    if answer.status_code != 200:
        raise SystemExit(f"version {version + 1} failed: {answer.status_code} {answer.text}")
    return elapsed, fetched(http, urls) - before


def report(kind: str, runs: Sequence[tuple[float, int]]) -> tuple[float, int]:
    seconds = statistics.median(s for s, _ in runs)
    octets = runs[0][1]
    rate = octets / seconds / 1e6
    print(f"{kind:9} {seconds * 1000:9.0f} ms {octets / 2**20:9.1f} MiB {rate:8.0f} MB/s")
    return seconds, octets


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=65_536)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    descriptor = toy_descriptor(
        layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, kv_dtype="fp16"
    )
    geometry = Geometry.from_descriptor(descriptor)
    with tempfile.TemporaryDirectory(prefix="kvsp-bench-reshard-") as tmp:
        folder = Path(tmp)
        write_principals(folder / "principals", [principal_entry("admin", TOKEN, ["admin"], None)])
        (folder / "admin.token").write_text(TOKEN + "\n")
        (folder / "descriptor.json").write_text(json.dumps(descriptor.to_json()))
        described = ("--descriptor", str(folder / "descriptor.json"))
        token = ("--token-file", str(folder / "admin.token"))
        services: list[RunningService] = []
        try:
            control = serve(
                folder, "control", "control", *described, "--directive-token-file", token[1]
            )
            services.append(control)
            instance = ("--pc", control.base_url, *token, "--engine", "toy", *described)
            with ThreadPoolExecutor(5) as pool:
                services += pool.map(lambda n: serve(folder, n, "instance", *instance), "abcde")
            urls = dict(zip("abcde", (s.base_url for s in services[1:]), strict=True))
            auth = {"authorization": f"Bearer {TOKEN}"}
            with httpx.Client(timeout=600, headers=auth) as http:
                run(http, control.base_url, urls, geometry, args)
        finally:
            for service in reversed(services):
                service.stop()
    return 0


def run(
    http: httpx.Client,
    control: str,
    urls: dict[str, str],
    geometry: Geometry,
    args: argparse.Namespace,
) -> None:
    tokens = args.tokens
    kv = seeded_kv(geometry, 0, tokens, 1)
    for shard in layout(urls, "abc", tokens):
        a, b = shard["tokens"]
        body = b"".join(bytes(p) for p in container_parts(kv[:, :, a:b], geometry))
        put = http.put(shard["instance"] + f"shards/{MAP}/{a}-{b}?version=1", content=body)
        if put.status_code != 204:
            raise SystemExit(f"loading version 1 failed: {put.text}")
    http.post(control + "shardmaps", json={"map": MAP, "shards": layout(urls, "abc", tokens)})
    print(
        f"context: {tokens} tokens x {token_bytes(geometry)} octets = "
        f"{tokens * token_bytes(geometry) / 2**20:.0f} MiB; {args.rounds} rounds; median of each"
    )
    retain, move_all = [], []
    version = 1
    for _ in range(args.rounds):
        retain.append(change(http, control, urls, version, layout(urls, "ab", tokens)))
        move_all.append(change(http, control, urls, version + 1, layout(urls, "de", tokens)))
        change(http, control, urls, version + 2, layout(urls, "abc", tokens))
        version += 3
    print(f"{'kind':9} {'time':>12} {'fetched':>13} {'rate':>13}")
    r_s, r_b = report("retain", retain)
    m_s, m_b = report("move-all", move_all)
    print(f"retain / move-all: time {r_s / m_s:.2f}, octets {r_b / m_b:.2f}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
