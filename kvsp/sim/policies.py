"""The placement policies the simulator compares.

Baselines (they only reuse what the chosen instance already holds; they never fetch). They see
what the field's routers see and what the KVSP policy sees: the ``running`` and ``queued``
counts of the Instance Status Records (vLLM's production-stack router and llm-d's queue scorer
balance on request counts; no router is told how long each queued prompt will take):

* ``random``: a uniformly random instance (seeded).
* ``least-loaded``: the fewest requests, ``running + queued``; ties by number.
* ``local-cache-aware``: the longest prefix already in the instance's own cache; ties by
  ``running + queued``, then number.

Oracle variants, by name only (``--policy least-loaded-oracle,local-cache-aware-oracle``; not
in ``all``): the same rules ranked by the simulator's own prediction of each instance's
outstanding prefill work (the running request's remainder plus the predicted time of each
queued one, from the true prefill model), information no status record carries. They bound
what a router that knew every queued prompt's size could do with these rules.

KVSP (spec §6.4 as written, through the real code): a lookup on the real Index Service gives the
replicas of the matched prefix (§6.2); :func:`~kvsp.placement.choose_instance` ranks the active
instances by ``cost(i) = wait_us(i) + min(fetch_us(i) + recompute_us(unmatched),
recompute_us(all))`` over the Instance Status Records the cluster reports, with ``wait_us =
queued * mean service time`` from a :class:`~kvsp.placement.ServiceTimeEstimator` fed by the
completed simulated requests. When the plan is "fetch", the chosen instance loads the usable
blocks from the holders the plan names.

Beyond the spec (``kvsp-backlog``, behind ``--beyond-spec``): the same lookup, estimates and
``choose_instance``, but ``wait_us(i)`` is the work the PC itself placed on ``i`` and has not
seen complete: the sum of those requests' predicted service times (their §6.4 cost without the
wait, ``min(fetch_us + recompute_us(unmatched), recompute_us(all))``, booked at placement) less
the time the one at the head of the queue has been running (:class:`PlacedWork`). §6.4's
``queued * mean service time`` counts neither the running request nor the sizes of the queued
ones, so an instance that has just started a 100k-token prompt looks idle.

The cost does not credit a prefetch with overlapping the wait and layer-wise loading
(``max(W + P, F + P / L)``): on the traces that choice fetches far more blocks and evicts more
without lowering TTFT.
"""

from __future__ import annotations

import abc
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvsp.errors import SimError
from kvsp.placement import PlacementEstimate, ServiceTimeEstimator, choose_instance
from kvsp.records import InstanceStatusRecord, ReplicaRecord
from kvsp.sim.cluster import Cluster, Instance, Job
from kvsp.sim.trace import SimRequest


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Where a request goes and, for a fetch plan, the holder of each usable block (``None``
    for one already resident)."""

    instance: Instance
    sources: tuple[str | None, ...] | None = None


class Policy(abc.ABC):
    """A placement policy over a :class:`Cluster`; ``place`` is called at each arrival,
    ``completed`` after each prefill."""

    name: ClassVar[str] = ""

    def __init__(self, cluster: Cluster, *, seed: int) -> None:
        self.cluster = cluster
        self.seed = seed

    @abc.abstractmethod
    def place(self, request: SimRequest, now_us: float) -> Placement:
        """Choose the instance for ``request`` at ``now_us``."""

    def completed(self, job: Job) -> None:  # noqa: B027 - an optional hook
        """Learn from a finished request (nothing by default)."""


class RandomPolicy(Policy):
    """A uniformly random instance."""

    name = "random"

    def __init__(self, cluster: Cluster, *, seed: int) -> None:
        super().__init__(cluster, seed=seed)
        self._rng = random.Random(seed)

    def place(self, request: SimRequest, now_us: float) -> Placement:
        """A random instance."""
        return Placement(instance=self._rng.choice(self.cluster.instances))


def _requests(inst: Instance) -> int:
    """``running + queued``, as the instance's status record reports them."""
    return len(inst.queue) + (0 if inst.running is None else 1)


def _count_rank(inst: Instance, now_us: float) -> tuple[float, int, int]:
    return (_requests(inst), 0, inst.number)


def _work_rank(inst: Instance, now_us: float) -> tuple[float, int, int]:
    return (inst.outstanding_us(now_us), _requests(inst), inst.number)


class LeastLoadedPolicy(Policy):
    """The instance with the fewest requests (``running + queued``)."""

    name = "least-loaded"
    _rank = staticmethod(_count_rank)

    def place(self, request: SimRequest, now_us: float) -> Placement:
        """The least loaded instance."""
        rank = self._rank
        return Placement(instance=min(self.cluster.instances, key=lambda i: rank(i, now_us)))


class LocalCacheAwarePolicy(Policy):
    """The instance whose own cache holds the longest prefix; ties by ``running + queued``."""

    name = "local-cache-aware"
    _rank = staticmethod(_count_rank)

    def place(self, request: SimRequest, now_us: float) -> Placement:
        """The instance with the longest local prefix."""
        keys = request.keys
        load = self._rank

        def rank(inst: Instance) -> tuple[int, float, int, int]:
            return (-inst.leading(keys), *load(inst, now_us))

        return Placement(instance=min(self.cluster.instances, key=rank))


class LeastWorkOraclePolicy(LeastLoadedPolicy):
    """The instance with the least predicted outstanding work (an oracle: see the module)."""

    name = "least-loaded-oracle"
    _rank = staticmethod(_work_rank)


