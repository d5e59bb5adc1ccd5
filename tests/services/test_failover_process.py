"""§6.8 acceptance among real processes on 127.0.0.1: ``kvsp serve control`` (IS + PC), a
standalone ``kvsp serve holder`` that keeps replicas of session blocks, and three ``kvsp serve
instance --engine toy`` with short status TTLs, driven by the front-end library.

* **Chaos**: 20 generations (greedy and seeded top-p, alternately), each with its serving
  instance SIGKILLed when the caller has seen a random output index, half of them at an index
  where a checkpoint is due (a block completes or the cadence falls), half between; killed
  instances are restarted at their old address in the background. The caller's stream equals
  the uninterrupted run token for token, every index exactly once.
* **Zombie**: the serving instance is SIGSTOPped mid-generation; the PC moves the session, the
  caller follows; the instance, SIGCONTed, has its stale-epoch checkpoint rejected by the PC and
  none of its tokens reach the caller.
* **Gate**: generations with an unseeded sampler (``deterministic: false``), killed mid-way;
  the instances' release logs and the PC's acknowledgement log (one monotonic clock) show no
  token released before a checkpoint covering it was acknowledged.
* ``kvsp generate`` prints the same tokens as the library.

The engine is the toy engine (deterministic integer arithmetic, seeded choices a pure function
of state, seed and step), paced at a few ms per decode round so that a kill lands mid-stream.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsp.compat import compat_id
from kvsp.engine.api import GREEDY, Sampling
from kvsp.engine.toy import ToyEngine, toy_descriptor
from kvsp.keys import scope_id
from kvsp.services.frontend import FrontEnd, FrontendConfig, Token
from kvsp.web.auth import principal_entry, write_principals
from tests.support import cluster as cluster_kit
from tests.support.polling import eventually

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

DESCRIPTOR = toy_descriptor(layers=2, kv_heads=2, head_dim=16, kv_dtype="fp16", block_tokens=8)
COMPAT = compat_id(DESCRIPTOR)
B = DESCRIPTOR.block_tokens
SCOPE_KEY = bytes(range(91, 123))
SCOPE = scope_id(SCOPE_KEY)
MAX_TOKENS = 40
CHECKPOINT_EVERY = 6
DECODE_MS = 10
GENERATIONS = 20
ATTEMPTS = 30
"""Generations tried to get GENERATIONS whose kill interrupted them (one that was released in
a single burst before the caller reached the kill index finished before it landed)."""
STATUS_TTL_MS = 500
INSTANCES = ("a", "b", "c", "d")
FRONTEND = FrontendConfig(stall_s=0.3, poll_s=0.03, poll_max_s=0.2, reattach_s=30)


@dataclass
class Failover:
    """The cluster and what the tests need around it."""

    cluster: Any
    folder: Path
    restarts: ThreadPoolExecutor
    pending: list[Future[None]] = field(default_factory=list)

    def frontend(self) -> FrontEnd:
        return FrontEnd(
            self.cluster.control,
            cluster_kit.CLIENT_TOKEN,
            scope_id=SCOPE,
            compat_id=COMPAT,
            block_tokens=B,
            scope_key=SCOPE_KEY,
            config=FRONTEND,
        )

    def restart_later(self, name: str) -> None:
        self.pending.append(self.restarts.submit(self.cluster.restart_instance, name))

    def settle_restarts(self, alive: int) -> None:
        """Wait for pending restarts while fewer than ``alive`` instances run, then until as
        many are active at the PC."""
        while self.pending and sum(self.cluster.alive(n) for n in INSTANCES) < alive:
            self.pending.pop(0).result(timeout=120)
        self.pending = [f for f in self.pending if not f.done()]

        def active() -> bool | None:
            rows = self.cluster.instances().values()
            return sum(row["state"] == "active" for row in rows) >= alive or None

        eventually(active, timeout=60, what=f"{alive} active instances at the PC")

    def events(self, name: str) -> list[dict[str, Any]]:
        path = self.folder / f"{name}.events"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def failover(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Failover]:
    folder = tmp_path_factory.mktemp("failover")
    write_principals(
        folder / "principals",
        [
            principal_entry("admin", cluster_kit.ADMIN_TOKEN, ["admin"], None),
            principal_entry("client", cluster_kit.CLIENT_TOKEN, ["client"], [SCOPE]),
        ],
    )
    (folder / "admin.token").write_text(cluster_kit.ADMIN_TOKEN + "\n")
    (folder / "descriptor.json").write_text(json.dumps(DESCRIPTOR.to_json()))
    (folder / "scope.key").write_text(SCOPE_KEY.hex())
    cluster = cluster_kit.Cluster(folder, httpx.Client(timeout=60))
    token = str(folder / "admin.token")
    descriptor = ("--descriptor", str(folder / "descriptor.json"))
    try:
        cluster._serve(
            "control",
            "control",
            *descriptor,
            *("--directive-token-file", token, "--status-sweep-ms", "50"),
            *("--failover-deadline-ms", "20000", "--session-log", str(folder / "pc.events")),
        )
        holder = ("--index", cluster.control, "--index-token-file", token, *descriptor)
        cluster._serve("holder", "holder", *holder)
        with ThreadPoolExecutor(len(INSTANCES)) as starting:
            started = [
                starting.submit(
                    cluster.start_instance,
                    name,
                    *("--status-ttl-ms", str(STATUS_TTL_MS), "--replica-holder", cluster.holder),
                    *("--toy-decode-ms", str(DECODE_MS)),
                    *("--checkpoint-every", str(CHECKPOINT_EVERY)),
                    *("--session-log", str(folder / f"{name}.events")),
                )
                for name in INSTANCES
            ]
            for future in started:
                future.result()
        cluster.settle(timeout=60)
    except BaseException:
        cluster.stop()
        cluster.http.close()
        raise
    with ThreadPoolExecutor(len(INSTANCES)) as restarts:
        state = Failover(cluster, folder, restarts)
        try:
            yield state
        finally:
            for future in state.pending:
                future.result(timeout=120)
            cluster.stop()
            cluster.http.close()


def reference(prompt: Sequence[int], count: int, sampling: Sampling) -> list[int]:
    """The uninterrupted run: a toy engine computing the prompt from scratch."""

    async def compute() -> list[int]:
        engine = ToyEngine(DESCRIPTOR)
        try:
            seq = await engine.prefill(list(prompt), [])
            tokens = [t async for t in seq.tokens(count, sampling)]
            await seq.release()
            return tokens
        finally:
            await engine.aclose()

    return asyncio.run(compute())


def sampler_json(sampling: Sampling) -> dict[str, Any]:
    return {"method": sampling.method, "params": dict(sampling.params), "seed": sampling.seed}


def completes_block(prompt_tokens: int, index: int) -> bool:
    """Whether output token ``index`` completes the KV of a block: the instance's checkpoint
    falls due as the caller sees it (§6.8 "whenever a block of generated tokens completes")."""
    return (prompt_tokens + index) % B == 0


def pick_kill(rng: random.Random, prompt_tokens: int, at_checkpoint: bool) -> int:
    """A random output index in the first half: one where a checkpoint falls due, or not."""
    candidates = [
        i for i in range(2, MAX_TOKENS // 2) if completes_block(prompt_tokens, i) == at_checkpoint
    ]
    return rng.choice(candidates)


@dataclass
class Generation:
    """What the caller got, whom it lost, and when (``time.monotonic``)."""

    delivered: list[Token]
    victim: str | None
    frontend: FrontEnd
    began: float
    stopped: float | None = None
    """When the victim was killed or frozen."""
    epoch: int = 0
    """The epoch of the token that triggered it."""
    moved: float | None = None
    """When the first token of a later epoch reached the caller."""


async def run_generation(
    fo: Failover,
    prompt: list[int],
    sampler: Mapping[str, Any],
    kill_at: int | None = None,
    freeze_at: int | None = None,
    count: int = MAX_TOKENS,
) -> Generation:
    """One generation through the front end; SIGKILL (restarting it later) or SIGSTOP the
    instance serving it when the caller sees index ``kill_at`` / ``freeze_at``."""
    async with fo.frontend() as fe:
        run = Generation([], None, fe, time.monotonic())
        async for token in fe.generate(prompt, count, sampler):
            run.delivered.append(token)
            if run.stopped is not None and run.moved is None and token.epoch > run.epoch:
                run.moved = time.monotonic()
            if run.victim is None and token.index in (kill_at, freeze_at) and fe.current:
                run.victim = fo.cluster.name_of(fe.current)
                run.stopped = time.monotonic()
                run.epoch = token.epoch
                if token.index == kill_at:
                    fo.cluster.kill(run.victim)
                    fo.restart_later(run.victim)
                else:
                    fo.cluster.freeze(run.victim)
    return run


def check_stream(
    delivered: Sequence[Token], expected: Sequence[int] | None, count: int = MAX_TOKENS
) -> None:
    assert [t.index for t in delivered] == list(range(count))  # no gap, no repeat
    if expected is not None:
        assert [t.token for t in delivered] == list(expected)
    epochs = [t.epoch for t in delivered]
    assert epochs == sorted(epochs)  # never an epoch lower than one seen


def test_chaos_every_caller_sees_the_uninterrupted_run(failover: Failover) -> None:
    rng = random.Random(6_8)
    began = time.monotonic()
    moves: list[float] = []
    kills_at_checkpoint = restarts = attempts = 0
    while len(moves) < GENERATIONS and attempts < ATTEMPTS:
        number = len(moves)
        attempts += 1
        failover.settle_restarts(alive=2)
        sampling = GREEDY if number % 2 == 0 else Sampling(**TOP_P, seed=number)
        prompt = [rng.randrange(30_000) for _ in range(rng.randrange(2 * B + 1, 4 * B + 4))]
        at_checkpoint = number % 4 < 2
        kill_at = pick_kill(rng, len(prompt), at_checkpoint)
        expected = reference(prompt, MAX_TOKENS, sampling)
        run = asyncio.run(run_generation(failover, prompt, sampler_json(sampling), kill_at))
        check_stream(run.delivered, expected)
        assert run.victim is not None
        # a session whose instance was declared failed before its first checkpoint (a
        # status that arrived late on a loaded machine) is started over, before any token
        restarts += run.frontend.stats.restarted
        killed = failover.cluster.url(run.victim)
        seen = run.delivered[kill_at]
        assert seen.instance == killed  # the instance serving the caller when it saw kill_at
        later = [t for t in run.delivered if t.epoch > seen.epoch]
        if later and run.stopped is not None and run.moved is not None:
            moves.append(run.moved - run.stopped)
            kills_at_checkpoint += at_checkpoint
            assert later[0].instance != killed  # the next epoch is served elsewhere
    elapsed = time.monotonic() - began
    moves.sort()
    print(
        f"chaos: {len(moves)} generations moved by a kill, of {attempts}, in {elapsed:.1f} s; "
        f"kill -> first token of the new epoch: median {moves[len(moves) // 2]:.2f} s, "
        f"max {moves[-1]:.2f} s; {restarts} started over before their first token"
    )
    assert len(moves) == GENERATIONS and kills_at_checkpoint == GENERATIONS // 2


TOP_P: dict[str, Any] = {"method": "top-p", "params": {"p": 0.9}}


def test_a_zombie_is_rejected_and_never_reaches_the_caller(failover: Failover) -> None:
    failover.settle_restarts(alive=3)
    prompt = [(17 * i + 3) % 30_000 for i in range(3 * B + 5)]
    count = 3 * MAX_TOKENS  # still generating when it thaws, whatever the first burst
    expected = reference(prompt, count, GREEDY)
    run = asyncio.run(
        run_generation(failover, prompt, sampler_json(GREEDY), freeze_at=9, count=count)
    )
    delivered, zombie, fe = run.delivered, run.victim, run.frontend
    assert zombie is not None
    zombie_url = failover.cluster.url(zombie)
    session = str(fe.stats.sessions[-1])
    try:
        check_stream(delivered, expected, count)
        from_zombie = [t.index for t in delivered if t.instance == zombie_url]
        assert from_zombie == list(range(len(from_zombie))) and len(from_zombie) >= 10
        assert all(t.epoch >= 2 for t in delivered[len(from_zombie) :])
    finally:
        failover.cluster.thaw(zombie)

    def rejected() -> list[dict[str, Any]] | None:
        found = [
            e
            for e in failover.events("pc")
            if e["event"] == "reject" and e["session"] == session and e["instance"] == zombie_url
        ]
        return found or None

    stale = eventually(rejected, timeout=20, what="the zombie's checkpoint rejected")
    assert {e["problem"] for e in stale} == {"kvsp-stale-epoch"} and {
        e["epoch"] for e in stale
    } == {1}
    # Nothing the zombie released after it was moved got to the caller: the caller's tokens
    # from it are those it delivered before the freeze.
    moves = [e for e in failover.events("pc") if e["event"] == "move" and e["session"] == session]
    assert moves and moves[0]["previous"] == zombie_url
    eventually(
        lambda: failover.cluster.row(zombie)["state"] == "active" or None,
        timeout=20,
        what="the zombie to re-register with a new epoch",
    )


def test_no_token_is_released_before_its_checkpoint_is_acknowledged(failover: Failover) -> None:
    rng = random.Random(21)
    sessions = []
    for _ in range(3):
        failover.settle_restarts(alive=2)
        prompt = [rng.randrange(30_000) for _ in range(2 * B + 3)]
        sampler = {**TOP_P, "deterministic": False}  # no seed: not reproducible
        kill_at = rng.randrange(3, MAX_TOKENS // 2)
        run = asyncio.run(run_generation(failover, prompt, sampler, kill_at=kill_at))
        check_stream(run.delivered, None)
        sessions.append(str(run.frontend.stats.sessions[-1]))
    acks: defaultdict[str, list[tuple[int, int]]] = defaultdict(list)
    for event in failover.events("pc"):
        if event["event"] == "ack":
            acks[event["session"]].append((event["t_ns"], event["output_offset"]))
    releases = [
        event
        for name in INSTANCES
        for event in failover.events(name)
        if event["event"] == "release" and event["session"] in sessions
    ]
    assert {r["session"] for r in releases} == set(sessions)
    for release in releases:
        covering = [t for t, offset in acks[release["session"]] if offset >= release["end"]]
        assert covering and min(covering) <= release["t_ns"], release


def test_kvsp_generate_prints_the_stream(failover: Failover) -> None:
    failover.settle_restarts(alive=1)
    prompt = [(29 * i + 1) % 30_000 for i in range(2 * B + 1)]
    expected = reference(prompt, 12, Sampling(**TOP_P, seed=3))
    folder = failover.folder
    client_token = folder / "client.token"
    client_token.write_text(cluster_kit.CLIENT_TOKEN + "\n")
    command = [
        *(sys.executable, "-m", "kvsp", "generate", "--pc", failover.cluster.control),
        *("--token-file", str(client_token), "--descriptor", str(folder / "descriptor.json")),
        *("--scope-key-file", str(folder / "scope.key"), "--max-tokens", "12"),
        *("--tokens", ",".join(map(str, prompt)), "--sampler", "top-p", "--p", "0.9"),
        *("--seed", "3"),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=os.environ)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert [line["token"] for line in lines] == expected
    assert [line["index"] for line in lines] == list(range(12))
    bad = subprocess.run(
        [*command[:-2], "--seed", "-1"], capture_output=True, text=True, timeout=120
    )
    assert bad.returncode == 1 and bad.stderr.startswith("kvsp: error:")
