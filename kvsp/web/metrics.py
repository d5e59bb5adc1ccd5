"""Prometheus metrics of every KVSP service (DESIGN.md §1 the parts, §2 ``web/``).

Each app gets its own :class:`ServiceMetrics` with its own ``CollectorRegistry`` (several apps
may share one process, as in the tests), mounted by :func:`install_metrics`:

* an ASGI middleware that counts requests and times them by service, route **template**
  (``/blocks/{compat}/{scope}/{key}``, never the raw path: one series per resource, not per
  block), method and status;
* ``GET /metrics`` in the Prometheus text exposition format;
* domain metrics, read from the app's own objects when scraped (``app.state.index``, ``pc``,
  ``holder``, ``agent``, ``relay``) or counted by the handlers through :func:`observe_lookup`
  and :func:`observe_bytes`: replicas in the IS store, lookups and the cache hit ratio
  (matched / asked keys), active leases, storage faults of held blocks, bytes moved per
  transport, directive outcomes, and instance states;
* at an instance, what :mod:`kvsp.web.meters` counted: prefix cache queries and hits in tokens
  (``generate`` and ``prefetch`` paths, §6.5), the time to first token, and each block fetch
  (§6.7) by transport and source holder: a verified block's octets and seconds, a failure's
  error class;
* block octets **served** by transport at every holder face (HTTP GET answers) and relay (MOQT
  objects sent), named and labelled like the fetching side's, so that the octets an instance
  fetched over a transport add up to those its sources served over it;
* ``kvsp_build_info`` and the standard ``process_*`` (from ``/proc/self``: absent where there
  is none), ``python_info`` and ``python_gc_*`` metrics of ``prometheus_client``.

**Who may read it.** ``/metrics`` needs ``Authorization: Bearer`` of a principal with role
``metrics`` (or ``admin``): a scrape-only credential, so a Prometheus server never holds a token
that can publish, place or read blocks. Loopback is no exception (other local users can connect
too). The metrics are aggregates only: no scope ids, block keys, holder URIs or principal
names appear in any label, with one exception: the ``source`` label of an instance's fetch
metrics names the holder it fetched from (a base URI from a Replica Record), for the first
:data:`~kvsp.web.meters.MAX_SOURCES` holders only, then ``other``. A relay run ``--open`` has no
principals and serves it to anyone, like everything else it serves.
"""

from __future__ import annotations

import platform
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvsp import __version__
from kvsp.registries import DirectiveState, InstanceState
from kvsp.web.auth import principal_of
from kvsp.web.meters import PATHS, Buckets, FetchMeter, GenerationMeter

METRICS_PATH = "/metrics"
METRICS_ROLE = "metrics"
UNMATCHED = "<unmatched>"
"""The route label of a request no route matched (a 404): raw paths never become labels."""
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
"""Seconds: lookups take tens of microseconds to milliseconds, block transfers up to seconds."""
TRANSPORTS = ("http", "moqt")
DIRECTIONS = ("sent", "received")
ARRIVED = "kvsp.arrived"
"""The ASGI scope key under which :class:`MetricsMiddleware` notes when a request arrived."""


