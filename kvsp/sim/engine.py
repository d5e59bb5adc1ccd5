"""The discrete-event loop: arrivals from the trace, transfer ends, prefill ends.

Time is simulated microseconds; the Index Service sees it as ``now_ms``. Events at the same
time run in the order they were scheduled, and transfer and prefill ends run before an arrival
at the same time, so a run is a pure function of the trace, the cluster and the seed.

Per request: the policy places it at arrival; the instance pins the prefix it holds (and, for a
fetch plan, starts the transfers and pins the incoming blocks); the request waits in the FIFO
queue; at its start the instance uses the longest prefix it then holds (a request can profit
from one that finished ahead of it), and prefill of the ``U`` uncached tokens after ``C``
cached ones takes ``P = prefill_us(U, C)``. With ``R`` the time the last used block is resident
(its transfer's end for a fetched one) and ``L`` layers, the request finishes at
``max(start + P, R + P / L)`` with layer-wise overlap and ``max(start, R) + P`` without. The
computed blocks are then inserted and published (and written through to the store, if any),
the pins are released, and the next queued request starts. TTFT is finish minus arrival.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvsp.sim.cluster import Cluster, Instance, Job, Transfer
from kvsp.sim.config import ClusterConfig
from kvsp.sim.policies import POLICIES, Policy
from kvsp.sim.replicas import ClusterIndex
from kvsp.sim.trace import SimRequest


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    """What happened to one request."""

    rid: int
    instance: int
    arrival_us: float
    start_us: float
    finish_us: float
    input_tokens: int
    blocks: int
    reused_blocks: int
    fetched_blocks: int
    recomputed_tokens: int

    @property
    def ttft_us(self) -> float:
        """Time to first token: arrival to the end of prefill."""
        return self.finish_us - self.arrival_us


@dataclass(frozen=True, slots=True, kw_only=True)
class RunResult:
    """The outcomes of one policy's replay, with the cluster's counters."""

    policy: str
    outcomes: tuple[Outcome, ...]
    block_bytes: int
    published: int
    withdrawn: int
    evictions: int


_TRANSFER, _FINISH = 0, 1


class Simulation:
    """One replay of ``requests`` on a fresh cluster under one policy."""

    def __init__(
        self, config: ClusterConfig, requests: Sequence[SimRequest], policy: str, *, seed: int
    ) -> None:
        self.config = config
        self.requests = requests
        self.index = ClusterIndex(config)
        self.cluster = Cluster(config, self.index)
        self.policy: Policy = POLICIES[policy](self.cluster, seed=seed)
        self._events: list[tuple[float, int, int, Job | Transfer]] = []
        self._seq = 0
        self._outcomes: list[Outcome] = []
        self._layers = config.layers if config.layerwise_overlap else 1

    def run(self) -> RunResult:
        """Replay every request and drain the cluster."""
        for request in self.requests:
            self._advance(request.arrival_us)
            self._arrive(request, request.arrival_us)
        self._advance(math.inf)
        self._outcomes.sort(key=lambda o: o.rid)
        holders = self.cluster.holders.values()
        return RunResult(
            policy=self.policy.name,
            outcomes=tuple(self._outcomes),
            block_bytes=self.config.block_bytes,
            published=self.index.published,
            withdrawn=self.index.withdrawn,
            evictions=sum(h.evictions for h in holders),
        )

    def _schedule(self, at_us: float, kind: int, item: Job | Transfer) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at_us, self._seq, kind, item))

    def _advance(self, until_us: float) -> None:
        events = self._events
        while events and events[0][0] <= until_us:
            at_us, _, kind, item = heapq.heappop(events)
            if kind == _TRANSFER and isinstance(item, Transfer):
                self.cluster.arrived(item, at_us)
            elif isinstance(item, Job):
                self._finish(item, at_us)

    def _arrive(self, request: SimRequest, now_us: float) -> None:
        placement = self.policy.place(request, now_us)
        inst = placement.instance
        job = Job(request=request, instance=inst, placed_us=now_us)
        held = request.keys[: inst.leading(request.keys)]
        inst.pin(held)
        job.pins.extend(held)
        if placement.sources is not None:
            for transfer in self.cluster.fetch(job, placement.sources, now_us):
                self._schedule(transfer.end_us, _TRANSFER, transfer)
        cached = inst.leading(request.keys) * self.config.block_tokens
        job.predicted_us = self.config.prefill_us(request.input_tokens - cached, cached)
        inst.queued_pred_us += job.predicted_us
        inst.queue.append(job)
        if inst.running is None:
            self._start(inst, now_us)

    def _start(self, inst: Instance, now_us: float) -> None:
        job = inst.queue.popleft()
        inst.queued_pred_us -= job.predicted_us
        inst.running = job
        keys = job.request.keys
        used = keys[: inst.leading(keys)]
        ready = max((inst.cache[k] for k in used), default=now_us)
        inst.touch(used)
        inst.pin(used)
        job.pins.extend(used)
        job.reused_blocks = len(used)
        cached = len(used) * self.config.block_tokens
        prefill = self.config.prefill_us(job.request.input_tokens - cached, cached)
        job.start_us = now_us
        job.finish_us = max(now_us + prefill, ready + prefill / self._layers)
        self._schedule(job.finish_us, _FINISH, job)

    def _finish(self, job: Job, now_us: float) -> None:
        inst = job.instance
        inst.running = None
        now_ms = int(now_us // 1000)
        computed = [(k, now_us) for k in job.request.keys[job.reused_blocks :]]
        inst.insert(computed, now_ms, publish=True)
        store = self.cluster.store
        if store is not None:
            store.insert(computed, now_ms, publish=True)
        inst.unpin(job.pins)
        self.policy.completed(job)
        request = job.request
        self._outcomes.append(
            Outcome(
                rid=request.rid,
                instance=inst.number,
                arrival_us=request.arrival_us,
                start_us=job.start_us,
                finish_us=job.finish_us,
                input_tokens=request.input_tokens,
                blocks=len(request.keys),
                reused_blocks=job.reused_blocks,
                fetched_blocks=job.fetched_blocks,
                recomputed_tokens=request.input_tokens
                - job.reused_blocks * self.config.block_tokens,
            )
        )
        if inst.queue:
            self._start(inst, now_us)


def simulate(
    config: ClusterConfig, requests: Sequence[SimRequest], policy: str, *, seed: int = 0
) -> RunResult:
    """Replay ``requests`` under ``policy`` on a fresh cluster built from ``config``."""
    return Simulation(config, requests, policy, seed=seed).run()
