"""MOQT draft-ietf-moq-transport-16 (ALPN ``moqt-16``): a standalone library (DESIGN.md §2, §4).

Wire, messages, objects and the session are sans-I/O, shaped like aioquic's H3 layer; the
asyncio shell runs them on aioquic or qh3, or on QMux (draft-ietf-quic-qmux-01, MOQT over
QMux per draft-nandakumar-moq-qmux-moqt-00: :mod:`moqt.qmux`, :mod:`moqt.qmux_asyncio`) over
TLS 1.3, plain TCP or a Unix socket. Nothing here knows what the tracks carry: an
application maps its data onto namespaces, tracks, objects and object extensions itself.
"""
