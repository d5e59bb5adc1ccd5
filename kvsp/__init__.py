"""KVSP: the KV Cache Storage Protocol, reference implementation.

The top-level modules are the sans-I/O protocol core (spec §4, §6; DESIGN.md §2);
``kvsp.stores``, ``kvsp.web``, ``kvsp.transfer``, ``kvsp.engine``, ``kvsp.services`` and
``kvsp.cli`` are the shells around it. The names below are the public API other tools import;
they are fixed.
"""

from kvsp.compat import CompatibilityDescriptor, compat_id
from kvsp.container import (
    Container,
    decode_container,
    encode_container,
    layer_digest,
    replica_digest,
)
from kvsp.container_reader import ContainerReader
from kvsp.errors import KVSPError
from kvsp.keys import BlockKeyChain, block_keys, scope_id
from kvsp.records import ReplicaRecord

__version__ = "0.1.0"

__all__ = [
    "BlockKeyChain",
    "CompatibilityDescriptor",
    "Container",
    "ContainerReader",
    "KVSPError",
    "ReplicaRecord",
    "__version__",
    "block_keys",
    "compat_id",
    "decode_container",
    "encode_container",
    "layer_digest",
    "replica_digest",
    "scope_id",
]
