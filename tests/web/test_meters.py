"""The instance's meters (kvsp.web.meters) and how /metrics renders them (kvsp.web.metrics):
histogram semantics, the bound on the source label, and the exposition parsed back with
prometheus_client's own text parser. In-process; the real processes are in test_metrics.py and
test_metrics_transfer.py."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from kvsp.web.meters import OTHER, Buckets, FetchMeter, GenerationMeter, transport_of
from kvsp.web.metrics import fetch_families, generation_families


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


def exposition(*families: Metric) -> list[Sample]:
    """Render ``families`` as /metrics does and parse them back: every sample."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families)))
    text = generate_latest(registry).decode()
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def test_buckets_count_an_observation_at_the_first_bound_not_below_it() -> None:
    buckets = Buckets((0.1, 1.0, 10.0))
    for value in (0.05, 0.1, 0.5, 1.0, 30.0):
        buckets.observe(value)
    assert buckets.cumulative() == [("0.1", 2), ("1.0", 4), ("10.0", 4), ("+Inf", 5)]
    assert buckets.count == 5
    assert buckets.sum == 0.05 + 0.1 + 0.5 + 1.0 + 30.0


def test_transport_follows_the_source_scheme() -> None:
    assert transport_of("moqt://relay.test:4433/") == "moqt"
    assert transport_of("MOQT://relay.test/") == "moqt"
    assert transport_of("moqt+tls://relay.test/") == "moqt"
    assert transport_of("moqtx://relay.test/") == "http"
    assert transport_of("https://holder.test/") == "http"
    assert transport_of("http://127.0.0.1:8080/") == "http"


def test_the_source_label_is_capped_then_other() -> None:
    meter = FetchMeter(max_sources=2)
    sources = [f"http://h{i}.test/" for i in range(5)] + ["moqt://relay.test/"]
    for round_ in range(3):  # a known source keeps its label however often it comes back
        for source in sources:
            meter.record(source, 100, 0.01 * (round_ + 1))
    meter.record_failure("http://h9.test/", "NotFound")
    assert meter.failures == {("http", OTHER, "NotFound"): 1}
    labels = {source for _, source in meter.octets}
    assert labels == {"http://h0.test/", "http://h1.test/", OTHER}
    # every octet is still counted, the overflow under "other" of its own transport
    assert meter.octets[("http", OTHER)] == 3 * 3 * 100
    assert meter.octets[("moqt", OTHER)] == 3 * 100
    assert meter.octets_by_transport() == {"http": 15 * 100, "moqt": 3 * 100}
    assert meter.latency[("http", "http://h0.test/")].count == 3

    samples = exposition(*fetch_families("instance", meter))
    series = {(s.labels["transport"], s.labels["source"]) for s in samples}
    assert series == {
        ("http", "http://h0.test/"),
        ("http", "http://h1.test/"),
        ("http", OTHER),
        ("moqt", OTHER),
    }
    # thousands of holders later, still the same series
    for i in range(5, 2_000):
        meter.record(f"http://h{i}.test/", 1, 0.001)
    later = exposition(*fetch_families("instance", meter))
    assert {(s.labels["transport"], s.labels["source"]) for s in later} == series
    assert len(later) == len(samples)


def test_fetch_families_render_bytes_and_a_full_histogram() -> None:
    meter = FetchMeter()
    meter.record("http://h.test/", 1000, 0.003)
    meter.record("http://h.test/", 500, 0.2)
    meter.record("moqt://relay.test/", 700, 0.03)
    meter.record_failure("http://h.test/", "NotFound")
    meter.record_failure("http://h.test/", "NotFound")
    meter.record_failure("moqt://relay.test/", "TransportError")
    samples = exposition(*fetch_families("instance", meter))

    def one(name: str, **labels: str) -> float:
        found = [s.value for s in samples if s.name == name and labels.items() <= s.labels.items()]
        assert len(found) == 1, (name, labels, found)
        return found[0]

    http = {"transport": "http", "source": "http://h.test/"}
    moqt = {"transport": "moqt", "source": "moqt://relay.test/"}
    assert one("kvsp_block_fetched_bytes_total", **http) == 1500
    assert one("kvsp_block_fetched_bytes_total", **moqt) == 700
    assert one("kvsp_block_fetch_duration_seconds_count", **http) == 2
    assert one("kvsp_block_fetch_duration_seconds_sum", **http) == 0.203
    assert one("kvsp_block_fetch_duration_seconds_bucket", le="0.005", **http) == 1
    assert one("kvsp_block_fetch_duration_seconds_bucket", le="0.1", **http) == 1
    assert one("kvsp_block_fetch_duration_seconds_bucket", le="0.25", **http) == 2
    assert one("kvsp_block_fetch_duration_seconds_bucket", le="+Inf", **http) == 2
    assert one("kvsp_block_fetch_duration_seconds_bucket", le="0.04", **moqt) == 1
    assert one("kvsp_block_fetch_duration_seconds_bucket", le="0.02", **moqt) == 0
    assert one("kvsp_block_fetch_failures_total", error="NotFound", **http) == 2
    assert one("kvsp_block_fetch_failures_total", error="TransportError", **moqt) == 1


def test_generation_families_count_tokens_by_path_and_time_to_first_token() -> None:
    meter = GenerationMeter()
    meter.count_prefix("generate", 37, 32)
    meter.count_prefix("generate", 10, 0)
    meter.count_prefix("prefetch", 64, 48)
    meter.ttft.observe(0.3)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for s in exposition(*generation_families("instance", meter))
    }

    def at(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"service": "instance", **labels}.items())))]

    assert at("kvsp_prefix_cache_queries_total", path="generate") == 47
    assert at("kvsp_prefix_cache_hits_total", path="generate") == 32
    assert at("kvsp_prefix_cache_queries_total", path="prefetch") == 64
    assert at("kvsp_prefix_cache_hits_total", path="prefetch") == 48
    assert at("kvsp_time_to_first_token_seconds_count") == 1
    assert at("kvsp_time_to_first_token_seconds_bucket", le="0.25") == 0
    assert at("kvsp_time_to_first_token_seconds_bucket", le="0.5") == 1
    assert at("kvsp_time_to_first_token_seconds_bucket", le="+Inf") == 1
