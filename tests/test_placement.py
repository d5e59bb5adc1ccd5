"""§6.4 placement estimates: the spec's formulas with hand-computed numbers.

Units: 1 Mbit/s = 1 bit/µs, so moving b octets at r Mbit/s takes 8·b/r µs.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsp import placement
from kvsp.errors import BadRequest
from kvsp.placement import (
    ServiceTimeEstimator,
    choose_instance,
    estimate_instance,
    estimate_targets,
    plan_fetch,
    prepare_fetch,
    recompute_us,
)

H1, H2, H3 = "https://h1.example/kvsp/", "https://h2.example/kvsp/", "https://h3.example/kvsp/"
I7, I9 = "https://ii7.example/kvsp/", "https://ii9.example/kvsp/"
MB = 1_000_000  # a block of 10^6 octets: 8·10^6 bits


@dataclass(frozen=True, slots=True, kw_only=True)
class Residency:
    tier: str
    first: int
    last: int
    read_mbit_per_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Replica:
    holder: str
    size: int = MB
    layer_digests: tuple[bytes, ...] | None = None
    residency: tuple[Residency, ...] | None = None
    site: str | None = None
    zone: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    holder: str
    mbit_per_s: float
    rtt_us: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Status:
    instance: str
    state: str = "active"
    running: int = 0
    queued: int = 0
    batch_size: int = 32
    prefill_tokens_per_s: float = 40_000.0
    links: tuple[Link, ...] = field(default=())
    site: str | None = None
    zone: str | None = None
    relay: str | None = None


def est(
    status: Status,
    replicas: Sequence[Sequence[Replica]],
    *,
    prompt_tokens: int,
    block_tokens: int = 16,
    layers: int | None = None,
    service: ServiceTimeEstimator | None = None,
) -> placement.PlacementEstimate:
    return estimate_instance(
        prepare_fetch(replicas, layers=layers),
        status,
        block_tokens=block_tokens,
        prompt_tokens=prompt_tokens,
        service_times=service or ServiceTimeEstimator(prior_us=1000.0),
        with_sources=True,
    )


def test_single_source_fetch_recompute_wait_and_cost() -> None:
    status = Status(instance=I7, queued=2, links=(Link(holder=H1, mbit_per_s=100_000, rtt_us=12),))
    e = est(status, [[Replica(holder=H1)]] * 3, prompt_tokens=3 * 16 + 10)
    # per block 8·10^6 / 10^5 = 80 µs; fetch = 12 + 3·80 = 252
    assert e.fetch_us == pytest.approx(252.0)
    # unmatched 10 tokens: 1e6·10/40000 = 250; all 58 tokens: 1e6·58/40000 = 1450
    assert e.recompute_unmatched_us == pytest.approx(250.0)
    assert e.recompute_all_us == pytest.approx(1450.0)
    # wait = queued 2 × prior 1000 = 2000; cost = 2000 + min(252 + 250, 1450) = 2502
    assert e.wait_us == 2000.0
    assert e.cost_us == pytest.approx(2502.0)
    assert e.plan == "fetch"
    assert e.usable_blocks == 3 and e.resident_blocks == 0
    assert e.sources == (H1, H1, H1)
    assert e.bytes_per_source == ((H1, 3.0 * MB),)


def test_two_sources_take_the_max_not_the_sum() -> None:
    links = (
        Link(holder=H1, mbit_per_s=100_000, rtt_us=10),
        Link(holder=H2, mbit_per_s=50_000, rtt_us=20),
    )
    e = est(
        Status(instance=I7, links=links),
        [[Replica(holder=H1)], [Replica(holder=H2)]],
        prompt_tokens=32,
    )
    # H1: 10 + 8e6/1e5 = 90; H2: 20 + 8e6/5e4 = 180; max = 180 (the sum would be 270)
    assert e.fetch_us == pytest.approx(180.0)
    assert e.sources == (H1, H2)
    assert e.bytes_per_source == ((H1, float(MB)), (H2, float(MB)))


def test_replicated_blocks_go_to_the_source_that_finishes_first() -> None:
    links = (
        Link(holder=H1, mbit_per_s=100_000, rtt_us=10),
        Link(holder=H2, mbit_per_s=50_000, rtt_us=20),
    )
    both = [Replica(holder=H2), Replica(holder=H1)]
    e = est(Status(instance=I7, links=links), [both] * 3, prompt_tokens=48)
    # block 0: H1 10+80=90 vs H2 20+160=180 → H1; block 1: H1 90+80=170 vs 180 → H1;
    # block 2: H1 170+80=250 vs H2 180 → H2. fetch = max(170, 180) = 180
    assert e.sources == (H1, H1, H2)
    assert e.fetch_us == pytest.approx(180.0)
    assert e.bytes_per_source == ((H1, 2.0 * MB), (H2, float(MB)))


def _split_replica(host_read: float) -> Replica:
    return Replica(
        holder=H1,
        size=2_097_152,
        layer_digests=tuple(bytes(32) for _ in range(32)),
        residency=(
            Residency(tier="device", first=0, last=15),
            Residency(tier="host", first=16, last=31, read_mbit_per_s=host_read),
        ),
    )


def test_tier_read_rate_above_the_link_does_not_cap() -> None:
    status = Status(instance=I7, links=(Link(holder=H1, mbit_per_s=200_000, rtt_us=12),))
    e = est(status, [[_split_replica(400_000)]], prompt_tokens=16)
    # host layers at min(200000, 400000) = link: 12 + 8·2097152/200000 = 12 + 83.88608
    assert e.fetch_us == pytest.approx(95.88608, rel=1e-12)


def test_tier_read_rate_below_the_link_caps_its_layers() -> None:
    status = Status(instance=I7, links=(Link(holder=H1, mbit_per_s=800_000, rtt_us=12),))
    e = est(status, [[_split_replica(400_000)]], prompt_tokens=16)
    # 1048576 octets per half: device 8·1048576/800000 = 10.48576,
    # host 8·1048576/min(800000, 400000) = 20.97152; 12 + 31.45728 = 43.45728
    assert e.fetch_us == pytest.approx(43.45728, rel=1e-12)


def test_layer_count_from_argument_or_residency_without_digests() -> None:
    replica = Replica(
        holder=H1,
        size=4_000_000,
        residency=(
            Residency(tier="device", first=0, last=2),
            Residency(tier="disk", first=3, last=3, read_mbit_per_s=1000),
        ),
    )
    status = Status(instance=I7, links=(Link(holder=H1, mbit_per_s=100_000, rtt_us=0),))
    # 4 layers of 10^6 octets (inferred from the highest residency layer, 3):
    # 3·8e6/1e5 + 8e6/1e3 = 240 + 8000 = 8240
    assert est(status, [[replica]], prompt_tokens=16).fetch_us == pytest.approx(8240.0)
    # layers=8 given: 500000 octets per layer; 3 device, 1 disk, 4 in no tier (at the link):
    # 7·4e6/1e5 + 4e6/1e3 = 280 + 4000 = 4280
    assert est(status, [[replica]], prompt_tokens=16, layers=8).fetch_us == pytest.approx(4280.0)


def test_blocks_resident_at_the_target_cost_nothing() -> None:
    status = Status(instance=I7, links=(Link(holder=H1, mbit_per_s=100_000, rtt_us=12),))
    here = [Replica(holder=H1), Replica(holder=I7)]
    e = est(status, [here, here, [Replica(holder=H1)]], prompt_tokens=48)
    # only block 2 moves: 12 + 80 = 92
    assert e.fetch_us == pytest.approx(92.0)
    assert e.resident_blocks == 2 and e.usable_blocks == 3
    assert e.sources == (None, None, H1)
    only_here = est(Status(instance=I7), [[Replica(holder=I7)]] * 2, prompt_tokens=32)
    assert only_here.fetch_us == 0.0 and only_here.usable_blocks == 2
    assert only_here.cost_us == 0.0 and only_here.plan == "fetch"


def test_a_gap_in_reachable_replicas_truncates_the_usable_prefix() -> None:
    status = Status(instance=I7, links=(Link(holder=H1, mbit_per_s=100_000, rtt_us=10),))
    blocks = [[Replica(holder=H1)], [Replica(holder=H3)], [Replica(holder=H1)]]
    e = est(status, blocks, prompt_tokens=48)
    # block 1 has no replica I7 can reach, so block 2 is unusable too: fetch = 10 + 80 = 90,
    # unmatched = 32 tokens: 1e6·32/40000 = 800; all: 1200; cost = min(890, 1200)
    assert e.usable_blocks == 1
    assert e.fetch_us == pytest.approx(90.0)
    assert e.recompute_unmatched_us == pytest.approx(800.0)
    assert e.cost_us == pytest.approx(890.0)
    assert e.sources == (H1,)


def test_a_zero_rate_link_is_no_link() -> None:
    status = Status(instance=I7, links=(Link(holder=H1, mbit_per_s=0, rtt_us=10),))
    e = est(status, [[Replica(holder=H1)]], prompt_tokens=16)
    assert e.usable_blocks == 0 and e.fetch_us == 0.0 and e.plan == "recompute"


def test_recompute_when_cheaper() -> None:
    status = Status(instance=I7, links=(Link(holder=H1, mbit_per_s=1, rtt_us=10),))
    e = est(status, [[Replica(holder=H1)]], prompt_tokens=20)
    # fetch 10 + 8e6 µs ≫ recompute of 20 tokens: 1e6·20/40000 = 500
    assert e.plan == "recompute"
    assert e.fetch_us == pytest.approx(8_000_010.0)
    assert e.cost_us == pytest.approx(500.0)


def test_wait_from_observed_service_times() -> None:
    service = ServiceTimeEstimator(prior_us=1000.0, alpha=0.5)
    assert service.mean_us(I7) == 1000.0  # the prior before any observation
    service.observe(I7, 400.0)  # the first observation replaces the prior: 400
    service.observe(I7, 800.0)  # 400 + 0.5·(800 − 400) = 600
    assert service.mean_us(I7) == 600.0
    assert service.wait_us(I7, 3) == 1800.0  # 3 queued × 600
    e = est(Status(instance=I7, queued=3), [], prompt_tokens=40, service=service)
    # 1800 + 1e6·40/40000 = 1800 + 1000
    assert e.wait_us == 1800.0 and e.cost_us == pytest.approx(2800.0)
    service.forget(I7)
    assert service.mean_us(I7) == 1000.0


@pytest.mark.parametrize(
    ("prior", "alpha"), [(-1.0, 0.5), (10.0, 0.0), (10.0, 1.5), (math.nan, 0.5)]
)
def test_estimator_rejects_bad_settings(prior: float, alpha: float) -> None:
    with pytest.raises(BadRequest):
        ServiceTimeEstimator(prior_us=prior, alpha=alpha)


@pytest.mark.parametrize("value", [-1.0, math.inf, math.nan])
def test_estimator_rejects_bad_observations(value: float) -> None:
    with pytest.raises(BadRequest):
        ServiceTimeEstimator(prior_us=1.0).observe(I7, value)


def test_zero_prefill_rate_is_infinite_not_an_error() -> None:
    assert recompute_us(10, 0.0) == math.inf
    assert recompute_us(0, 0.0) == 0.0
    assert recompute_us(40, 80_000.0) == pytest.approx(500.0)  # 1e6·40/80000
    status = Status(
        instance=I7,
        prefill_tokens_per_s=0.0,
        links=(Link(holder=H1, mbit_per_s=100_000, rtt_us=12),),
    )
    partial = est(status, [[Replica(holder=H1)]], prompt_tokens=20)
    assert partial.cost_us == math.inf
    whole = est(status, [[Replica(holder=H1)]], prompt_tokens=16)
    assert whole.cost_us == pytest.approx(92.0)  # 12 + 80, nothing left to prefill
    service = ServiceTimeEstimator(prior_us=0.0)
    none = choose_instance(
        [status], [[Replica(holder=H1)]], block_tokens=16, prompt_tokens=20, service_times=service
    )
    assert none is None


def _choose(
    candidates: Sequence[Status],
    replicas: Sequence[Sequence[Replica]],
    prompt_tokens: int,
    *,
    max_cost_us: float = math.inf,
    queue_limit: int | None = None,
) -> placement.PlacementDecision | None:
    return choose_instance(
        candidates,
        replicas,
        block_tokens=16,
        prompt_tokens=prompt_tokens,
        service_times=ServiceTimeEstimator(prior_us=100.0),
        max_cost_us=max_cost_us,
        queue_limit=queue_limit,
    )


@pytest.mark.parametrize("state", ["draining", "sleeping", "failed"])
def test_inactive_instances_are_never_chosen(state: str) -> None:
    cheap = Status(instance=I7, state=state)  # everything resident: cost 0
    dear = Status(instance=I9, queued=5)
    blocks = [[Replica(holder=I7)]]
    decision = _choose([cheap, dear], blocks, 16)
    assert decision is not None and decision.instance == I9 and decision.considered == 1
    assert _choose([cheap], blocks, 16) is None


def test_tie_between_equal_costs_and_waits_goes_to_the_less_busy_instance() -> None:
    # §6.4's wait counts only the queued: both wait 0 and cost 1e6·40/40000 = 1000
    busy = Status(instance="https://a.example/", running=1, batch_size=1)
    idle = Status(instance="https://b.example/", running=0, batch_size=1)
    half = Status(instance="https://c.example/", running=16, batch_size=32)
    for order in ([busy, idle], [idle, busy]):
        decision = _choose(order, [], 40)
        assert decision is not None and decision.instance == idle.instance
    for order in ([busy, half], [half, busy]):  # running / batch_size: 1 against 0.5
        decision = _choose(order, [], 40)
        assert decision is not None and decision.instance == half.instance
    dear = Status(instance="https://d.example/", running=0, queued=0, prefill_tokens_per_s=1)
    decision = _choose([busy, dear], [], 40)  # a lower cost still wins over an idle instance
    assert decision is not None and decision.instance == busy.instance


def test_tie_breaks_lower_wait_then_uri() -> None:
    # a: 1 queued × 100 + 1e6·40/100000 = 100 + 400; b: 0 + 1e6·40/80000 = 500 — equal costs
    a = Status(instance="https://a.example/", queued=1, prefill_tokens_per_s=100_000)
    b = Status(instance="https://b.example/", queued=0, prefill_tokens_per_s=80_000)
    for order in ([a, b], [b, a]):
        decision = _choose(order, [], 40)
        assert decision is not None and decision.instance == b.instance
        assert decision.estimate.cost_us == 500.0
    twin = Status(instance="https://c.example/", queued=0, prefill_tokens_per_s=80_000)
    for order in ([twin, b], [b, twin]):
        decision = _choose(order, [], 40)
        assert decision is not None and decision.instance == b.instance


def test_choice_carries_the_per_block_sources() -> None:
    near = Status(instance=I7, links=(Link(holder=H1, mbit_per_s=100_000, rtt_us=10),))
    far = Status(instance=I9, links=(Link(holder=H1, mbit_per_s=10_000, rtt_us=10),))
    decision = _choose(
        [far, near], [[Replica(holder=H1)], [Replica(holder=H1), Replica(holder=I7)]], 40
    )
    assert decision is not None and decision.instance == I7
    assert decision.estimate.sources == (H1, None)
    # 10 + 80 = 90, then 8 unmatched tokens: 1e6·8/40000 = 200
    assert decision.estimate.cost_us == pytest.approx(290.0)


def test_cost_and_capacity_limits() -> None:
    busy = Status(instance=I7, running=30, queued=2, batch_size=32)
    idle = Status(instance=I9, running=0, queued=0, prefill_tokens_per_s=1000)
    # busy: 2×100 + 1e6·16/40000 = 600; idle: 1e6·16/1000 = 16000
    decision = _choose([busy, idle], [], 16)
    assert decision is not None and decision.instance == I7
    decision = _choose([busy, idle], [], 16, queue_limit=0)  # 30 + 2 ≥ 32 + 0: full
    assert decision is not None and decision.instance == I9
    assert _choose([busy, idle], [], 16, queue_limit=0, max_cost_us=10_000.0) is None
    decision = _choose([busy, idle], [], 16, queue_limit=3)  # 32 < 35
    assert decision is not None and decision.instance == I7


def test_estimate_targets_for_a_lookup() -> None:
    reach_both = Status(instance=I7, links=(Link(holder=H1, mbit_per_s=100_000, rtt_us=10),))
    reach_first = Status(instance=I9, links=(Link(holder=H2, mbit_per_s=100_000, rtt_us=10),))
    blocks = [[Replica(holder=H1), Replica(holder=H2)], [Replica(holder=H1)]]
    out = estimate_targets(blocks, [reach_both, reach_first], block_tokens=16)
    # I7: 10 + 2·80 = 170; recompute of the 32 matched tokens: 1e6·32/40000 = 800
    assert out[I7].fetch_us == pytest.approx(170.0) and out[I7].recompute_us == pytest.approx(800.0)
    # I9 loads block 0 (10 + 80) and must recompute block 1 (1e6·16/40000 = 400) to hold both
    assert out[I9].usable_blocks == 1 and out[I9].load_us == pytest.approx(90.0)
    assert out[I9].fetch_us == pytest.approx(490.0)
    assert list(out) == [I7, I9]


def test_bad_requests() -> None:
    with pytest.raises(BadRequest):
        est(Status(instance=I7), [[Replica(holder=H1)]], prompt_tokens=15)  # shorter than a block
    with pytest.raises(BadRequest):
        estimate_targets([], [], block_tokens=0)


def test_blocks_with_the_same_offers_form_one_group() -> None:
    both = [Replica(holder=H1), Replica(holder=H2)]
    inputs = prepare_fetch([both] * 1000 + [[Replica(holder=H1)]] * 10 + [both])
    assert [len(g.indices) for g in inputs.groups] == [1001, 10]


# --- the closed-form allocation is the greedy ----------------------------------------------------

_sources = st.lists(
    st.tuples(
        st.sampled_from([0.0, 5.0, 10.0, 12.5, 100.0]),
        st.sampled_from([1.0, 2.0, 3.0, 7.5, 80.0, 0.1]),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(_sources, st.integers(min_value=1, max_value=400))
def test_allocate_matches_the_heap_greedy(spec: list[tuple[float, float]], k: int) -> None:
    sources = [
        placement._Source(holder=f"https://h{n}/", start_us=a, block_us=d, block_bytes=1.0)
        for n, (a, d) in enumerate(spec)
    ]
    assert placement._allocate(k, sources) == placement._allocate_by_heap(k, sources)


def _reference_fetch(status: Status, blocks: Sequence[Sequence[Replica]]) -> tuple[int, float]:
    """Block by block: groups in order of first block, each block to the earliest finisher."""
    links = {link.holder: link for link in status.links}
    usable = len(blocks)
    for n, replicas in enumerate(blocks):
        holders = {r.holder for r in replicas}
        if status.instance not in holders and not holders & links.keys():
            usable = n
            break
    groups: dict[frozenset[str], list[int]] = {}
    for n in range(usable):
        groups.setdefault(frozenset(r.holder for r in blocks[n]), []).append(n)
    finish: dict[str, float] = {}
    for group_holders, members in groups.items():
        if status.instance in group_holders:
            continue
        start = {h: finish.get(h, links[h].rtt_us) for h in sorted(group_holders & links.keys())}
        step = {h: 8.0 * MB / links[h].mbit_per_s for h in start}
        counts = dict.fromkeys(start, 0)
        for _ in members:
            best = min((start[h] + (counts[h] + 1) * step[h], h) for h in start)
            counts[best[1]] += 1
        finish.update({h: start[h] + c * step[h] for h, c in counts.items() if c})
    return usable, max(finish.values(), default=0.0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sets(st.sampled_from([H1, H2, H3, I7]), min_size=1), min_size=0, max_size=30),
    st.sets(st.sampled_from([H1, H2, H3])),
)
def test_plan_matches_a_block_by_block_reference(
    blocks_holders: list[set[str]], linked: set[str]
) -> None:
    rates = {H1: (100_000.0, 10.0), H2: (50_000.0, 3.0), H3: (80_000.0, 25.0)}
    status = Status(
        instance=I7,
        links=tuple(
            Link(holder=h, mbit_per_s=rates[h][0], rtt_us=rates[h][1]) for h in sorted(linked)
        ),
    )
    blocks = [[Replica(holder=h) for h in sorted(hs)] for hs in blocks_holders]
    plan = plan_fetch(prepare_fetch(blocks), status, with_sources=True)
    usable, fetch_us = _reference_fetch(status, blocks)
    assert plan.usable_blocks == usable
    assert plan.fetch_us == pytest.approx(fetch_us, rel=1e-12)
    assert plan.sources is not None and len(plan.sources) == usable
    for n, source in enumerate(plan.sources):
        holders = {r.holder for r in blocks[n]}
        assert source is None if I7 in holders else source in holders & linked


def test_empty_blocks_cost_only_the_round_trip() -> None:
    links = (Link(holder=H2, mbit_per_s=100, rtt_us=7), Link(holder=H1, mbit_per_s=100, rtt_us=7))
    both = [Replica(holder=H1, size=0), Replica(holder=H2, size=0)]
    e = est(Status(instance=I7, links=links), [both] * 3, prompt_tokens=48)
    # 0 octets take 0 µs: every block finishes at rtt 7, ties go to the lower URI (H1)
    assert e.fetch_us == 7.0 and e.sources == (H1, H1, H1)