class ServiceMetrics:
    """The metrics of one service app: its registry, request metrics and domain tallies."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "kvsp_http_requests",
            "HTTP requests answered, by route template, method and status.",
            ["service", "route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "kvsp_http_request_duration_seconds",
            "Time from request to the end of the response, by route template and method.",
            ["service", "route", "method"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.lookups: dict[str, int] = {}  # via → lookups
        self.keys: dict[tuple[str, str], int] = {}  # (via, "asked"|"matched") → block keys
        self.octets: dict[tuple[str, str], int] = {}  # (transport, direction) → octets
        self._app: Starlette | None = None
        self.registry.register(_DomainCollector(self))
        # the standard process and interpreter metrics; ProcessCollector reads /proc/self and
        # yields nothing where there is none
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.registry.register(_BuildInfo(service))

    def bind(self, app: Starlette) -> None:
        """Read the domain objects from ``app.state`` when scraped."""
        self._app = app

    def count_lookup(self, via: str, asked: int, matched: int) -> None:
        """One lookup of ``asked`` keys of which ``matched`` leading ones were found."""
        self.lookups[via] = self.lookups.get(via, 0) + 1
        self.keys[(via, "asked")] = self.keys.get((via, "asked"), 0) + asked
        self.keys[(via, "matched")] = self.keys.get((via, "matched"), 0) + matched

    def count_octets(self, transport: str, direction: str, octets: int) -> None:
        """``octets`` of block data moved over ``transport`` in ``direction``."""
        key = (transport, direction)
        self.octets[key] = self.octets.get(key, 0) + octets

    def families(self) -> list[Metric]:
        """The domain metric families as of now (called by the registry on each scrape)."""
        out = self._lookup_families()
        out.append(self._octet_family())
        if self._app is not None:
            out.extend(self._served_families(self._app.state))
            out.extend(_state_families(self.service, self._app.state))
        return out

    def _served_families(self, state: Any) -> Iterator[Metric]:
        """Octets served by transport, where the app serves blocks (a holder, an instance's
        holder face, a relay): the ``sent`` octets of :meth:`_octet_family`, the same count."""
        if all(getattr(state, name, None) is None for name in ("holder", "agent", "relay")):
            return
        family = CounterMetricFamily(
            "kvsp_block_served_bytes",
            "Octets of KV blocks served, by transport: HTTP GET answers (container octets) "
            "and MOQT objects sent (layer payloads).",
            labels=["service", "transport"],
        )
        totals = self._octet_totals()
        for transport in TRANSPORTS:
            family.add_metric([self.service, transport], totals.get((transport, "sent"), 0))
        yield family

    def _lookup_families(self) -> list[Metric]:
        lookups = CounterMetricFamily(
            "kvsp_lookups",
            "Prefix lookups answered (via lookup or place).",
            labels=["service", "via"],
        )
        keys = CounterMetricFamily(
            "kvsp_lookup_keys",
            "Block keys asked for in lookups, and leading keys matched.",
            labels=["service", "via", "result"],
        )
        ratio = GaugeMetricFamily(
            "kvsp_cache_hit_ratio",
            "Matched / asked block keys since start (0 before any lookup).",
            labels=["service", "via"],
        )
        for via, count in sorted(self.lookups.items()):
            lookups.add_metric([self.service, via], count)
            asked = self.keys.get((via, "asked"), 0)
            matched = self.keys.get((via, "matched"), 0)
            keys.add_metric([self.service, via, "asked"], asked)
            keys.add_metric([self.service, via, "matched"], matched)
            ratio.add_metric([self.service, via], matched / asked if asked else 0.0)
        return [lookups, keys, ratio]

    def _octet_family(self) -> Metric:
        family = CounterMetricFamily(
            "kvsp_block_bytes",
            "Octets of KV block data moved, by transport and direction.",
            labels=["service", "transport", "direction"],
        )
        for (transport, direction), octets in sorted(self._octet_totals().items()):
            family.add_metric([self.service, transport, direction], octets)
        return family

    def _octet_totals(self) -> dict[tuple[str, str], int]:
        totals = dict(self.octets)
        if self._app is not None:
            for key, octets in _domain_octets(self._app.state).items():
                totals[key] = totals.get(key, 0) + octets
        return totals

    def exposition(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)


class _DomainCollector(Collector):
    """Hands the registry the domain families computed at scrape time."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterable[Metric]:
        return self._metrics.families()

    def describe(self) -> Iterable[Metric]:
        return ()  # the families vary with the app's contents: nothing to check up front


class _BuildInfo(Collector):
    """``kvsp_build_info``: 1, labelled with what runs (the ``*_info`` convention)."""

    def __init__(self, service: str) -> None:
        labels = {
            "service": service,
            "version": __version__,
            "python": platform.python_version(),
            "implementation": platform.python_implementation(),
            "platform": sys.platform,
            "machine": platform.machine(),
        }
        self._family = GaugeMetricFamily(
            "kvsp_build_info",
            "The KVSP build this process runs, and on what; always 1.",
            labels=list(labels),
        )
        self._family.add_metric(list(labels.values()), 1)

    def collect(self) -> Iterable[Metric]:
        return [self._family]


# --- domain objects read at scrape time -------------------------------------------------------


def _domain_octets(state: Any) -> dict[tuple[str, str], int]:
    """Octets counted by the domain objects themselves: an instance's verified fetches, a
    relay's MOQT sessions."""
    out: dict[tuple[str, str], int] = {}
    agent = getattr(state, "agent", None)
    meter = getattr(getattr(agent, "block_client", None), "meter", None)
    if meter is not None:  # an instance's fetches, as kvsp_block_fetched_bytes counts them
        for transport, octets in meter.octets_by_transport().items():
            out[(transport, "received")] = octets
    relay = getattr(state, "relay", None)
    if relay is not None:
        sent, received = relay.moqt_octets()
        out[("moqt", "sent")] = sent
        out[("moqt", "received")] = received
    return out


