"""The Placement Controller's decisions (§6.3–6.5), driven in-process: a real IndexService over
a MemoryStore (as in ``kvsp serve control``), a ManualClock, and small recording peers in
place of instances. Real scale-up hooks: a script, and a URL served on 127.0.0.1."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import threading
import uuid
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar

import pytest

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.errors import (
    BadRequest,
    Conflict,
    IllegalTransition,
    Incompatible,
    NotFound,
    StaleEpoch,
    TransportError,
    UpstreamError,
)
from kvsp.ids import BlockKey, CompatId, ScopeId
from kvsp.index import IndexService
from kvsp.lifecycle import InstanceRegistry, SleepPolicy
from kvsp.placement_plan import DirectiveOptions, ObservedServiceTimes
from kvsp.records import (
    InstanceStatusRecord,
    Link,
    PlaceRequest,
    PrefetchDirective,
    ReplicaRecord,
)
from kvsp.registries import InstanceState
from kvsp.services.control import LocalIndex
from kvsp.services.pc.app import CommandHook, UrlHook, scale_up_hook
from kvsp.services.pc.service import (
    NoInstance,
    PCConfig,
    PlacementController,
    ScaleUpHook,
)
from kvsp.stores.descriptors import DescriptorRegistry
from kvsp.stores.memory import MemoryStore
from kvsp.web.clock import ManualClock

T = TypeVar("T")
SCOPE = ScopeId(b"\x0a" * 16)
DESCRIPTOR = CompatibilityDescriptor(
    model="m",
    model_digest=b"\xa1" * 32,
    tokenizer_digest=b"\xb2" * 32,
    layers=4,
    kv_heads=2,
    head_dim=8,
    kv_dtype="bf16",
    positional="rope",
    block_tokens=16,
)
COMPAT = compat_id(DESCRIPTOR)
H1, H2 = "https://h1.example/kvsp/", "https://h2.example/kvsp/"
A, B = "https://ii-a.example/kvsp/", "https://ii-b.example/kvsp/"
NEW = "https://ii-new.example/kvsp/"
BLOCK = 1_000_000  # octets per block
PREFILL = 10_000.0  # tokens/s: 100 µs per token
ACTIVE, DRAINING, SLEEPING, FAILED = (
    InstanceState.ACTIVE,
    InstanceState.DRAINING,
    InstanceState.SLEEPING,
    InstanceState.FAILED,
)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def key(i: int) -> BlockKey:
    return BlockKey(hashlib.sha256(b"pc-key%d" % i).digest())


def replica(i: int, holder: str = H1) -> ReplicaRecord:
    digests = tuple(hashlib.sha256(b"%d/%d" % (i, n)).digest() for n in range(4))
    return ReplicaRecord(
        block_key=key(i),
        compat_id=CompatId(COMPAT),
        scope_id=SCOPE,
        holder=holder,
        codec=1,
        size=BLOCK,
        digest=hashlib.sha256(b"".join(digests)).digest(),
        layer_digests=digests,
        residency=None,
        ttl_ms=600_000,
    )


def status(
    instance: str,
    links: Sequence[tuple[str, float]] = (),
    *,
    epoch: int = 1,
    state: InstanceState = ACTIVE,
    running: int = 0,
    queued: int = 0,
    requested: InstanceState | None = None,
    ttl_ms: int = 3_000,
) -> InstanceStatusRecord:
    return InstanceStatusRecord(
        instance=instance,
        epoch=epoch,
        state=state,
        running=running,
        queued=queued,
        batch_size=8,
        kv_utilization=0.5,
        prefill_tokens_per_s=PREFILL,
        decode_tokens_per_s=1000.0,
        links=tuple(Link(holder=h, mbit_per_s=float(rate), rtt_us=10.0) for h, rate in links),
        requested_state=requested,
        ttl_ms=ttl_ms,
    )


def place_request(blocks: int = 10, tokens: int = 200, ref: str | None = "r1") -> PlaceRequest:
    return PlaceRequest(
        scope_id=SCOPE,
        compat_id=CompatId(COMPAT),
        block_keys=tuple(key(i) for i in range(blocks)),
        prompt_tokens=tokens,
        request_ref=ref,
    )


class RecordingPeers:
    """Instances as the PC sees them: what was sent, and which ones fail."""

    def __init__(self) -> None:
        self.directives: list[tuple[str, PrefetchDirective]] = []
        self.states: list[tuple[str, InstanceState]] = []
        self.unreachable: set[str] = set()
        self.refusing: set[str] = set()

    def _check(self, instance: str) -> None:
        if instance in self.unreachable:
            raise TransportError(f"{instance}: connection refused")
        if instance in self.refusing:
            raise Conflict("the instance says no")

    async def prefetch(self, instance: str, directive: PrefetchDirective) -> None:
        self._check(instance)
        self.directives.append((instance, directive))

    async def put_state(self, instance: str, state: InstanceState) -> None:
        self._check(instance)
        self.states.append((instance, state))

    def directed(self) -> list[str]:
        return [instance for instance, _ in self.directives]


class Setup:
    """A controller over an in-process IS, with its clock, store and peers."""

    def __init__(self, config: PCConfig | None = None, scale_up: ScaleUpHook | None = None) -> None:
        self.clock = ManualClock(1_000_000)
        self.store = MemoryStore()
        self.descriptors = DescriptorRegistry()
        self.descriptors.add(DESCRIPTOR, persist=False)
        self.index = IndexService(self.store, max_ttl_ms=600_000, descriptors=self.descriptors)
        self.peers = RecordingPeers()
        self.config = config or PCConfig(sleep_threshold=1, sleep_after_ms=1_000)
        policy = SleepPolicy(
            threshold_load=self.config.sleep_threshold, min_low_ms=self.config.sleep_after_ms
        )
        ids = (uuid.UUID(int=(0x4 << 76) | (0x8 << 60) | n) for n in range(1, 1000))
        self.pc = PlacementController(
            InstanceRegistry(policy),
            LocalIndex(self.index, self.descriptors),
            self.peers,
            self.clock,
            self.config,
            scale_up=scale_up,
            new_id=lambda: next(ids),
        )

    def publish(self, blocks: int = 10, holder: str = H1) -> None:
        for i in range(blocks):
            run(self.store.put(replica(i, holder), self.clock.now_ms() + 600_000))

    def report(self, record: InstanceStatusRecord) -> InstanceState:
        return run(self.pc.put_status(record)).state

    def place(self, request: PlaceRequest | None = None, **kw: Any) -> Any:
        return run(self.pc.place(request or place_request(), DirectiveOptions(**kw)))

    def state(self, instance: str) -> InstanceState | None:
        return self.pc.registry.state_of(instance, self.clock.now_ms())


def cost(*, rate: float, blocks: int = 10, tokens: int = 200, wait: float = 0.0) -> float:
    """§6.4 by hand for one source: rtt + 8 * bytes / rate, plus recompute of the rest."""
    fetch = 10.0 + 8 * BLOCK * blocks / rate
    rest = 1e6 * (tokens - 16 * blocks) / PREFILL
    return wait + min(fetch + rest, 1e6 * tokens / PREFILL)


# --- placement ---------------------------------------------------------------------------------


def test_placement_lands_where_the_cache_is_and_directs_it_first() -> None:
    s = Setup()
    s.publish(10)
    s.report(status(A, [(H1, 100_000)]))
    s.report(status(B))  # no link to H1: can only recompute
    answer = s.place(deadline_ms=70, lease_ms=900)
    assert (answer.instance, answer.matched) == (A, 10)
    assert answer.cost_us == pytest.approx(cost(rate=100_000))
    assert s.peers.directed() == [A]
    directive = s.peers.directives[0][1]
    assert answer.directive == directive.directive
    assert [b.block_key for b in directive.blocks] == [key(i) for i in range(10)]
    assert all(b.sources == (H1,) for b in directive.blocks)
    assert (directive.deadline_ms, directive.lease_ms, directive.request_ref) == (70, 900, "r1")
    assert (directive.scope_id, directive.compat_id) == (SCOPE, COMPAT)
    defaults = s.place()
    assert s.peers.directives[1][1].deadline_ms == s.config.deadline_ms
    assert s.peers.directives[1][1].lease_ms == s.config.lease_ms
    assert defaults.directive != answer.directive


def test_resident_blocks_need_no_directive() -> None:
    s = Setup()
    s.publish(10, holder=A)  # A computed the prefix itself
    s.report(status(A))
    s.report(status(B, [(H1, 100_000)]))
    answer = s.place()
    assert answer.instance == A and answer.directive is None
    assert answer.cost_us == pytest.approx(1e6 * 40 / PREFILL)
    assert s.peers.directives == []


def test_directive_lists_fallback_sources_fastest_first_and_only_the_usable_prefix() -> None:
    s = Setup(PCConfig(sleep_threshold=1, sleep_after_ms=1_000, assumed_link_mbit_per_s=0))
    s.publish(6, holder=H1)
    s.publish(6, holder=H2)
    s.publish(10, holder="https://h3.example/kvsp/")  # no link from A: blocks 6.. unusable
    s.report(status(A, [(H1, 50_000), (H2, 100_000)]))
    answer = s.place()
    directive = s.peers.directives[0][1]
    assert answer.instance == A and answer.matched == 10
    assert len(directive.blocks) == 6
    # Each block: its chosen source, then the other holder as a fallback; loads spread over both.
    assert all(b.sources in ((H1, H2), (H2, H1)) for b in directive.blocks)
    assert {b.sources[0] for b in directive.blocks} == {H1, H2}


def test_no_cache_means_pure_recompute_without_directive() -> None:
    s = Setup()
    s.report(status(A, [(H1, 100_000)]))
    answer = s.place(place_request(blocks=0, tokens=50))
    assert (answer.instance, answer.matched, answer.directive) == (A, 0, None)
    assert answer.cost_us == pytest.approx(5_000)


def test_choice_flips_when_link_rates_change() -> None:
    s = Setup()
    s.publish(10)
    s.report(status(A, [(H1, 100_000)]))
    s.report(status(B, [(H1, 20_000)]))
    assert s.place().instance == A
    s.clock.advance(100)
    s.report(status(A, [(H1, 10_000)]))
    s.report(status(B, [(H1, 200_000)]))
    answer = s.place()
    assert answer.instance == B
    assert answer.cost_us == pytest.approx(cost(rate=200_000))
    assert s.peers.directed() == [A, B]


def test_choice_flips_when_queues_grow_as_wait_us_says() -> None:
    s = Setup(PCConfig(service_prior_us=1_000))
    s.publish(10)
    # A: fetch 810 µs + 4000 recompute; B: fetch 4010 + 4000. Each queued request adds 1000 µs.
    s.report(status(A, [(H1, 100_000)], queued=3))
    s.report(status(B, [(H1, 20_000)]))
    answer = s.place()
    assert answer.instance == A
    assert answer.cost_us == pytest.approx(cost(rate=100_000, wait=3_000))
    s.clock.advance(100)
    s.report(status(A, [(H1, 100_000)], queued=4))
    assert s.place().instance == B


def test_queue_limit_and_max_cost_bound_acceptable_instances() -> None:
    s = Setup(PCConfig(queue_limit=2, max_cost_us=10_000))
    s.publish(10)
    s.report(status(A, [(H1, 100_000)], running=8, queued=2))  # full: 10 >= 8 + 2
    s.report(status(B))  # recompute all: 20,000 µs > max_cost_us
    with pytest.raises(NoInstance) as info:
        s.place()
    assert info.value.status == 503 and info.value.problem == "kvsp-not-active"
    assert info.value.retry_after_s == s.config.retry_after_s
    assert s.peers.directives == []


def test_an_unreachable_instance_is_skipped_for_the_next_best() -> None:
    s = Setup()
    s.publish(10)
    s.report(status(A, [(H1, 100_000)]))
    s.report(status(B, [(H1, 20_000)]))
    s.peers.unreachable.add(A)
    assert s.place().instance == B
    assert s.peers.directed() == [B]


# --- §6.3: only active instances ---------------------------------------------------------------


def test_draining_sleeping_and_failed_instances_get_nothing() -> None:
    s = Setup()
    s.publish(10)
    s.report(status(A, [(H1, 100_000)]))
    s.report(status(B, [(H1, 10_000)]))
    run(s.pc.set_state(A, DRAINING))
    assert s.place().instance == B
    s.report(status(A, [(H1, 100_000)], state=SLEEPING))  # drained, it sleeps
    assert s.state(A) is SLEEPING
    assert s.place().instance == B
    run(s.pc.set_state(A, ACTIVE))  # woken; its records may lag, the PC's state counts
    assert s.place().instance == A
    s.clock.advance(2_000)
    s.report(status(B, [(H1, 10_000)]))
    s.clock.advance(1_000)  # A's record is 3,000 ms old: failed
    assert s.place().instance == B
    assert s.state(A) is FAILED
    assert s.peers.directed() == [B, B, A, B]


def test_failure_by_expiry_and_return_with_a_new_epoch() -> None:
    s = Setup()
    s.report(status(A, epoch=7, ttl_ms=3_000))
    s.clock.advance(2_999)
    assert run(s.pc.sweep()) == ()
    s.clock.advance(1)
    assert run(s.pc.sweep()) == (A,)
    [view] = s.pc.list_instances()
    assert (view.state, view.epoch, view.age_ms) == (FAILED, 7, 3_000)
    with pytest.raises(StaleEpoch):
        s.report(status(A, epoch=7))  # the old epoch stays rejected (§6.8)
    with pytest.raises(NoInstance):
        s.place(place_request(blocks=0, tokens=16))
    assert s.report(status(A, epoch=8)) is ACTIVE
    assert s.place(place_request(blocks=0, tokens=16)).instance == A


def test_a_delayed_lower_epoch_record_is_ignored() -> None:
    s = Setup()
    s.report(status(A, epoch=5, running=1))
    with pytest.raises(StaleEpoch) as info:
        s.report(status(A, epoch=4, running=7, state=DRAINING))
    assert info.value.status == 409 and info.value.problem == "kvsp-stale-epoch"
    [view] = s.pc.list_instances()
    assert (view.epoch, view.running, view.state) == (5, 1, ACTIVE)
    [forwarded] = run(s.store.statuses([A], s.clock.now_ms()))
    assert forwarded.epoch == 5 and forwarded.running == 1


def test_accepted_records_reach_the_index_for_estimates() -> None:
    s = Setup()
    s.report(status(A, [(H1, 100_000)]))
    [stored] = run(s.store.statuses([A], s.clock.now_ms()))
    assert stored == status(A, [(H1, 100_000)])


def test_sleep_request_granted_only_after_the_policy_time() -> None:
    s = Setup()  # threshold 1, 1,000 ms
    assert s.report(status(A)) is ACTIVE
    s.clock.advance(500)
    assert s.report(status(A, requested=SLEEPING)) is ACTIVE  # refused: too soon
    s.clock.advance(500)
    assert s.report(status(A, requested=SLEEPING)) is DRAINING  # granted
    assert s.report(status(B, running=3, ttl_ms=60_000)) is ACTIVE
    s.clock.advance(5_000)
    busy = status(B, running=3, requested=SLEEPING, ttl_ms=60_000)
    assert s.report(busy) is ACTIVE  # busy: refused


# --- operator state changes --------------------------------------------------------------------


def test_operator_transitions_are_forwarded_then_recorded() -> None:
    s = Setup()
    s.report(status(A))
    assert run(s.pc.set_state(A, DRAINING)) is DRAINING
    assert run(s.pc.set_state(A, ACTIVE)) is ACTIVE
    assert s.peers.states == [(A, DRAINING), (A, ACTIVE)]
    with pytest.raises(IllegalTransition) as info:
        run(s.pc.set_state(A, SLEEPING))  # only the instance moves to sleeping
    assert info.value.status == 409
    with pytest.raises(IllegalTransition):
        run(s.pc.set_state(A, FAILED))
    with pytest.raises(NotFound):
        run(s.pc.set_state(B, DRAINING))
    assert s.peers.states == [(A, DRAINING), (A, ACTIVE)]  # refused moves reach nobody
    assert s.state(A) is ACTIVE


def test_operator_change_fails_with_502_and_changes_nothing_when_the_instance_fails() -> None:
    s = Setup()
    s.report(status(A))
    s.peers.unreachable.add(A)
    with pytest.raises(TransportError) as unreachable:
        run(s.pc.set_state(A, DRAINING))
    assert unreachable.value.status == 502
    s.peers.unreachable.clear()
    s.peers.refusing.add(A)
    with pytest.raises(UpstreamError) as refused:
        run(s.pc.set_state(A, DRAINING))
    assert refused.value.status == 502
    assert s.state(A) is ACTIVE and s.peers.states == []


def test_an_expired_instance_cannot_be_changed() -> None:
    s = Setup()
    s.report(status(A, ttl_ms=1_000))
    s.clock.advance(1_000)
    with pytest.raises(IllegalTransition):
        run(s.pc.set_state(A, ACTIVE))
    assert s.peers.states == []


# --- request checks ----------------------------------------------------------------------------


def test_unknown_descriptor_with_matches_is_incompatible() -> None:
    s = Setup()
    s.descriptors = DescriptorRegistry()
    s.pc = PlacementController(
        s.pc.registry, LocalIndex(s.index, s.descriptors), s.peers, s.clock, s.config
    )
    s.publish(2)
    s.report(status(A, [(H1, 100_000)]))
    with pytest.raises(Incompatible):
        s.place(place_request(blocks=2, tokens=40))
    assert s.place(place_request(blocks=0, tokens=40)).instance == A


def test_prompt_shorter_than_its_blocks_is_a_bad_request() -> None:
    s = Setup()
    s.report(status(A))
    with pytest.raises(BadRequest) as info:
        s.place(place_request(blocks=3, tokens=47))
    assert info.value.path == "$.prompt_tokens"


# --- measured service times --------------------------------------------------------------------


def test_service_time_is_measured_from_busy_windows() -> None:
    times = ObservedServiceTimes(prior_us=500.0)
    assert times.on_status(status(A, running=8, queued=4), 0) is None
    for _ in range(6):
        times.placed(A)
    # 6 placed, in-system fell from 12 to 10: 8 completions in 1,000 ms.
    assert times.on_status(status(A, running=8, queued=2), 1_000) == pytest.approx(125_000)
    assert times.mean_us(A) == pytest.approx(125_000)
    assert times.mean_us(B) == pytest.approx(125_000)  # unmeasured: the fleet mean
    assert times.on_status(status(A, running=8, queued=3), 1_500) is None  # none completed
    times.placed(A)
    assert times.on_status(status(A, running=3, queued=0), 2_000) is None  # not busy: no sample
    assert times.mean_us(A) == pytest.approx(125_000)
    times.forget(A)
    assert times.mean_us(A) == pytest.approx(500.0)


def test_controller_measures_service_times_from_status_and_placements() -> None:
    s = Setup()
    s.report(status(A, running=8, queued=4))
    for _ in range(6):
        s.place(place_request(blocks=0, tokens=16))
    s.clock.advance(1_000)
    s.report(status(A, running=8, queued=2))
    [view] = s.pc.list_instances()
    assert view.mean_service_us == pytest.approx(125_000)
    s.report(status(A, epoch=2, running=8, queued=2))  # a restart forgets
    assert s.pc.list_instances()[0].mean_service_us is None


# --- scale-up ----------------------------------------------------------------------------------


HOOK_SCRIPT = """\
import json, os, sys
context = json.load(sys.stdin)
context["env_matched"] = os.environ["KVSP_MATCHED"]
with open(sys.argv[1], "a") as log:
    log.write(json.dumps(context) + "\\n")
