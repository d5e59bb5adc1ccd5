"""Sessions at the instance (§6.8), in-process over the toy engine: the first checkpoint before
the first token, the non-deterministic release gate checked against the acknowledgements, a
stale-epoch answer stopping the session, resume continuing the uninterrupted run token for
token (with generated blocks loaded or recomputed), and the HTTP face of it. The PC is a small
recording fake whose answers the tests hold back or refuse."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from kvsp.compat import compat_id
from kvsp.engine.api import GREEDY, Sampling
from kvsp.engine.toy import ToyEngine, toy_descriptor
from kvsp.errors import (
    BadRequest,
    Incompatible,
    KVSPError,
    NotFound,
    StaleEpoch,
)
from kvsp.keys import block_keys, scope_id
from kvsp.records import (
    InstanceStatusRecord,
    LookupRequest,
    LookupResponse,
    ReplicaRecord,
    ResumeRequest,
    SessionCheckpoint,
    StateAnswer,
)
from kvsp.services.holder.service import Holder, HolderConfig
from kvsp.services.instance.app import create_instance_app
from kvsp.services.instance.requests import read_sampling
from kvsp.services.instance.service import InstanceAgent, InstanceConfig
from kvsp.services.instance.sessions import InstanceSessions, LiveSession, LiveState, SessionConfig
from kvsp.services.pc.client import SessionView
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.transfer.block_client import BlockClient
from kvsp.web.auth import Principals, principal_entry
from kvsp.web.clock import ManualClock
from tests.support.polling import until

T = TypeVar("T")
DESCRIPTOR = toy_descriptor(layers=2, kv_heads=2, head_dim=8, kv_dtype="fp16", block_tokens=4)
COMPAT = compat_id(DESCRIPTOR)
B = DESCRIPTOR.block_tokens
SCOPE_KEY = bytes(range(7, 39))
SCOPE = scope_id(SCOPE_KEY)
URL = "http://ii.test/"
TOKEN = "sessions-test-token-0123456789abcdefghij"
PROMPT = [(31 * i + 5) % 30_000 for i in range(3 * B + 2)]
TOP_P = Sampling(method="top-p", params={"p": 0.9}, seed=7)


class FakeControl:
    """The IS and the PC's status face in memory: no replicas, every status accepted."""

    def __init__(self) -> None:
        self.stale_status = False

    async def put_status(self, record: InstanceStatusRecord, /) -> StateAnswer:
        if self.stale_status:
            self.stale_status = False
            raise StaleEpoch("your record expired")
        return StateAnswer(state=record.state)

    async def lookup(self, request: LookupRequest, /) -> LookupResponse:
        return LookupResponse(matched=0, replicas=())

    async def publish(self, record: ReplicaRecord, /) -> int:
        return record.ttl_ms

    async def publish_batch(self, records: Sequence[ReplicaRecord], /) -> list[Any]:
        return [record.ttl_ms for record in records]

    async def withdraw(self, compat: bytes, scope: bytes, key: bytes, holder: str, /) -> bool:
        return True


class FakePC:
    """The PC's checkpoint resource: keeps what it acknowledged, with the time it did, and
    answers only while ``open`` is set; ``refuse`` makes it answer with that error."""

    def __init__(self) -> None:
        self.acks: list[tuple[float, SessionCheckpoint]] = []
        self.open = asyncio.Event()
        self.open.set()
        self.refuse: KVSPError | None = None

    async def put_checkpoint(self, checkpoint: SessionCheckpoint, /) -> SessionView:
        await self.open.wait()
        if self.refuse is not None:
            raise self.refuse
        self.acks.append((time.monotonic(), checkpoint))
        return SessionView(
            session=checkpoint.session,
            instance=None,
            epoch=checkpoint.epoch,
            state="serving",
            output_offset=checkpoint.output_offset,
        )

    def offsets(self) -> list[int]:
        return [cp.output_offset for _, cp in self.acks]


@dataclass
class Env:
    agent: InstanceAgent
    sessions: InstanceSessions
    pc: FakePC
    control: FakeControl
    http: httpx.AsyncClient


