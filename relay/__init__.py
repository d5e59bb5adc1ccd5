"""The MOQT relay that caches KV block tracks and acts as a KVSP holder (DESIGN.md §1, §4).

Start it with ``kvsp serve relay`` (or ``python -m relay.app``); see :mod:`relay.app` for the
options and the ready-file format. Modules, sans-I/O first:

* :mod:`relay.cache` — objects by (Full Track Name, Group, Object), MAX_CACHE_DURATION,
  malformed-track tombstones, byte budget with LRU by track;
* :mod:`relay.deadlines` — the self-compacting deadline heaps of the relay's upkeep;
* :mod:`relay.routing` — longest-prefix namespace routes, SUBSCRIBE_NAMESPACE prefixes,
  subscription filters;
* :mod:`relay.kv` — cached stored-replica tracks (named by :mod:`kvsp.moqt_mapping`), their
  completion and records;
* :mod:`relay.ingest` — upstream objects checked against the cache and cached;
* :mod:`relay.access` — session tokens and per-request scope rules;
* :mod:`relay.relay`, :mod:`relay.announce`, :mod:`relay.track`, :mod:`relay.downstream`,
  :mod:`relay.fetch`, :mod:`relay.upstream`, :mod:`relay.peer` — the asyncio relay;
* :mod:`relay.holder`, :mod:`relay.web` — Replica Records, leases and the HTTP face;
* :mod:`relay.app` — the command line.
"""
