"""The simulated cluster's caches against the real Index Service (kvsp/sim/cluster.py, §6.1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvsp.ids import BlockKey
from kvsp.sim.cluster import Holder
from kvsp.sim.config import ClusterConfig, ConfigError, load_config
from kvsp.sim.replicas import ClusterIndex, run_sync


def _keys(tag: int, n: int) -> list[BlockKey]:
    return [BlockKey(bytes([tag, i]) * 16) for i in range(n)]


def _holder(index: ClusterIndex, capacity: int) -> Holder:
    return Holder("https://h.sim.example/kvsp/", capacity=capacity, nic_mbit_per_s=1e5, index=index)


def test_lru_eviction_withdraws_from_the_index() -> None:
    index = ClusterIndex(ClusterConfig())
    holder = _holder(index, capacity=4)
    a, b = _keys(1, 4), _keys(2, 2)
    holder.insert([(k, 0.0) for k in a], 0, publish=True)
    assert len(index.find(a, 1)) == 4
    holder.touch(a[:2])  # a[2], a[3] are now least recently used
    holder.insert([(k, 0.0) for k in b], 2, publish=True)
    assert set(holder.cache) == {*a[:2], *b}
    # After eviction the lookup stops at the first evicted key (§6.2).
    assert len(index.find(a, 3)) == 2 and len(index.find(b, 3)) == 2
    assert index.withdrawn == 2 and holder.evictions == 2


def test_pinned_blocks_are_not_evicted() -> None:
    index = ClusterIndex(ClusterConfig())
    holder = _holder(index, capacity=2)
    a, b = _keys(1, 2), _keys(2, 2)
    holder.insert([(k, 0.0) for k in a], 0, publish=True)
    holder.pin(a)
    holder.insert([(k, 0.0) for k in b], 0, publish=True)
    assert set(a) <= set(holder.cache) and len(index.find(a, 1)) == 2
    holder.unpin(a)
    holder.insert([(k, 0.0) for k in _keys(3, 2)], 0, publish=True)
    assert len(holder.cache) == 2 and len(index.find(a, 1)) == 0


def test_unready_blocks_are_published_only_when_asked() -> None:
    index = ClusterIndex(ClusterConfig())
    holder = _holder(index, capacity=8)
    a = _keys(1, 3)
    holder.insert([(k, 5e6) for k in a], 0, publish=False)
    assert index.find(a, 1) == [] and holder.leading(a) == 3
    holder.publish(a, 5000)
    assert len(index.find(a, 5000)) == 3 and index.published == 3


def test_run_sync_refuses_a_suspending_coroutine() -> None:
    class Suspend:
        def __await__(self):  # type: ignore[no-untyped-def]
            yield None

    async def suspends() -> None:
        await Suspend()

    with pytest.raises(Exception, match="suspended"):
        run_sync(suspends())


def test_config_files_override_defaults(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"instances": 3, "cache_blocks": 64}), encoding="utf-8")
    config = load_config(path)
    assert (config.instances, config.cache_blocks, config.layers) == (3, 64, 80)
    toml = tmp_path / "c.toml"
    toml.write_text("instances = 5\nnic_mbit_per_s = 100000.0\n", encoding="utf-8")
    assert load_config(toml).instances == 5
    assert ClusterConfig().block_bytes == 2 * 80 * 8 * 128 * 2 * 512


@pytest.mark.parametrize(
    "body", ['{"instancez": 3}', '{"instances": 0}', '{"dtype_bytes": 3}', "[1]", "{"]
)
def test_bad_config_files_are_refused(tmp_path: Path, body: str) -> None:
    path = tmp_path / "c.json"
    path.write_text(body, encoding="utf-8")
    with pytest.raises(ConfigError):
        load_config(path)


def test_prefill_model_grows_with_context() -> None:
    config = ClusterConfig()
    assert (
        config.prefill_us(1000, 0)
        < config.prefill_us(1000, 10_000)
        < config.prefill_us(2000, 0) * 2
    )
    assert config.prefill_us(0, 5000) == config.prefill_overhead_us
    assert 7000 < config.prefill_tokens_per_s < 7500