@contextlib.asynccontextmanager
async def environment(tmp_path: Path, name: str = "a", **config: Any) -> AsyncIterator[Env]:
    clock = ManualClock(1_000_000)
    control = FakeControl()
    engine = ToyEngine(DESCRIPTOR, decode_delay_s=config.pop("delay", 0.002))
    registry = DescriptorRegistry()
    registry.add(DESCRIPTOR, persist=False)
    holder = Holder(HolderConfig(), index=control, descriptors=registry, clock=clock)
    blocks = BlockClient(TOKEN)
    settings = InstanceConfig(
        public_url=URL,
        status_loop=False,
        state_dir=tmp_path / name,
        scope_keys={SCOPE: SCOPE_KEY},
        warmup_tokens=8,
    )
    agent = InstanceAgent(engine, holder, control, blocks, control, clock, settings)
    pc = FakePC()
    sessions = InstanceSessions(agent, pc, SessionConfig(keep_finished_s=5, **config))
    principals = Principals.from_entries(
        [
            principal_entry("pc", "pc-" + TOKEN, ["pc"], None),
            principal_entry("client", "client-" + TOKEN, ["client"], [SCOPE]),
        ]
    )
    app = create_instance_app(agent, principals, clock, descriptors=registry, sessions=sessions)
    await agent.start()
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    try:
        async with httpx.AsyncClient(transport=transport, base_url=URL) as http:
            yield Env(agent, sessions, pc, control, http)
    finally:
        await sessions.close()
        await agent.close()
        await blocks.aclose()
        await engine.aclose()


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


async def reference(count: int, sampling: Sampling = GREEDY) -> tuple[list[int], list[bytes]]:
    """Tokens of the uninterrupted run and the containers of every complete block of it."""
    engine = ToyEngine(DESCRIPTOR)
    try:
        seq = await engine.prefill(PROMPT, [])
        tokens = [t async for t in seq.tokens(count, sampling)]
        complete = (len(PROMPT) + count - 1) // B
        return tokens, [await seq.block(i) for i in range(complete)]
    finally:
        await engine.aclose()


async def open_session(
    env: Env, count: int, sampling: Sampling = GREEDY, deterministic: bool = True
) -> LiveSession:
    live, _ = await env.sessions.open(
        uuid.uuid4(), PROMPT, count, SCOPE, SCOPE_KEY, sampling, deterministic
    )
    return live


async def drain(live: LiveSession, start: int = 0) -> list[tuple[int, int]]:
    return [pair async for pair in live.stream(start)]


# --- checkpoints and the release gate --------------------------------------------------------


