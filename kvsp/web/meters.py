"""What an instance measures of its KV traffic and its generations, for ``/metrics``
(DESIGN.md §1 the parts, §2 ``web/``; spec §6.5 prefetch, §6.7 block retrieval).

Plain counters and histograms, with no Prometheus import: the block client
(:mod:`kvsp.transfer.block_client`) and the instance (:mod:`kvsp.services.instance`) count into
them on their hot paths, and :mod:`kvsp.web.metrics` renders them when scraped, as it renders
every other domain tally.

* :class:`FetchMeter`: each verified block a :class:`~kvsp.transfer.block_client.BlockClient`
  got (§6.7), by transport (``http`` for an ``http``/``https`` source, ``moqt`` for a
  ``moqt://`` one) and by source holder: the octets that crossed the wire (an HTTP answer's
  container, header included; a MOQT fetch's object payloads, K ‖ V per layer) and the time
  from request to verified block; a failed attempt counts apart, by its error class (a
  :class:`~kvsp.errors.KVSPError` subclass name: a closed set). The source label is the
  holder's base URI for the first :data:`MAX_SOURCES` distinct holders, then :data:`OTHER`: a
  cluster of thousands of holders cannot grow the exposition without bound.
* :class:`GenerationMeter`: prefix cache queries and hits in **tokens** (the unit of vLLM's
  ``prefix_cache_queries`` and ``prefix_cache_hits``), by path (``generate``: a prompt's
  tokens and the tokens of its leading blocks found held; ``prefetch``: a directive's blocks'
  tokens and those it loaded, §6.5), and the time to first token of each generation.

Bucket bounds are those of vLLM's ``time_to_first_token_seconds`` and of LMCache's
``time_to_retrieve`` histograms, so that dashboards built for them read ours alike.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable

FETCH_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
)
"""Seconds, as LMCache's ``time_to_retrieve``: a block from memory next door to a slow link."""
TTFT_BUCKETS = (*FETCH_BUCKETS, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
"""Seconds, as vLLM's ``time_to_first_token_seconds``: long prompts queue for minutes."""
MAX_SOURCES = 16
"""Distinct source holders that get a label of their own; the rest are :data:`OTHER`."""
OTHER = "other"
TRANSPORTS = ("http", "moqt")
PATHS = ("generate", "prefetch")
"""Where a prefix cache query comes from: a generation's prompt, or a §6.5 directive."""


def transport_of(source: str) -> str:
    """``moqt`` for a source URI of the ``moqt`` family (``moqt``, ``moqt+…``), else ``http``."""
    scheme = source.partition(":")[0].lower()
    return "moqt" if scheme == "moqt" or scheme.startswith("moqt+") else "http"


class Buckets:
    """One histogram's state with Prometheus semantics: a count per upper bound (an
    observation counts in the first bucket whose bound is at least it), the sum and the count."""

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = tuple(sorted(bounds))
        self._counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf only)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        """Count one observation of ``value``."""
        self._counts[bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """``(le, observations ≤ le)`` for every bound and ``+Inf``, as the exposition wants."""
        out = []
        total = 0
        for bound, count in zip(self.bounds, self._counts, strict=False):
            total += count
            out.append((_le(bound), total))
        out.append(("+Inf", self.count))
        return out


def _le(bound: float) -> str:
    return repr(float(bound))


class FetchMeter:
    """Block fetches by ``(transport, source)``: of verified blocks the octets and the seconds
    from request to verified block; of failed ones the count by error class."""

    def __init__(
        self, max_sources: int = MAX_SOURCES, buckets: Iterable[float] = FETCH_BUCKETS
    ) -> None:
        self.max_sources = max_sources
        self.buckets = tuple(buckets)
        self._labelled: set[str] = set()
        self.octets: dict[tuple[str, str], int] = {}
        self.latency: dict[tuple[str, str], Buckets] = {}
        self.failures: dict[tuple[str, str, str], int] = {}
        """(transport, source label, error class name) → failed fetches."""

    def source_label(self, source: str) -> str:
        """The ``source`` label of ``source``: itself while fewer than :attr:`max_sources`
        holders have one (or it has one already), else :data:`OTHER`."""
        if source in self._labelled:
            return source
        if len(self._labelled) < self.max_sources:
            self._labelled.add(source)
            return source
        return OTHER

    def record(self, source: str, octets: int, seconds: float) -> None:
        """A verified block of ``octets`` from ``source`` (a holder base URI) in ``seconds``."""
        key = (transport_of(source), self.source_label(source))
        self.octets[key] = self.octets.get(key, 0) + octets
        histogram = self.latency.get(key)
        if histogram is None:
            histogram = self.latency[key] = Buckets(self.buckets)
        histogram.observe(seconds)

    def record_failure(self, source: str, error: str) -> None:
        """A fetch from ``source`` that failed with the error class named ``error``."""
        key = (transport_of(source), self.source_label(source), error)
        self.failures[key] = self.failures.get(key, 0) + 1

    def octets_by_transport(self) -> dict[str, int]:
        """The octets fetched so far by transport, every source together."""
        out: dict[str, int] = {}
        for (transport, _), octets in self.octets.items():
            out[transport] = out.get(transport, 0) + octets
        return out


class GenerationMeter:
    """An instance's prefix cache queries and hits (tokens, by path) and times to first token."""

    def __init__(self, buckets: Iterable[float] = TTFT_BUCKETS) -> None:
        self.queries: dict[str, int] = dict.fromkeys(PATHS, 0)
        self.hits: dict[str, int] = dict.fromkeys(PATHS, 0)
        self.ttft = Buckets(buckets)

    def count_prefix(self, path: str, asked: int, found: int) -> None:
        """A query of ``asked`` tokens on ``path`` of which the leading ``found`` were held or
        loaded (whole blocks: a partial block is never cached)."""
        self.queries[path] = self.queries.get(path, 0) + asked
        self.hits[path] = self.hits.get(path, 0) + found

    def first_token(self, arrived: float) -> None:
        """The first output token of a generation whose request arrived at ``arrived``
        (:func:`time.perf_counter` seconds)."""
        self.ttft.observe(max(0.0, time.perf_counter() - arrived))


__all__ = [
    "FETCH_BUCKETS",
    "MAX_SOURCES",
    "OTHER",
    "PATHS",
    "TRANSPORTS",
    "TTFT_BUCKETS",
    "Buckets",
    "FetchMeter",
    "GenerationMeter",
    "transport_of",
]