print(sys.argv[2])
"""


@pytest.fixture
def hook_script(tmp_path: Path) -> Path:
    path = tmp_path / "start_instance.py"
    path.write_text(HOOK_SCRIPT)
    return path


def check_scale_up(s: Setup, calls: Any) -> None:
    s.publish(4)
    with pytest.raises(NoInstance) as info:
        s.place(place_request(blocks=4, tokens=80))
    first = info.value
    assert first.starting == NEW and first.directive is not None
    assert first.to_problem()["starting"] == NEW
    [(instance, directive)] = s.peers.directives  # sent at once, before any status
    assert instance == NEW and directive.directive == first.directive
    assert [b.block_key for b in directive.blocks] == [key(i) for i in range(4)]
    assert all(b.sources == (H1,) for b in directive.blocks)
    [context] = calls()
    assert context["matched"] == 4 and context["scope_id"] == SCOPE.hex()
    with pytest.raises(NoInstance) as again:  # still starting: no second start
        s.place(place_request(blocks=4, tokens=80))
    assert again.value.starting == NEW and len(calls()) == 1
    s.report(status(NEW, [(H1, 100_000)]))  # it registers
    assert s.place(place_request(blocks=4, tokens=80)).instance == NEW


def test_scale_up_command_hook_starts_and_directs_a_new_instance(
    hook_script: Path, tmp_path: Path
) -> None:
    log = tmp_path / "calls.jsonl"
    hook = CommandHook([sys.executable, str(hook_script), str(log), NEW.rstrip("/")])

    def calls() -> list[Any]:
        return [json.loads(line) for line in log.read_text().splitlines()]

    s = Setup(scale_up=hook)
    check_scale_up(s, calls)
    assert calls()[0]["env_matched"] == "4"


class _HookHandler(BaseHTTPRequestHandler):
    calls: list[Any] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        type(self).calls.append(json.loads(body))
        answer = json.dumps({"instance": NEW}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def hook_url() -> Iterator[tuple[str, list[Any]]]:
    calls: list[Any] = []
    handler = type("Handler", (_HookHandler,), {"calls": calls})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/start", calls
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_scale_up_url_hook_starts_and_directs_a_new_instance(
    hook_url: tuple[str, list[Any]],
) -> None:
    url, calls = hook_url
    check_scale_up(Setup(scale_up=UrlHook(url, timeout=5)), lambda: list(calls))


def test_failing_hook_answers_503_without_starting(tmp_path: Path) -> None:
    s = Setup(scale_up=CommandHook([sys.executable, "-c", "raise SystemExit(3)"]))
    with pytest.raises(NoInstance) as info:
        s.place(place_request(blocks=0, tokens=16))
    assert info.value.starting is None and "failed" in info.value.detail
    bad = Setup(scale_up=CommandHook([sys.executable, "-c", "print('not a uri')"]))
    with pytest.raises(NoInstance) as no_uri:
        bad.place(place_request(blocks=0, tokens=16))
    assert no_uri.value.starting is None
    assert s.peers.directives == bad.peers.directives == []


def test_hook_returning_a_draining_instance_sends_it_nothing(tmp_path: Path) -> None:
    async def start_b(context: Any) -> str:
        return B

    s = Setup(PCConfig(max_cost_us=1), scale_up=start_b)
    s.publish(2)
    s.report(status(B, [(H1, 100_000)]))
    run(s.pc.set_state(B, DRAINING))
    with pytest.raises(NoInstance) as info:
        s.place(place_request(blocks=2, tokens=40))
    assert info.value.starting == B and info.value.directive is None
    assert s.peers.directives == []


def test_startup_directive_copes_with_no_cache() -> None:
    async def start(context: Any) -> str:
        return NEW

    s = Setup(scale_up=start)
    with pytest.raises(NoInstance) as info:
        s.place(place_request(blocks=0, tokens=16))
    assert info.value.starting == NEW and info.value.directive is None


def test_status_views_render_as_json() -> None:
    s = Setup()
    s.report(replace(status(A, running=2, queued=1), kv_utilization=0.25))
    [view] = s.pc.list_instances()
    out = view.to_json()
    assert out["load"] == 3 and out["state"] == "active" and out["mean_service_us"] is None
    assert out["instance_id"] == hashlib.sha256(A.encode()).digest()[:16].hex()


def test_scale_up_hook_option_picks_the_form() -> None:
    assert isinstance(scale_up_hook("https://ops.example/start"), UrlHook)
    command = scale_up_hook("start-instance --zone 'eu west'")
    assert isinstance(command, CommandHook)
    assert command.argv == ["start-instance", "--zone", "eu west"]
    with pytest.raises(BadRequest):
        scale_up_hook("'unclosed")
    with pytest.raises(BadRequest):
        scale_up_hook("   ")


def test_a_fresh_instance_gets_a_directive_over_an_assumed_link() -> None:
    # Instances report only links they measured, and measure one only by fetching over it; the
    # PC assumes a rate for unmeasured holders so that a fresh cluster ever starts prefetching.
    s = Setup(PCConfig(assumed_link_mbit_per_s=40_000, assumed_link_rtt_us=100))
    s.publish(10, holder=H1)
    s.report(status(A))  # no links at all
    answer = s.place()
    assert (answer.instance, answer.matched) == (A, 10)
    assert s.peers.directed() == [A]
    assert all(b.sources == (H1,) for b in s.peers.directives[0][1].blocks)
    strict = Setup(PCConfig(assumed_link_mbit_per_s=0))
    strict.publish(10, holder=H1)
    strict.report(status(A))
    assert strict.place().directive is None and strict.peers.directives == []