def test_no_token_before_the_first_checkpoint_then_every_token(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with environment(tmp_path, checkpoint_every=5) as env:
            env.pc.open.clear()  # the PC holds its answer
            live = await open_session(env, 20)
            await until(lambda: len(live.tokens) >= 6)
            assert live.released == 0 and live.confirmed is False
            env.pc.open.set()
            pairs = await drain(live)
            expected, _ = await reference(20)
            assert pairs == list(enumerate(expected))
            offsets = env.pc.offsets()
            assert offsets[0] >= 1 and offsets[-1] == 20 and offsets == sorted(set(offsets))
            for _, cp in env.pc.acks:
                assert cp.generated == tuple(expected[: cp.output_offset])
                assert (cp.instance, cp.max_tokens, cp.epoch) == (URL, 20, 1)
                assert cp.sampler.step == cp.output_offset and cp.sampler.deterministic
            await until(lambda: live.state is LiveState.FINISHED)

    run(scenario())


def test_generated_blocks_are_kept_and_published_as_they_complete(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with environment(tmp_path) as env:
            live = await open_session(env, 23)
            tokens = [token for _, token in await drain(live)]
            await until(lambda: live.state is LiveState.FINISHED)
            # KV exists for the prompt (14) and 22 output tokens: 9 blocks, 3 of the prompt.
            keys = block_keys(SCOPE_KEY, COMPAT, PROMPT + tokens[:22], B)
            assert len(keys) == 9 and tuple(keys[:3]) == live.prompt_blocks
            _, containers = await reference(23)
            held = env.agent.engine.lookup(keys)
            assert [c.encode() for c in held] == containers
            await until(lambda: all(env.agent.holds(_ref(k)) for k in keys))

    run(scenario())


def _ref(key: bytes) -> Any:
    from kvsp.stores.blocks import BlockRef

    return BlockRef(COMPAT, SCOPE, key)


def test_the_gate_releases_no_token_before_its_checkpoint_is_acknowledged(
    tmp_path: Path,
) -> None:
    log = tmp_path / "releases.log"

    async def scenario() -> None:
        async with environment(tmp_path, log=log, gate_batch=3, delay=0.004) as env:
            live = await open_session(env, 30, Sampling(method="top-p", params={"p": 0.9}), False)
            assert live.deterministic is False
            seen: list[tuple[float, int]] = []
            async for index, _ in live.stream(0):
                seen.append((time.monotonic(), index))
            assert [i for _, i in seen] == list(range(30))
            for when, index in seen:  # each token was acknowledged before the reader got it
                assert any(t <= when and cp.output_offset > index for t, cp in env.pc.acks)
            final = env.pc.acks[-1][1]
            assert final.output_offset == 30 and list(final.generated) == live.tokens

    run(scenario())
    releases = [json.loads(line) for line in log.read_text().splitlines()]
    assert releases and all(r["event"] == "release" for r in releases)
    assert releases[0]["start"] == 0 and releases[-1]["end"] == 30
    assert all(a["end"] == b["start"] for a, b in zip(releases, releases[1:], strict=False))


def test_a_stale_answer_stops_the_session_and_ends_its_readers(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with environment(tmp_path, checkpoint_every=4, delay=0.01) as env:
            live = await open_session(env, 200)
            await until(lambda: live.released >= 5)
            env.pc.refuse = StaleEpoch("session epoch is 2")
            with pytest.raises(StaleEpoch):
                await drain(live)
            assert live.state is LiveState.SUPERSEDED
            released, generated = live.released, len(live.tokens)
            await asyncio.sleep(0.1)
            assert (live.released, len(live.tokens)) == (released, generated)  # stopped
            assert generated < 200

    run(scenario())


def test_a_declared_failure_makes_every_session_ask_the_pc_at_once(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with environment(tmp_path, checkpoint_every=1000, delay=0.01) as env:
            live = await open_session(env, 500)
            await until(lambda: live.confirmed)
            before = len(env.pc.acks)
            env.pc.refuse = StaleEpoch("moved")
            env.control.stale_status = True
            await env.agent.report_status()  # the PC says this instance was declared failed
            await until(lambda: live.state is LiveState.SUPERSEDED)
            assert len(env.pc.acks) == before and len(live.tokens) < 500

    run(scenario())


# --- resume ------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", [Sampling(), TOP_P], ids=["greedy", "top-p"])
@pytest.mark.parametrize("generated_held", [True, False], ids=["blocks", "recompute"])
def test_resume_continues_the_uninterrupted_run(
    tmp_path: Path, sampling: Sampling, generated_held: bool
) -> None:
    count, offset = 24, 13

    async def scenario() -> None:
        expected, containers = await reference(count, sampling)
        async with environment(tmp_path, "b") as env:
            keys = block_keys(SCOPE_KEY, COMPAT, PROMPT + expected, B)
            held = 3 + (3 if generated_held else 0)  # KV of 14 + 12 tokens: 6 whole blocks
            for key, data in zip(keys[:held], containers, strict=False):
                env.agent.keep_block(SCOPE, key, data)
            cp = checkpoint_of(expected, offset, sampling)
            outcome = await env.sessions.resume(ResumeRequest(epoch=2, checkpoint=cp))
            assert (outcome.prompt_blocks, outcome.epoch) == (3, 2)
            assert outcome.generated_blocks == (3 if generated_held else 0)
            # recomputed: from the end of the loaded blocks to the last output token
            assert outcome.recomputed_tokens == 14 + offset - 4 * (3 + outcome.generated_blocks)
            live = env.sessions.get(cp.session)
            pairs = await drain(live)
            assert pairs == list(enumerate(expected))  # indices below 13 from the checkpoint
            assert live.epoch == 2
            assert {cp.epoch for _, cp in env.pc.acks} == {2}
            assert env.pc.offsets()[-1] == count

    run(scenario())


def checkpoint_of(tokens: Sequence[int], offset: int, sampling: Sampling) -> SessionCheckpoint:
    from kvsp.records import Sampler

    return SessionCheckpoint(
        session=uuid.uuid4(),
        epoch=1,
        compat_id=COMPAT,
        scope_id=SCOPE,
        prompt_blocks=tuple(block_keys(SCOPE_KEY, COMPAT, PROMPT, B)),
        prompt_tail=tuple(PROMPT[3 * B :]),
        generated=tuple(tokens[:offset]),
        output_offset=offset,
        sampler=Sampler(
            method=sampling.method,
            params=dict(sampling.params),
            seed=sampling.seed,
            step=offset,
            deterministic=True,
        ),
        instance="http://ii-old.test/",
        max_tokens=len(tokens),
    )


def test_resume_refuses_what_it_cannot_continue(tmp_path: Path) -> None:
    async def scenario() -> None:
        expected, containers = await reference(10)
        async with environment(tmp_path) as env:
            cp = checkpoint_of(expected, 5, Sampling())
            with pytest.raises(NotFound):  # no holder has the prompt's blocks
                await env.sessions.resume(ResumeRequest(epoch=2, checkpoint=cp))
            with pytest.raises(BadRequest):
                await env.sessions.resume(
                    ResumeRequest(epoch=2, checkpoint=replace(cp, max_tokens=None))
                )
            with pytest.raises(Incompatible):
                await env.sessions.resume(
                    ResumeRequest(epoch=2, checkpoint=replace(cp, compat_id=bytes(32)))
                )
            for key, data in zip(
                block_keys(SCOPE_KEY, COMPAT, PROMPT, B), containers, strict=False
            ):
                env.agent.keep_block(SCOPE, key, data)
            await env.sessions.resume(ResumeRequest(epoch=3, checkpoint=cp))
            with pytest.raises(StaleEpoch):  # it serves the session at epoch 3 already
                await env.sessions.resume(ResumeRequest(epoch=3, checkpoint=cp))
            assert [t for _, t in await drain(env.sessions.get(cp.session))] == expected

    run(scenario())


# --- the HTTP face ----------------------------------------------------------------------------


def test_generate_with_a_session_and_reattach_from_an_index(tmp_path: Path) -> None:
    client = {"authorization": f"Bearer client-{TOKEN}"}

    async def scenario() -> None:
        async with environment(tmp_path) as env:
            session = str(uuid.uuid4())
            body = {
                "prompt": PROMPT,
                "max_tokens": 12,
                "session": session,
                "sampler": {"method": "top-p", "params": {"p": 0.9}, "seed": 7},
            }
            answer = await env.http.post("generate", json=body, headers=client)
            assert answer.status_code == 200, answer.text
            lines = [json.loads(line) for line in answer.text.splitlines()]
            expected, _ = await reference(12, TOP_P)
            assert lines == [{"index": i, "epoch": 1, "token": t} for i, t in enumerate(expected)]
            again = await env.http.get(f"sessions/{session}/tokens?from=9", headers=client)
            assert [json.loads(x)["index"] for x in again.text.splitlines()] == [9, 10, 11]
            view = await env.http.get(f"sessions/{session}", headers=client)
            assert view.json()["released"] == 12 and view.json()["deterministic"] is True
            for bad in ("-1", "x", "01"):
                refused = await env.http.get(
                    f"sessions/{session}/tokens?from={bad}", headers=client
                )
                assert refused.status_code == 400 and refused.json()["path"] == "from"
            missing = await env.http.get(f"sessions/{uuid.uuid4()}/tokens", headers=client)
            assert missing.status_code == 404
            duplicate = await env.http.post("generate", json=body, headers=client)
            assert duplicate.status_code == 409
            resume = {"epoch": 2, "checkpoint": checkpoint_of(expected, 3, Sampling()).to_json()}
            as_client = await env.http.post(
                f"sessions/{session}/resume", json=resume, headers=client
            )
            assert as_client.status_code == 403  # only the PC resumes sessions
            pc = {"authorization": f"Bearer pc-{TOKEN}"}
            mismatch = await env.http.post(f"sessions/{session}/resume", json=resume, headers=pc)
            assert mismatch.status_code == 400  # the path names another session
            bad_sampler = {**body, "session": str(uuid.uuid4()), "sampler": {"method": "top-p"}}
            refused = await env.http.post("generate", json=bad_sampler, headers=client)
            assert refused.status_code == 400 and refused.json()["path"] == "$.sampler.params.p"

    run(scenario())


def test_sampler_members_and_the_deterministic_claim() -> None:
    assert read_sampling({"method": "greedy"}) == (Sampling(), True)
    seeded, deterministic = read_sampling({"method": "top-k", "params": {"k": 5}, "seed": 3})
    assert deterministic and seeded.seed == 3
    unseeded, deterministic = read_sampling({"method": "temperature", "params": {"temperature": 1}})
    assert deterministic is False and unseeded.reproducible is False
    assert read_sampling({"method": "greedy", "deterministic": False})[1] is False
    with pytest.raises(KVSPError) as claim:
        read_sampling({"method": "top-p", "params": {"p": 0.5}, "deterministic": True})
    assert claim.value.path == "$.sampler.deterministic"
    with pytest.raises(KVSPError) as unknown:
        read_sampling({"method": "beam"})
    assert unknown.value.path == "$.sampler.method"
