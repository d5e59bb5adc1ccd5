"""Block transfer (spec §6.7, DESIGN.md §4): moving KVB1 blocks between holders and engines.

HTTP GETs with layer-by-layer verification into caller-owned buffers: :mod:`block_client`
(the one client and replica walk), :mod:`verify` and :mod:`verify_slices`, :mod:`bulk` (the
asyncio HTTP/1.1 client) on the sans-I/O parser :mod:`http11`, and :mod:`buffers`. The
KV-to-MOQT transport: the consumer that FETCHes and SUBSCRIBEs block tracks
(:mod:`moqt_client`, :mod:`moqt_transfer`), the publisher that serves them
(:mod:`moqt_publisher`), and an instance's link to its relay (:mod:`relay_link`).
"""