def _state_families(service: str, state: Any) -> Iterator[Metric]:
    clock = getattr(state, "clock", None)
    index = getattr(state, "index", None)
    replicas = getattr(state, "replica_count", None)
    if index is not None and replicas is not None:
        yield _gauge("kvsp_replicas", "Replica Records in the IS store.", service, replicas)
    holder = getattr(state, "holder", None)
    if holder is not None and clock is not None:
        yield from _lease_families(service, holder, clock.now_ms())
    pc = getattr(state, "pc", None)
    if pc is not None:
        yield from _pc_families(service, pc)
    agent = getattr(state, "agent", None)
    if agent is not None:
        yield from _agent_families(service, agent)
    faults = getattr(holder or getattr(agent, "holder", None), "faults", None)
    if faults is not None:
        yield _by_label(
            "kvsp_block_faults",
            "Stored blocks found missing, empty, truncated, corrupt or unreadable when read; "
            "each was withdrawn and deleted, and answered as a miss.",
            service,
            "kind",
            faults,
        )


def _gauge(name: str, doc: str, service: str, value: float) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=["service"])
    family.add_metric([service], value)
    return family


def _lease_families(service: str, holder: Any, now_ms: int) -> Iterator[Metric]:
    keys = len(holder.leases.leased_keys(now_ms))  # drops expired leases first
    yield _gauge("kvsp_leases_active", "Unexpired leases (§6.6).", service, len(holder.leases))
    yield _gauge("kvsp_leased_blocks", "Blocks covered by an unexpired lease.", service, keys)


def _pc_families(service: str, pc: Any) -> Iterator[Metric]:
    counts = {str(state): 0 for state in InstanceState}
    for view in pc.list_instances():
        counts[str(view.state)] += 1
    yield _by_label(
        "kvsp_instances",
        "Instances known to the PC, by state (§6.3).",
        service,
        "state",
        counts,
        gauge=True,
    )
    outcomes = {"sent": pc.directives_sent, "failed": pc.directives_failed}
    yield _by_label(
        "kvsp_directive_outcomes",
        "Prefetch directives by outcome: at the PC sent (202) or failed; at an instance "
        "complete, partial or failed (§6.5).",
        service,
        "outcome",
        outcomes,
    )


def _agent_families(service: str, agent: Any) -> Iterator[Metric]:
    current = str(agent.state)
    states = {str(state): 1 if str(state) == current else 0 for state in InstanceState}
    yield _by_label(
        "kvsp_instance_state",
        "This instance's state (§6.3): 1 for the current one.",
        service,
        "state",
        states,
        gauge=True,
    )
    counts = agent.directives.outcome_counts()
    outcomes = {str(s): counts.get(s, 0) for s in DirectiveState if s is not DirectiveState.PENDING}
    outcomes["pending"] = counts.get(DirectiveState.PENDING, 0)
    yield _by_label(
        "kvsp_directive_outcomes",
        "Prefetch directives by outcome: at the PC sent (202) or failed; at an instance "
        "complete, partial or failed, and pending ones (§6.5).",
        service,
        "outcome",
        outcomes,
    )
    yield from generation_families(service, agent.meter)
    meter = getattr(agent.block_client, "meter", None)
    if isinstance(meter, FetchMeter):
        yield from fetch_families(service, meter)


def generation_families(service: str, meter: GenerationMeter) -> Iterator[Metric]:
    """Prefix cache queries and hits (tokens, by path) and the time to first token, from a
    :class:`~kvsp.web.meters.GenerationMeter`."""
    queries = CounterMetricFamily(
        "kvsp_prefix_cache_queries",
        "Prefix cache queries in tokens: a generation's prompt tokens, a directive's blocks' "
        "tokens (§6.5).",
        labels=["service", "path"],
    )
    hits = CounterMetricFamily(
        "kvsp_prefix_cache_hits",
        "Prefix cache hits in tokens: the tokens of a prompt's leading blocks found held "
        "(engine or holder face), of a directive's blocks held or loaded.",
        labels=["service", "path"],
    )
    for path in PATHS:
        queries.add_metric([service, path], meter.queries.get(path, 0))
        hits.add_metric([service, path], meter.hits.get(path, 0))
    ttft = HistogramMetricFamily(
        "kvsp_time_to_first_token_seconds",
        "Seconds from a generate request's arrival to its first output token.",
        labels=["service"],
    )
    _add_histogram(ttft, [service], meter.ttft)
    return iter((queries, hits, ttft))


