"""MOQT draft-ietf-moq-transport-16 (ALPN ``moqt-16``): a standalone library (DESIGN.md §2, §4).

Wire, messages, objects and the session are sans-I/O, shaped like aioquic's H3 layer; the
asyncio shell runs them on aioquic or qh3. Nothing here knows what the tracks carry: an
application maps its data onto namespaces, tracks, objects and object extensions itself.
"""
