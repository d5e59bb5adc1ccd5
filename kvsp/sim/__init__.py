"""Placement on real traffic: a discrete-event replay of request traces (the Mooncake FAST'25
format) through KVSP's own placement code (spec §6.1, §6.2, §6.4, §6.5).

Run: ``kvsp sim --trace conversation_trace.jsonl --policy all --beyond-spec --instances auto
--out DIR`` prints one table per trace (average and p90 TTFT, cache hit ratio, GiB fetched,
tokens recomputed, SLO violations) and writes ``DIR/summary.json`` and one PNG of TTFT CDFs per
trace (matplotlib with the Agg backend; without matplotlib the plot is skipped with a message).

What is real and what is simulated. The replica index is the real
:class:`~kvsp.index.IndexService` over a :class:`~kvsp.stores.memory.MemoryStore`: holders
publish each block they finish computing or loading and withdraw it before they evict it; the
KVSP policies look prompts up in it and rank instances with
:func:`~kvsp.placement.choose_instance` over the Instance Status Records the simulated
instances report. Block Keys are the real §4.2 chain (see :mod:`kvsp.sim.trace`). Time, compute
and the network are simulated; ``now_ms`` is the simulated clock.

The documented cluster (:class:`~kvsp.sim.config.ClusterConfig` defaults; a JSON or TOML file
passed with ``--config`` overrides any of them):

* **Instances**: ``instances = 7``. Each is one 8-GPU A800-class node serving a model of
  LLaMA-2-70B geometry (80 layers, 8 KV heads of 128, bf16 KV) with tensor parallelism 8, as a
  prefill instance (Mooncake's prefill/decode split). Decode runs elsewhere and is not
  simulated: TTFT is arrival to the end of prefill, and ``output_length`` is read but unused.
  ``--instances auto`` sizes a trace's cluster so that prefilling every prompt without any
  reuse would keep every instance busy for the trace's duration (7 for the conversation trace,
  10 for the synthetic one): prefill is fully loaded, as in the paper's setting, and only reuse
  gives headroom.
* **Prefill time** of ``n`` new tokens after ``c`` resident ones:
  ``20 ms + 125 µs * n + 0.00234 µs * (n * c + n**2 / 2)``: a fixed overhead, the dense work
  (2 * 69e9 FLOP per token) and causal attention (4 * 80 * 8192 FLOP per attended pair), both
  at 8 * 312 TFLOP/s and 45 % utilization. Instances report ``prefill_tokens_per_s`` = 8,192
  tokens over their prefill time (about 7,300 tokens/s); the §6.4 estimate is linear in tokens,
  the true time is not.
* **Queue**: FIFO, one prefill at a time (``batch_size`` 1: prefill is compute-bound, so
  batching prompts does not raise throughput). The request uses the longest prefix the
  instance holds when it starts.
* **KV cache**: 512-token blocks (the trace's) of 160 MiB (320 KiB per token);
  ``cache_blocks = 4096`` per instance (640 GiB of host memory as the node's KV pool), LRU,
  with a request's blocks touched tail first so a prefix is evicted from its end. Blocks in use
  by a queued or running request, and blocks being sent (a §6.6 lease), are pinned.
* **Network**: an 800 Gbit/s NIC per instance (4 x 200 Gbit/s RDMA), 20 µs RTT; a link runs
  at its slower end. Each NIC direction is a FIFO server: a transfer starts after the RTT and
  once both the source's egress and the target's ingress are free, and each block is resident
  when its last octet arrives.
* **Fetch**: when the KVSP plan is "fetch", the transfers start at placement (a §6.5 prefetch,
  overlapping the queue wait) from the holders the plan names; with ``layerwise_overlap``
  (default on) layers arrive in ascending order (§4.3) and the request finishes at
  ``max(start + P, R + P / 80)`` where ``R`` is when its last used block is resident, else at
  ``max(start, R) + P``. Local hits cost nothing; loaded blocks are then held and published.
* **Store tier** (off: ``store_blocks = 0``): a shared holder with its own LRU capacity, a
  400 Gbit/s NIC, 30 µs RTT and an optional ``store_read_mbit_per_s`` published as the host-tier
  read rate; every computed block is written through to it (not charged on the NICs).
* **Index**: replicas carry a 7-day TTL, so only withdrawal removes them; statuses are fresh at
  every decision (running 0 or 1, queued, ``kv_utilization``, links to every other holder).

Policies: :mod:`kvsp.sim.policies`. The event loop: :mod:`kvsp.sim.engine`. Everything is
deterministic for a seed (only the ``random`` policy draws numbers).
"""