class LocalCacheAwareOraclePolicy(LocalCacheAwarePolicy):
    """The longest local prefix; ties by predicted outstanding work (an oracle)."""

    name = "local-cache-aware-oracle"
    _rank = staticmethod(_work_rank)


class KvspPolicy(Policy):
    """§6.4 as the spec writes it, through lookup + :func:`choose_instance`."""

    name = "kvsp"

    def __init__(self, cluster: Cluster, *, seed: int) -> None:
        super().__init__(cluster, seed=seed)
        config = cluster.config
        self.estimator = ServiceTimeEstimator(
            prior_us=config.prefill_us(config.reference_tokens, 0)
        )
        self._by_uri = {inst.uri: inst for inst in cluster.instances}
        self.fetch_plans = 0

    def place(self, request: SimRequest, now_us: float) -> Placement:
        """Look the prefix up, estimate every instance, take the cheapest.

        Raises:
            SimError: no instance has a finite cost.
        """
        replicas = self.cluster.index.find(request.keys, int(now_us // 1000))
        statuses = [self.cluster.status(inst) for inst in self.cluster.instances]
        best = self.choose(statuses, replicas, request, now_us)
        if best is None:
            raise SimError(f"request {request.rid}: no instance has a finite cost")
        fetch = best.plan == "fetch"
        self.fetch_plans += fetch
        return Placement(
            instance=self._by_uri[best.instance], sources=best.sources if fetch else None
        )

    def choose(
        self,
        statuses: Sequence[InstanceStatusRecord],
        replicas: Sequence[Sequence[ReplicaRecord]],
        request: SimRequest,
        now_us: float,
    ) -> PlacementEstimate | None:
        """The estimate (with per-block sources) of the instance to use."""
        decision = choose_instance(
            statuses,
            replicas,
            block_tokens=self.cluster.config.block_tokens,
            prompt_tokens=request.input_tokens,
            service_times=self.estimator,
            layers=self.cluster.config.layers,
        )
        return None if decision is None else decision.estimate

    def completed(self, job: Job) -> None:  # noqa: B027 - an optional hook
        """Feed the job's service time (start to end of prefill) to the estimator."""
        self.estimator.observe(job.instance.uri, job.finish_us - job.start_us)


class PlacedWork(ServiceTimeEstimator):
    """``wait_us`` from the PC's own bookkeeping (beyond §6.4): the predicted service of each
    request it placed on an instance and has not seen complete, less the time the head one
    has been running.

    A request's predicted service is its §6.4 estimate without the wait, ``min(fetch_us +
    recompute_us(unmatched), recompute_us(all))``. Instances run their queue in order, so the
    head starts when it is placed on an idle instance or when the request before it completes;
    the PC knows both moments without asking the instance.
    """

    __slots__ = ("_head_since", "_now_us", "_placed")

    def __init__(self) -> None:
        super().__init__(prior_us=0.0)
        self._placed: dict[str, deque[float]] = {}
        self._head_since: dict[str, float] = {}
        self._now_us = 0.0

    def at(self, now_us: float) -> None:
        """Set the time the next ``wait_us`` answers for."""
        self._now_us = now_us

    def placed(self, instance: str, service_us: float) -> None:
        """Count a request placed on ``instance`` with its predicted service time."""
        work = self._placed.setdefault(instance, deque())
        if not work:
            self._head_since[instance] = self._now_us
        work.append(service_us)

    def finished(self, instance: str, now_us: float) -> None:
        """The head request of ``instance`` completed at ``now_us``."""
        self._placed[instance].popleft()
        self._head_since[instance] = now_us

    def wait_us(self, instance: str, queued: int) -> float:
        """Predicted work left at ``instance`` (``queued`` is not needed)."""
        work = self._placed.get(instance)
        if not work:
            return 0.0
        elapsed = self._now_us - self._head_since[instance]
        return max(0.0, work[0] - elapsed) + sum(work) - work[0]


class BacklogAwarePolicy(KvspPolicy):
    """§6.4's cost with ``wait_us`` from :class:`PlacedWork` instead of ``queued * mean``."""

    name = "kvsp-backlog"

    def __init__(self, cluster: Cluster, *, seed: int) -> None:
        super().__init__(cluster, seed=seed)
        self.work = PlacedWork()
        self.estimator = self.work

    def choose(
        self,
        statuses: Sequence[InstanceStatusRecord],
        replicas: Sequence[Sequence[ReplicaRecord]],
        request: SimRequest,
        now_us: float,
    ) -> PlacementEstimate | None:
        """As §6.4, then book the chosen instance's predicted service."""
        self.work.at(now_us)
        best = super().choose(statuses, replicas, request, now_us)
        if best is not None:
            self.work.placed(best.instance, best.cost_us - best.wait_us)
        return best

    def completed(self, job: Job) -> None:  # noqa: B027 - an optional hook
        """Retire the finished request from the booked work."""
        self.work.finished(job.instance.uri, job.finish_us)


SPEC_POLICIES: tuple[type[Policy], ...] = (
    RandomPolicy,
    LeastLoadedPolicy,
    LocalCacheAwarePolicy,
    KvspPolicy,
)
BEYOND_SPEC: tuple[type[Policy], ...] = (BacklogAwarePolicy,)
ORACLES: tuple[type[Policy], ...] = (LeastWorkOraclePolicy, LocalCacheAwareOraclePolicy)
POLICIES: dict[str, type[Policy]] = {p.name: p for p in (*SPEC_POLICIES, *BEYOND_SPEC, *ORACLES)}
