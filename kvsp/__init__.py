"""KVSP: the KV Cache Storage Protocol, reference implementation.

The top-level modules are the sans-I/O protocol core (spec §4); ``kvsp.services``,
``kvsp.stores``, ``kvsp.engine`` and ``kvsp.cli`` are the shells around it.
"""

from kvsp.errors import KVSPError

__version__ = "0.1.0"

__all__ = ["KVSPError", "__version__"]