def fetch_families(service: str, meter: FetchMeter) -> Iterator[Metric]:
    """Block fetches by transport and source holder, from a
    :class:`~kvsp.web.meters.FetchMeter`: octets and seconds of verified blocks, failures by
    error."""
    octets = CounterMetricFamily(
        "kvsp_block_fetched_bytes",
        "Octets of verified KV blocks fetched, by transport and source holder: HTTP answer "
        "bodies (container octets) and MOQT object payloads (layers).",
        labels=["service", "transport", "source"],
    )
    latency = HistogramMetricFamily(
        "kvsp_block_fetch_duration_seconds",
        "Seconds from a block request to the block verified, by transport and source holder.",
        labels=["service", "transport", "source"],
    )
    failures = CounterMetricFamily(
        "kvsp_block_fetch_failures",
        "Block fetches that failed, by transport, source holder and error (the problem's "
        "class: NotFound, DigestMismatch, TransportError, ...).",
        labels=["service", "transport", "source", "error"],
    )
    for (transport, source), count in sorted(meter.octets.items()):
        octets.add_metric([service, transport, source], count)
    for (transport, source), buckets in sorted(meter.latency.items()):
        _add_histogram(latency, [service, transport, source], buckets)
    for (transport, source, error), count in sorted(meter.failures.items()):
        failures.add_metric([service, transport, source, error], count)
    return iter((octets, latency, failures))


def _add_histogram(family: HistogramMetricFamily, labels: list[str], buckets: Buckets) -> None:
    family.add_metric(labels, buckets.cumulative(), buckets.sum)


def _by_label(
    name: str,
    doc: str,
    service: str,
    label: str,
    values: Mapping[str, int],
    *,
    gauge: bool = False,
) -> Metric:
    family: Metric
    if gauge:
        family = GaugeMetricFamily(name, doc, labels=["service", label])
    else:
        family = CounterMetricFamily(name, doc, labels=["service", label])
    for key, value in sorted(values.items()):
        family.add_metric([service, key], value)
    return family


# --- the HTTP side ----------------------------------------------------------------------------


def route_template(scope: Scope) -> str:
    """The path template of the route that matched ``scope`` (set by Starlette's router), or
    :data:`UNMATCHED`."""
    route = scope.get("route")
    path = getattr(route, "path", None)
    return path if isinstance(path, str) else UNMATCHED


class MetricsMiddleware:
    """Counts and times every HTTP request by route template, method and status.

    A client that went away before its body was complete is counted under status ``499``
    (:class:`~kvsp.web.http.ClientDisconnected`), never as a 5xx: a flaky network is not a
    server failure.
    """

    def __init__(self, app: ASGIApp, metrics: ServiceMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        began = time.perf_counter()
        scope[ARRIVED] = began
        status = 500  # what the client sees if the app fails before it answers

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            m = self.metrics
            route, method = route_template(scope), scope["method"]
            m.requests.labels(m.service, route, method, str(status)).inc()
            m.latency.labels(m.service, route, method).observe(time.perf_counter() - began)


async def _replica_count(request: Request) -> None:
    index = getattr(request.app.state, "index", None)
    if index is not None:  # the store may be remote (Redis): counted here, not in collect()
        request.app.state.replica_count = await index.store.count()


async def metrics_endpoint(request: Request) -> Response:
    """``GET /metrics``: the text exposition, for principals with role ``metrics`` or
    ``admin`` (others are refused before it runs: :mod:`kvsp.web.roles`).

    Raises:
        Unauthorized: no valid bearer token.
    """
    if request.app.state.principals is not None:  # None only for a relay run --open
        principal_of(request)  # role metrics: kvsp.web.roles
    await _replica_count(request)
    metrics: ServiceMetrics = request.app.state.metrics
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def metrics_routes() -> list[BaseRoute]:
    """The ``/metrics`` route."""
    return [Route(METRICS_PATH, metrics_endpoint, methods=["GET"])]


def install_metrics(app: Starlette, service: str) -> ServiceMetrics:
    """Give ``app`` its own metrics (``app.state.metrics``), the request middleware and the
    ``/metrics`` route. Call it after the problem handlers, so that 500s are counted too."""
    metrics = ServiceMetrics(service)
    metrics.bind(app)
    app.state.metrics = metrics
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.router.routes.extend(metrics_routes())
    return metrics


def arrival(request: Request) -> float:
    """When ``request`` arrived (:func:`time.perf_counter` seconds), as noted by
    :class:`MetricsMiddleware`; now in an app without it."""
    arrived = request.scope.get(ARRIVED)
    return arrived if isinstance(arrived, float) else time.perf_counter()


def _metrics_of(request: Request) -> ServiceMetrics | None:
    metrics = getattr(request.app.state, "metrics", None)
    return metrics if isinstance(metrics, ServiceMetrics) else None


def observe_lookup(request: Request, via: str, asked: int, matched: int) -> None:
    """Count a lookup answered for ``request`` (a no-op in an app without metrics)."""
    metrics = _metrics_of(request)
    if metrics is not None:
        metrics.count_lookup(via, asked, matched)


def observe_bytes(request: Request, transport: str, direction: str, octets: int) -> None:
    """Count block octets moved for ``request`` (a no-op in an app without metrics)."""
    metrics = _metrics_of(request)
    if metrics is not None:
        metrics.count_octets(transport, direction, octets)
